"""Server-sent events as the relay sees them: whole events, found per the WHATWG rules, and
the usage event the proxy asked for on a client's behalf taken out of a stream.

https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation:
a line ends with CRLF, LF or CR, mixed in one stream if need be (and a CRLF may be cut
between two chunks); an empty line ends an event; a line that starts with ``:`` is a
comment; a field's value loses one leading space; an event's ``data`` lines are joined
with LF. Events are never rewritten here: the bytes that pass are the upstream's.
"""

from __future__ import annotations

import json
import re
from collections import deque

import msgspec

# The end of an event: a line ending, then one or more (the empty line). The whole run of
# line endings goes with the event it ends; a CR is one ending, or the start of a CRLF.
_ENDING = rb"(?:\r\n|\r(?!\n)|\n)"
_EVENT_END = re.compile(_ENDING + _ENDING + rb"[\r\n]*")
# how bytes end where an event ends: LF LF first, as most servers send (then CRLF CRLF)
_EVENT_TAILS = (b"\n\n", b"\n\r\n", b"\r\r", b"\n\r", b"\r\r\n")
_LINE_END = re.compile(rb"\r\n|\r|\n")
_LINE = re.compile(rb"[^\r\n]+")
_ENDINGS = b"\r\n"
_LF = ord("\n")
# Marks found by a byte search, never by parsing. Key names are whole (a JSON string holds
# no line break). The hints pick out the events to look at, by what cannot follow the key
# in one that is none (``null``, ``[{``): whatever else follows, a later data line, a
# comment, is looked at. A compiled pattern, not bytes.find: one pass for both marks, and
# no per-call setup, which dominates on a one-token event. The finishing hint (a
# ``finish_reason`` is null while tokens flow) leaves out the name's opening quote: a
# search led by a byte as common in JSON as ``"`` stops at each one (twice the time).
_FINISHING_HINT = re.compile(rb'finish_reason"(?!: ?null)')
_MARKS_HINT = re.compile(rb'"finish_reason"(?!: ?null)|"choices"(?!: ?\[\{)')
# The marks in an event looked at: between the tokens, JSON space, or where the data goes
# on in a later ``data:`` line, lines that are not data (comments, other fields). Atomic: a
# gap is never matched two ways, whatever a backend sends.
_GAP = rb"(?>(?:[ \t\r\n]|(?<=[\r\n])(?:data:?|(?!data[:\r\n])[^\r\n]*))*)"
_FINISHING = re.compile(rb'"finish_reason"' + _GAP + rb":" + _GAP + rb'"')
_NO_CHOICES = re.compile(rb'"choices"' + _GAP + rb":" + _GAP + rb"\[" + _GAP + rb"\]")
_USAGE = b'"usage"'
_TAIL_BYTES = 16384  # enough to hold a stream's last events, where its usage is
_DECODE = msgspec.json.Decoder().decode
_FINGERPRINT = re.compile(rb'"system_fingerprint":(\s*)("[^"]*"|null)')


class UsageStripper:
    """Drops the usage-only event that the proxy asked for and the client did not.

    Whole events pass at once, as they came, unless they hold a finishing or a usage-only
    mark (see ``_MARKS_HINT``): a finishing event waits for the next one, because vLLM
    moves its ``system_fingerprint`` from the finishing chunk to the usage chunk when usage
    is asked for; it is moved back, so the client gets exactly the events it asked for. The usage
    chunk comes after the last choice has finished, so until one has, each chunk is
    searched for the finishing mark only. An event is dropped only once its data has been
    parsed: a JSON object with ``"choices": []`` and a ``"usage"``.

    The common case, chunks of whole events with no mark, is passed on uncopied; an event
    cut between chunks is kept until its end arrives (as a list of pieces, so that a huge
    event is not copied once per chunk).
    """

    def __init__(self) -> None:
        self._partial: list[bytes] = []  # an event not complete yet, in pieces
        self._size = 0  # the bytes in those pieces
        self._held = b""  # a finishing event, until we know whether usage follows it
        self._finished = False  # a choice has finished: the usage chunk may come from now on
        # the last event was dropped: line endings that arrive next end it, and go with it
        self._dropped = False

    def feed(self, chunk: bytes) -> bytes:
        if self._partial or self._held or self._dropped or not chunk.endswith(_EVENT_TAILS):
            return self._events(chunk)
        found = (_MARKS_HINT if self._finished else _FINISHING_HINT).search(chunk)
        if found is None:
            return chunk  # whole events, as servers send them: passed on uncopied
        start = _last_end(chunk, found.start())  # the events before the first marked one
        if not start:
            return self._events(chunk)
        return b"".join((memoryview(chunk)[:start], self._events(chunk[start:])))  # one copy

    def close(self) -> bytes:
        """What is left at the end of the stream: an event held, and one that no empty line
        ended (a client discards it, but it is the upstream's to send)."""
        out: list[bytes] = []
        if self._partial:
            event, self._partial = b"".join(self._partial), []
            self._event(event, out)
        if self._held:
            out.append(self._held)
            self._held = b""
        return b"".join(out)

    def _events(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        if not chunk:
            return b""
        if self._partial:
            # The event so far has no end in it, its last line ending at most: an end that
            # starts there is found with the new bytes, which alone are searched.
            last, ending, probe = self._partial[-1], 0, chunk
            if last[-1] in _ENDINGS:
                ending = len(last) - len(last.rstrip(_ENDINGS))
                probe = last[len(last) - ending :] + chunk
            cut = _last_end(probe, len(probe))
            if not cut:
                self._partial.append(chunk)
                self._size += len(chunk)
                return b""
            data = b"".join([*self._partial, chunk])
            cut += self._size - ending
            self._partial = []
        else:
            data = chunk.lstrip(_ENDINGS)
            if len(data) < len(chunk):  # more empty lines, or a CRLF's LF: the last event's
                self._after(chunk[: len(chunk) - len(data)], out)
            cut = _last_end(data, len(data))
        if cut < len(data):
            self._partial = [data[cut:]]
            self._size = len(data) - cut
        if not cut:
            return b"".join(out)
        marks = _MARKS_HINT if self._finished else _FINISHING_HINT
        found = None if self._held else marks.search(data, 0, cut)
        start = cut if found is None and not self._held else 0
        if found is not None:
            start = _last_end(data, found.start())
        if start:  # the events before the first one marked go as they came
            out.append(data if start == len(data) else data[:start])
            self._dropped = False
        if start < cut:
            for end in _event_ends(data, start, cut):  # the rest one by one
                self._event(data[start:end], out)
                start = end
        return b"".join(out)

    def _event(self, event: bytes, out: list[bytes]) -> None:
        """One whole event (or one that the stream's end cut short)."""
        usage = _usage_only_data(event) if self._finished else None
        if usage is not None:
            self._held = _with_fingerprint_of(self._held, usage)
            self._dropped = True
            return
        self._dropped = False
        if self._held and event_data(event) is None:  # a comment, say: not an event
            self._held += event
            return
        if self._held:
            out.append(self._held)
            self._held = b""
        if _FINISHING.search(event):
            self._held = event
            self._finished = True
        else:
            out.append(event)

    def _after(self, endings: bytes, out: list[bytes]) -> None:
        """Line endings that arrive after an event has ended go wherever that event went."""
        if self._dropped:
            return
        if self._held:
            self._held += endings
        else:
            out.append(endings)


class TokenEvents:
    """A stream's tail, where its usage is, and its token events: the tokens of a server
    that reports no usage (llama-cpp-python), and of a stream whose client left before its
    usage came (what its org is billed, docs/usage-and-budgets.md). One event per token,
    each with a null ``finish_reason``, plus a chat's opening event that carries the role
    alone. Marks are counted as bytes (a JSON string cannot hold ``"role"`` unescaped) with
    ``bytes.count``, a third of a regex's time, across chunk boundaries: the end of the
    chunk before is counted again with the next, and what it held alone taken off.

    Counted late: the last chunks, ``tail_bytes`` of them, are kept for the tail, and a
    chunk is counted when it leaves them or when ``tokens`` is read. A stream whose usage
    came is never asked, so its last ``tail_bytes`` (all of a short stream's, which a fast
    backend sends in one burst) are never searched.
    """

    # as servers write it: compact (vLLM, SGLang, TGI) or with Python's ": " (llama-cpp-python)
    _TOKEN = (b'"finish_reason":null', b'"finish_reason": null')
    _CARRY = len(b'"finish_reason": null') - 1  # the longest mark, but its last byte

    def __init__(self, tail_bytes: int = _TAIL_BYTES) -> None:
        self._tail_bytes = tail_bytes
        self._kept: deque[bytes] = deque()  # the last chunks, counted or not
        self._size = 0  # the bytes in them
        self._unseen = 0  # how many of the last of them are not counted yet
        self._tokens = 0
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        kept = self._kept
        kept.append(chunk)
        self._size += len(chunk)
        self._unseen += 1
        while self._size - len(kept[0]) >= self._tail_bytes:
            self._size -= len(kept[0])
            if self._unseen == len(kept):
                self._count(kept[0])
                self._unseen -= 1
            kept.popleft()

    @property
    def tokens(self) -> int:
        """The token events relayed so far."""
        for chunk in list(self._kept)[len(self._kept) - self._unseen :]:
            self._count(chunk)
        self._unseen = 0
        return self._tokens

    def tail(self) -> bytes:
        """The stream's last ``tail_bytes`` (all of it, if shorter)."""
        return b"".join(self._kept)[-self._tail_bytes :]

    def _count(self, chunk: bytes) -> None:
        data = self._carry + chunk
        self._tokens += self._marks(data) - self._marks(self._carry)
        self._carry = data[-self._CARRY :]

    @classmethod
    def _marks(cls, data: bytes) -> int:
        return sum(data.count(mark) for mark in cls._TOKEN) - data.count(b'"role"')


def _last_end(data: bytes, endpos: int) -> int:
    """Where the last event that ends before ``endpos`` ends (0: none does)."""
    if b"\r" not in data:  # LF only: a plain search, from the end
        at = data.rfind(b"\n\n", 0, endpos)
        return at + 2 if at >= 0 else 0
    last = 0
    for last_end in _EVENT_END.finditer(data, 0, endpos):
        last = last_end.end()
    return last


def _event_ends(data: bytes, pos: int, endpos: int) -> list[int]:
    """Where each event that ends between ``pos`` and ``endpos`` ends."""
    if b"\r" in data:  # the pattern: it is tried at every byte (~20 ns a byte)
        return [found.end() for found in _EVENT_END.finditer(data, pos, endpos)]
    ends = []  # LF only: a plain search for each empty line, then the run of LFs after it
    at = data.find(b"\n\n", pos, endpos)
    while at >= 0:
        end = at + 2
        while end < endpos and data[end] == _LF:
            end += 1
        ends.append(end)
        at = data.find(b"\n\n", end, endpos)
    return ends


def ends_event(data: bytes) -> bool:
    """Whether ``data`` (a stream's bytes so far) ends where an event ends."""
    return not data or len(_LINE_END.findall(data, len(data.rstrip(_ENDINGS)))) >= 2


def event_data(event: bytes) -> bytes | None:
    """The data of one event (its ``data`` lines' values joined with LF), None if none."""
    body = event.rstrip(_ENDINGS)
    if body.startswith(b"data:") and b"\n" not in body and b"\r" not in body:  # one line
        return body[6:] if body.startswith(b" ", 5) else body[5:]
    values = [
        value[1:] if value.startswith(b" ") else value
        for name, _, value in (line.partition(b":") for line in _LINE_END.split(event))
        if name == b"data"
    ]
    return b"\n".join(values) if values else None


def continued_data(text: bytes) -> bytes:
    """``text``, which starts inside an event's data, as the data it is to the end of that
    event: the ``data:`` of the lines that follow taken out, other lines left out."""
    first, *lines = _LINE_END.split(text)
    values = [first]
    for line in lines:
        if not line:  # the event ends
            break
        name, _, value = line.partition(b":")
        if name == b"data":
            values.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(values)


def _usage_only_data(event: bytes) -> bytes | None:
    """The data of a usage-only event (``"choices": []`` and a ``"usage"``), else None."""
    if _USAGE not in event or _NO_CHOICES.search(event) is None:
        return None
    data = event_data(event)
    if data is None:
        return None
    try:  # msgspec first: what it reads, the stdlib reads alike (inference_request.py)
        chunk = _DECODE(data)
    except (ValueError, RecursionError):  # a msgspec.DecodeError, as for any bad JSON
        try:  # str, not bytes: json.loads of bytes first guesses their encoding
            chunk = json.loads(data.decode())
        except (ValueError, RecursionError):  # not UTF-8 (a UnicodeDecodeError), not JSON
            return None
    if isinstance(chunk, dict) and chunk.get("choices") == [] and "usage" in chunk:
        return data
    return None


def _with_fingerprint_of(finishing: bytes, usage_data: bytes) -> bytes:
    """Put the usage event's ``system_fingerprint`` back on the finishing event (vLLM): in
    its last data line, before the brace that ends it."""
    found = _FINGERPRINT.search(usage_data)
    if not finishing or found is None or b'"system_fingerprint"' in finishing:
        return finishing
    fingerprint = found.group(0)
    if b"\n" in found.group(1):  # the value was on a data line of its own
        fingerprint = b'"system_fingerprint":' + found.group(2)
    for line in reversed(list(_LINE.finditer(finishing))):
        name, colon, _ = line.group().partition(b":")
        if name != b"data":
            continue
        brace = finishing.rfind(b"}", line.start() + len(name) + len(colon), line.end())
        if brace < 0 or finishing[brace + 1 : line.end()].strip():
            return finishing
        return finishing[:brace] + b"," + fingerprint + finishing[brace:]
    return finishing
