"""One line per finished inference request, as JSON or ``key=value`` text (the format of the
process's logs, ``logs.choose``: never switched by what stdout happens to be).

A line says when (``ts``, the time it was emitted), who (org, the key's name, class, pool),
what (model, backend, status, outcome), how much (estimated cost, tokens used) and how long
(queue wait, upstream time) — never a prompt, never a key. Like the operational log's, every
line has ``ts``, ``level`` (always ``info``) and ``logger`` (``sfq_proxy.access``).

Nothing a client sends reaches a line unbounded: the model it names is cut to 256 characters
(``core.errors.cut``; the one text of a line a client writes freely, a 404's model name
being any string the body holds), its ``X-Request-Id`` is kept only up to 128, and a line
longer than ``MAX_LINE_CHARS`` all the same has every text cut.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, fields
from typing import IO, Any

import msgspec

from ..core.errors import CUT_CHARS, cut
from . import logs

REQUEST_ID_HEADER = "X-Request-Id"
LOGGER = "sfq_proxy.access"
# longer than a line of texts ``cut`` left whole (unless escapes lengthen them); a usual
# line is some 400
MAX_LINE_CHARS = 8192


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    trace_id: str | None = None  # of the client's valid W3C traceparent (32 hex digits)
    org: str | None = None
    key: str | None = None  # the key's name (keys[i].name, else "<org>#<i>"), never the key
    cls: str | None = None
    pool: str | None = None
    model: str | None = None
    backend: str | None = None
    status: int | None = None
    outcome: str | None = None
    # why it was not completed: a rejection's reason (rate, deadline, …), or the code of a
    # failure's error (upstream_timeout, upstream_cut, deadline, bad_gateway, internal_error)
    reason: str | None = None
    cost: float | None = None  # charged (the estimate)
    cost_actual: float | None = None  # the same formula on the usage reported
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    queue_wait_s: float = 0.0
    upstream_s: float | None = None
    retries: int = 0

    @classmethod
    def for_request(cls, headers: Any) -> AccessRecord:
        """Propagate the client's ``X-Request-Id`` (if sane) or make one."""
        given = headers.get(REQUEST_ID_HEADER, "")
        ok = 0 < len(given) <= 128 and given.isprintable()
        # an id need not be secret, only unique: no system call for it on the hot path
        return cls(request_id=given if ok else f"{random.getrandbits(128):032x}")

    def emit(self) -> None:
        if _sink is not None:  # on the hot path: build nothing nobody prints
            _sink.write({name: getattr(self, attr) for name, attr in _FIELDS})


_FIELDS = [(f.name if f.name != "cls" else "class", f.name) for f in fields(AccessRecord)]


class _Sink:
    """Lines finished in one turn of the event loop leave in one write.

    Not ``logging``: its records, handler lock and flush per line cost more than the rest
    of the access log on a proxy's hot path. Nothing is held back once the loop turns. The
    timestamp is read per line (``time.time()``, ~50 ns) but formatted once per millisecond.
    """

    def __init__(self, stream: IO[str], fmt: logs.LogFormat) -> None:
        self._stream = stream
        self._format = _text if fmt == "text" else _json
        # a model longer than ``cut`` leaves makes a line longer than this: the shortest
        # line there can be (every field null, or left out), less its model's "null", and
        # CUT_CHARS more (a quoted model of CUT_CHARS + 1 characters is that long, at least)
        empty = {name: getattr(AccessRecord(""), attr) for name, attr in _FIELDS}
        self._long = len(self._format(_TS_SHAPE, empty)) - len("null") + CUT_CHARS
        self._lines: list[str] = []
        self._milli = -1  # the millisecond self._ts says
        self._second = -1  # the second self._date says
        self._date = ""
        self._ts = ""

    def write(self, fields: dict[str, Any]) -> None:
        if not self._lines:
            asyncio.get_running_loop().call_soon(self.flush)
        milli = int(_clock() * 1000)
        if milli != self._milli:
            self._milli = milli
            second, rest = divmod(milli, 1000)
            if second != self._second:
                self._second = second
                self._date = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._ts = f"{self._date}.{rest:03d}Z"
        line = self._format(self._ts, fields)
        if len(line) > self._long:  # it may hold a long text: one comparison for the others
            line = self._cut(fields, line)
        self._lines.append(line)

    def _cut(self, fields: dict[str, Any], line: str) -> str:
        """``line`` of ``fields`` with its model cut, and every text if it is still longer
        than ``MAX_LINE_CHARS``."""
        model = fields["model"]
        if model is not None and len(model) > CUT_CHARS:  # a client's, for a 404
            fields["model"] = cut(model)
            line = self._format(self._ts, fields)
        if len(line) > MAX_LINE_CHARS:  # a text nobody thought a client could make long
            fields = {k: cut(v) if isinstance(v, str) else v for k, v in fields.items()}
            line = self._format(self._ts, fields)
        return line

    def flush(self) -> None:
        if self._lines:
            self._stream.write("\n".join(self._lines) + "\n")
            self._lines.clear()
            self._stream.flush()


_clock = time.time
_encode = msgspec.json.Encoder().encode  # ~15× the stdlib's speed, and as compact
# the stdlib's, for a line msgspec would not write as ASCII: stdout may not take UTF-8, and
# a lone surrogate (which no field should hold) is escaped rather than refused
_ascii = json.JSONEncoder(check_circular=False, separators=(",", ":")).encode
_TS_SHAPE = "2025-01-01T00:00:00.000Z"  # every ts is as long
_JSON_HEAD = f'","level":"info","logger":"{LOGGER}",'
_TEXT_HEAD = f" INFO {LOGGER}: "


def _json(ts: str, fields: dict[str, Any]) -> str:
    try:
        encoded = _encode(fields).decode()
    except UnicodeEncodeError:  # a lone surrogate
        encoded = _ascii(fields)
    if not encoded.isascii():  # a model's name or a key's can hold any text
        encoded = _ascii(fields)
    # the encoded fields less their "{", after ts, level and logger: no second dict to build
    return f'{{"ts":"{ts}{_JSON_HEAD}{encoded[1:]}'


def _text(ts: str, fields: dict[str, Any]) -> str:
    return ts + _TEXT_HEAD + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


_sink: _Sink | None = None


def configure(stream: IO[str] | None = sys.stdout, fmt: logs.LogFormat | None = None) -> None:
    """Send access lines to ``stream`` in ``fmt`` (None: the process's log format, see
    ``logs.choose``); a ``stream`` of None: nowhere."""
    global _sink
    if _sink is not None:
        _sink.flush()
    _sink = None if stream is None else _Sink(stream, fmt or logs.log_format())
