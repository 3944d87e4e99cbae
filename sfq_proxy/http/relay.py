"""Forward one dispatched request to its backend and relay the answer as it arrives.

Nothing a backend sends can break the pool: an answer that is not HTTP, or that breaks off
before the client saw anything, is ``UpstreamFailed`` (a retry elsewhere, else a 502, or the
504 it carries); a stream that breaks off after its first bytes ends with an error event
(``Relayed.fault``); usage counts that are not sane token counts are ignored.

The relay only reports what happened; whether the backend is taken out is decided where
health is (the handler tells the pool, see ``backend_failed``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.http_writer import StreamWriter

from ..core.errors import ApiError, Expiry
from ..core.inference_request import InferenceRequest
from ..core.placement import Backend
from ..state.pool import Pool
from .answer import (
    ACCEPT_ENCODING,
    Inflater,
    UndecodableAnswer,
    decoded,
    inflater_for,
    response_headers,
)
from .client_watch import ClientWatch
from .drain import ANSWERING, CUT_MESSAGE, absorbed
from .sse import TokenEvents, continued_data, ends_event
from .sse import UsageStripper as _UsageStripper
from .upstream import Answer, Upstreams

log = logging.getLogger(__name__)
QUEUE_WAIT_HEADER = "X-Queue-Wait"
COST_HEADER = "X-Cost-Charged"
OUT_OF_TIME = Expiry(504, "The request's time bound passed.", code="deadline")
_USAGE = b'"usage"'
# a stream's token events as counted so far (``sse.TokenEvents``), on its client's request
STREAM_TOKENS = web.RequestKey("sfq_stream_tokens", TokenEvents)
_WATCH_FIRST = 16384  # a last write larger than this may wait for the client: watched first
_USAGE_BYTES = 4096  # more than any usage object: the part of the tail that is parsed
_DECODER = json.JSONDecoder()
# an error instead of an answer: an event whose first data line is an OpenAI error object,
# or (the Responses API) an ``error`` or ``response.failed`` event
# An error event: ``data: {"error": …`` or ``event: error`` / ``event: response.failed``
# where a line starts. Each search begins with a literal, so the regex engine leaps between
# the places it occurs; one pattern led by ``(?:^|[\r\n])`` tried every byte instead
# (40 ns a byte: 1.6 ms for a 40 KiB tail). What precedes ``"error":`` is checked in a
# window before it.
_ERROR_MEMBER = re.compile(rb'"error"\s*:')
_DATA_OPEN = re.compile(rb"(?:^|[\r\n])data: ?\{\s*\Z")
_OPEN_AT_MOST = 256  # bytes of ``data: {`` and blanks before the member
_ERROR_TYPE = re.compile(rb"event: ?(?:error|response\.failed)[ \t]*[\r\n]")
MAX_USAGE_TOKENS = 1_000_000_000  # a usage count above this is a lying backend, not usage
_ERROR_STATUSES = frozenset({429, 503})  # what must say when to come back


class UpstreamFailed(Exception):
    """The backend failed before the client was sent anything: retrying elsewhere is safe,
    unless ``answer`` says what the client gets instead (no headers within
    ``first_byte_s``, or a body that went silent: 504). It counts against the backend's
    health unless ``counts`` says otherwise (a late answer from a backend that answered
    others meanwhile: see ``_open``)."""

    def __init__(self, reason: str, answer: ApiError | None = None, *, counts: bool = True) -> None:
        super().__init__(reason)
        self.answer = answer
        self.counts = counts


class UpstreamStalled(aiohttp.ClientPayloadError):
    """The backend sent nothing for ``timeouts.idle_s`` after its headers."""


class UpstreamDeadline(aiohttp.ClientPayloadError):
    """The request's bound (its class's ``max_request_s`` or the client's
    ``X-Request-Timeout``) passed while its answer was being read."""


class _Watchdog:
    """Ends a read from ``reader`` once the backend has been silent for ``idle_s``
    (``UpstreamStalled``), or at ``until`` (on the loop's clock), the end of the request's
    bound (``UpstreamDeadline``), whichever comes first.

    One timer per answer, re-armed when it fires rather than per chunk: the loop only notes
    the time of each chunk. The read is ended by putting an error into the reader, which
    wakes it even where closing the connection would not (aiohttp's C parser leaves a read
    waiting forever after a malformed chunk).
    """

    def __init__(
        self,
        reader: aiohttp.StreamReader,
        idle_s: float,
        until: float = math.inf,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = reader
        self._idle_s = idle_s
        self._until = until
        self.progress = self._loop.time()
        self._timer = self._loop.call_at(min(self.progress + idle_s, until), self._check)

    def _check(self) -> None:
        now, deadline = self._loop.time(), self.progress + self._idle_s
        if now >= self._until:
            self._reader.set_exception(UpstreamDeadline("the request's bound passed"))
        elif now < deadline:  # it sent since: look again later
            wake = min(deadline, self._until)
            self._timer = self._loop.call_at(wake, self._check)
        else:
            self._reader.set_exception(UpstreamStalled(f"silent for {self._idle_s:g} s"))

    def progressed(self) -> None:
        """The backend sent a chunk: its silence counts from now."""
        self.progress = self._loop.time()

    def cancel(self) -> None:
        self._timer.cancel()


@dataclass(slots=True)
class Relayed:
    """The answer relayed, with what the proxy saw of it (for metrics and the access log)."""

    response: web.StreamResponse
    upstream_s: float  # send → last byte
    first_chunk_s: float | None = None  # send → first streamed chunk (time to first token)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # why the stream broke off after it started (and ended with an error event): the
    # backend's "upstream_cut" or "upstream_timeout", the request's bound ("deadline"), the
    # drain's deadline ("shutting_down"), or "proxy" for a fault of our own
    fault: str | None = None
    tail: bytes = b""  # the end of a 200 answer, where its usage is (see ``read_usage``)
    events: TokenEvents | None = None  # a stream's token events


async def forward(
    upstreams: Upstreams,
    pool: Pool,
    backend: Backend,
    client: web.Request,
    inference: InferenceRequest,
    request_id: str,
    own_headers: Mapping[str, str],
    on_headers: Callable[[float], None],
    *,
    expires_at: float | None = None,
    expiry: Expiry = OUT_OF_TIME,
    on_upstream_end: Callable[[Relayed], None] | None = None,
    upstream_headers: Mapping[str, str] | None = None,
    answer_buffer: float = math.inf,
) -> Relayed:
    """Send ``inference`` to ``backend`` and relay its answer to ``client``.

    Upstream it carries ``upstream_headers`` besides the proxy's own (the client's valid
    W3C trace context), never the client's key.

    The answer carries the upstream's end-to-end headers (see ``answer.DROPPED_HEADERS``) and,
    replacing any of the same name, ``own_headers``: the proxy's ``X-Request-Id``,
    ``X-Queue-Wait`` (seconds spent queued in the proxy, retries included, so a client can
    tell waiting from generating) and ``X-Cost-Charged`` (what its flow's meter was charged).
    A body the upstream compressed anyway is passed on decoded (see ``answer.inflater_for``).

    ``on_headers`` learns the time to the response headers as soon as they arrive, even if
    the relay is cancelled later.

    Streams are relayed chunk by chunk as the backend sends them, never waiting for the
    client to read: what it has not taken waits in its connection, at most
    ``answer_buffer`` bytes, and the client is cut (``ClientWatch``) beyond that or after
    the pool's ``timeouts.client_write_s`` without taking a byte. Anything else is read
    whole and returned unsent with its status (``deliver`` sends it). The upstream
    connection is closed at once when the client goes away (the handler is cancelled),
    which makes vLLM abort the generation.

    At ``expires_at`` (on the pool's clock: the end of the request's bound) the exchange
    ends: ``expiry``'s error (a 504 ``deadline``) is raised while nothing reached the
    client, and a stream ends with a ``deadline`` error event (its message).
    ``on_upstream_end`` learns of a stream as soon as its backend is done with (ended,
    broken off, stalled or out of time), before the client is sent its last bytes, so that
    the slot is free at once; the backend's connection is given back then too.
    """
    sent = pool.clock()
    remaining = math.inf if expires_at is None else max(0.0, expires_at - sent)
    until = asyncio.get_running_loop().time() + remaining
    upstream = await _open(
        upstreams, pool, backend, inference, request_id, sent, remaining, expiry, upstream_headers
    )
    backend.answered_at = answered = pool.clock()
    on_headers(answered - sent)
    pool.observe_answer(upstream.status, upstream.headers, sent)  # a 429 holds the pool
    try:
        try:
            inflater = inflater_for(upstream)
        except UndecodableAnswer as exc:
            log.warning("pool %s: backend %s: %s", pool.name, backend.name, exc)
            raise UpstreamFailed(str(exc)) from None
        headers = response_headers(upstream, own_headers)
        if upstream.status in _ERROR_STATUSES:
            headers.setdefault("Retry-After", "1")
        if not (inference.stream and upstream.status == 200):
            body = await _whole_body(upstream, pool, inflater, until, expiry)
            response: web.StreamResponse = web.Response(
                status=upstream.status, body=body, headers=headers
            )
            return Relayed(
                response, pool.clock() - sent, tail=body if upstream.status == 200 else b""
            )
        headers.setdefault("Cache-Control", "no-cache")
        response = web.StreamResponse(status=200, headers=headers)
        client[ANSWERING] = True  # a cut of the drain no longer answers it anew (drain.py)
        writer = await response.prepare(client)
        assert isinstance(writer, StreamWriter)  # its write(drain=False) is aiohttp's own
        watch = ClientWatch(client, writer, pool.spec.timeouts.client_write_s, answer_buffer)
        relayed = Relayed(response, 0.0)

        def upstream_end() -> None:
            """The backend is done with: its stream ended, broke off, stalled or ran out
            of time."""
            relayed.upstream_s = pool.clock() - sent
            if relayed.fault is not None:
                upstream.close()  # stop the backend's work at once (vLLM aborts)
            else:
                upstream.release()  # read to its end: kept for the next request
            if on_upstream_end is not None:
                try:
                    on_upstream_end(relayed)
                except Exception:  # counting must not keep the stream from its end
                    log.exception("pool %s: ending a stream's upstream failed", pool.name)

        watchdog = _Watchdog(upstream.content, pool.spec.timeouts.idle_s, until)

        # its tokens where no usage comes: a server that reports none, or a client that
        # leaves before it (the handler reads them here then: they are what its org pays)
        counter = client[STREAM_TOKENS] = TokenEvents()
        await _relay_stream(
            upstream, relayed, inference.strip_usage, pool, sent, inflater, counter, watch,
            watchdog=watchdog, expiry=expiry, upstream_end=upstream_end,
        )  # fmt: skip
        return relayed
    except BaseException:
        upstream.close()
        raise
    finally:
        upstream.release()


async def deliver(client: web.Request, relayed: Relayed, write_s: float) -> None:
    """Send ``client`` a whole answer (``forward`` read it before anything was sent), not a
    stream (sent already): a client that takes no byte of it for ``write_s`` seconds is cut
    as a stream's is (``ClientWatch``). Held whole already, it is not bounded by
    ``answer_buffer``."""
    response = relayed.response
    if response.prepared or not isinstance(response, web.Response):
        return
    client[ANSWERING] = True  # from now on a cut of the drain can only close it
    writer = await response.prepare(client)
    assert isinstance(writer, StreamWriter)
    body = response.body
    watch = None
    if isinstance(body, bytes) and len(body) > _WATCH_FIRST:  # its write may wait for it
        watch = ClientWatch(client, writer, write_s, math.inf)
        watch.watch()
    await response.write_eof()  # the headers and the body, in one write
    transport = client.transport
    if transport is not None and transport.get_write_buffer_size():  # not all taken yet
        (watch or ClientWatch(client, writer, write_s, math.inf)).wrote()


async def _whole_body(
    upstream: Answer,
    pool: Pool,
    inflater: Inflater | None,
    until: float,
    expiry: Expiry,
) -> bytes:
    """A whole answer's body, decoded, read before the client is sent anything: whatever
    goes wrong is still an ``UpstreamFailed`` (or the 504 of the request's bound). A body
    that came whole with its headers (most JSON answers) has nothing left to wait for: no
    timer is set for it."""
    content = upstream.content
    watchdog = None if content.is_eof() else _Watchdog(content, pool.spec.timeouts.idle_s, until)
    try:
        body = await upstream.read()
        return body if inflater is None else inflater.feed(body) + inflater.close()
    except UpstreamDeadline:
        raise expiry.error() from None
    except UpstreamStalled as exc:  # not retried: the backend got the request
        raise UpstreamFailed(str(exc), _stalled(pool)) from None
    except aiohttp.ClientError as exc:  # died before answering: the client saw nothing
        raise UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if watchdog is not None:
            watchdog.cancel()


async def _relay_stream(
    upstream: Answer,
    relayed: Relayed,
    strip_usage: bool,
    pool: Pool,
    sent: float,
    inflater: Inflater | None,
    counter: TokenEvents,
    watch: ClientWatch,
    *,
    watchdog: _Watchdog | None = None,
    expiry: Expiry = OUT_OF_TIME,
    upstream_end: Callable[[], None] | None = None,
) -> None:
    """Write the stream's bytes as they come (decoded by ``inflater`` when the upstream
    compressed them), then end it; keep only its tail, where the usage is. A stream that
    breaks off, stalls (``watchdog``) or outlives its request's bound ends with an error
    event: its client is told, and every later request finds the pool whole.
    ``upstream_end`` is called once the backend is done with, before the last write.

    A write never waits for the client (``watch`` looks after it): the backend is read as
    fast as it sends, and let go as soon as it is done; only the last write waits, for a
    client that has yet to take what its connection holds, watched."""
    written = b""  # the last bytes the client was sent
    stripper = _UsageStripper() if strip_usage else None
    if watchdog is None:
        watchdog = _Watchdog(upstream.content, pool.spec.timeouts.idle_s)
    message = _CUT
    write = watch.writer.write
    try:
        chunks = upstream.content.iter_any()
        async for chunk in chunks if inflater is None else decoded(chunks, inflater):
            if relayed.first_chunk_s is None:
                relayed.first_chunk_s = pool.clock() - sent
            counter.feed(chunk)
            out = chunk if stripper is None else stripper.feed(chunk)
            if out:
                written = out
                await write(out, drain=False)
                watch.wrote()
            watchdog.progressed()
    except ConnectionResetError:  # the client left as we wrote, or was cut (ClientCut)
        raise
    except asyncio.CancelledError as cancelled:  # the drain's deadline ends it (drain.py)
        if not absorbed(cancelled):  # the client left
            raise
        relayed.fault = "shutting_down"
        message = CUT_MESSAGE
    except UpstreamDeadline:  # the request's bound: nobody's fault
        relayed.fault = "deadline"
        message = expiry.message
    except aiohttp.ClientError as exc:  # bad chunking, early close, silence: the backend's
        log.warning("pool %s: a backend broke off a stream: %s", pool.name, exc)
        if isinstance(exc, UpstreamStalled):
            relayed.fault = "upstream_timeout"
            message = f"{_CUT[:-1]}: the backend was {exc.args[0]}."
        else:
            relayed.fault = "upstream_cut"
    except Exception:  # a fault of ours: the answer has started, so it must end here
        log.exception("pool %s: relaying a stream failed", pool.name)
        relayed.fault = "proxy"
    finally:
        watchdog.cancel()
    relayed.tail = counter.tail()
    relayed.events = counter  # its tokens, where no usage comes (read_usage)
    if upstream_end is not None:  # its usage is known now: the slot's true-up reads it
        upstream_end()
    rest = b""
    if stripper is not None and relayed.fault != "proxy":  # a stripper that failed: not again
        rest = stripper.close()  # an event held back, one that no empty line ended
    if relayed.fault is not None:
        at_boundary = ends_event(rest or written)  # whatever its line endings
        rest += (b"" if at_boundary else b"\n\n") + _error_event(relayed.fault, message)
    await _last_write(relayed.response, watch, rest)


async def _last_write(response: web.StreamResponse, watch: ClientWatch, rest: bytes) -> None:
    """End the answer with ``rest`` in one write, and wait while its connection holds more
    than its high-water mark (aiohttp's drain): the client watched meanwhile, and after
    (what it has yet to take stays watched once the handler returns). The watch is on
    already when the client was behind; only a large last write can make it so."""
    if len(rest) > _WATCH_FIRST:
        watch.watch()
    await response.write_eof(rest)
    watch.wrote()


def backend_failed(relayed: Relayed) -> bool:
    """Whether an answer counts against its backend's health: a 5xx, or a stream that the
    backend broke off or stalled (not one that a fault of the proxy's own, or the request's
    bound, ended)."""
    return relayed.response.status >= 500 or relayed.fault in ("upstream_cut", "upstream_timeout")


def _stalled(pool: Pool) -> ApiError:
    idle_s = pool.spec.timeouts.idle_s
    return ApiError(504, f"The backend went silent for {idle_s:g} s.", code="upstream_timeout")


def fault_code(fault: str) -> str:
    """The ``code`` of the error event a stream broken off by ``fault`` ends with."""
    return "internal_error" if fault == "proxy" else fault


_FAULT_TYPES = {
    "proxy": "server_error",
    "deadline": "timeout_error",
    "shutting_down": "service_unavailable",
}
_CUT = "The stream broke off before its end."


def _error_event(fault: str, message: str = _CUT) -> bytes:
    """An OpenAI-style error as a stream's last event (the SDK raises it), then ``[DONE]``."""
    kind, code = _FAULT_TYPES.get(fault, "upstream_error"), fault_code(fault)
    error = {"error": {"message": message, "type": kind, "code": code}}
    return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


def error_event(relayed: Relayed) -> bool:
    """Whether a stream that ended as a 200 carried an error event instead of its answer:
    TGI refuses a request mid-stream so (``data: {"error": ...}`` then ``[DONE]``), vLLM
    reports an error during generation so, and a Responses API stream with an ``error`` or
    ``response.failed`` event; it is no completion."""
    tail = relayed.tail
    if b"error" not in tail and b"response.failed" not in tail:  # the usual: ~1 ns a byte
        return False
    return any(
        _DATA_OPEN.search(tail, max(0, found.start() - _OPEN_AT_MOST), found.start())
        for found in _ERROR_MEMBER.finditer(tail)
    ) or any(
        found.start() == 0 or tail[found.start() - 1] in b"\r\n"
        for found in _ERROR_TYPE.finditer(tail)
    )


def read_usage(relayed: Relayed) -> None:
    """Take the last ``"usage": {...}`` of the answer's tail (a body, or a stream's last
    chunks), parsing that object alone: an answer's usage is at its end, so the answer is
    never parsed whole. A stream without one is counted by its token events."""
    found = last_usage(relayed.tail)
    if found is not None:
        relayed.prompt_tokens, relayed.completion_tokens = found
        return
    tokens = 0 if relayed.events is None else relayed.events.tokens
    if tokens > 0:
        relayed.completion_tokens = tokens


def last_usage(data: bytes) -> tuple[int | None, int | None] | None:
    """The (prompt, completion) tokens of the last ``"usage": {...}`` object in ``data``;
    None if it has none. Also what a stream relayed so far tells, where its server puts the
    usage so far on every chunk (a pool's ``cost.continuous_usage``)."""
    end = len(data)
    while (at := data.rfind(_USAGE, 0, end)) >= 0:
        end = at
        after = data[at + len(_USAGE) : at + _USAGE_BYTES]
        usage = _object_after_colon(after)
        if usage is None and (b"\n" in after or b"\r" in after):
            usage = _object_after_colon(continued_data(after))  # an event's data on many lines
        if usage is not None:
            # Chat Completions' names, else the Responses API's (its ``response.usage``)
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            return _token_count(prompt), _token_count(completion)
    return None


def _object_after_colon(after: bytes) -> dict[str, object] | None:
    """The JSON object after ``: `` at the start of ``after``, if there is one there."""
    text = after.decode(errors="replace").lstrip()
    if not text.startswith(":"):
        return None  # the word in a text, not the key
    try:
        found, _ = _DECODER.raw_decode(text, len(text) - len(text[1:].lstrip()))
    except (ValueError, RecursionError):  # not JSON, or nested beyond reason
        return None
    return found if isinstance(found, dict) else None


def _token_count(value: object) -> int | None:
    """A usage count as a sane int, or None: a backend's lie must not reach the meters."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USAGE_TOKENS:
        return value
    return None


async def _open(
    upstreams: Upstreams,
    pool: Pool,
    backend: Backend,
    inference: InferenceRequest,
    request_id: str,
    sent: float,
    remaining: float = math.inf,
    expiry: Expiry = OUT_OF_TIME,
    extra_headers: Mapping[str, str] | None = None,
) -> Answer:
    """POST the client's bytes (at ``sent``, on the pool's clock); return once the response
    headers are in. ``expiry``'s error is raised when the request's bound (``remaining``
    seconds away) passes first.

    No headers within ``first_byte_s`` is a 504, not retried (the backend had the request).
    It counts against the backend's health only if the backend answered no other request
    since ``sent``: a hung backend answers nobody, while a busy one answers others, and an
    engine sends a whole (non-streaming) answer's headers only when its generation ends,
    whose length the client chooses (``max_tokens``): a client must not be able to take
    backends out with slow requests."""
    headers = {
        "Content-Type": "application/json",
        "X-Request-Id": request_id,
        "Accept-Encoding": ACCEPT_ENCODING,
    }
    if extra_headers:
        headers.update(extra_headers)
    if pool.upstream_key:
        headers["Authorization"] = f"Bearer {pool.upstream_key}"
    timeouts = pool.spec.timeouts
    try:
        async with asyncio.timeout(min(timeouts.first_byte_s, remaining)):
            upstream = await upstreams.post(
                backend.base + inference.route, inference.raw, headers, timeouts.connect_s
            )
    except aiohttp.ClientError as exc:  # refused, reset, connect timeout, not HTTP at all
        raise UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc
    except TimeoutError:
        if remaining < timeouts.first_byte_s:
            raise expiry.error() from None
        silent = f"The backend sent nothing within {timeouts.first_byte_s:g} s."
        answer = ApiError(504, silent, code="upstream_timeout")
        raise UpstreamFailed(silent, answer, counts=backend.answered_at < sent) from None
    if not 200 <= upstream.status <= 599:  # an informational or made-up status: not an answer
        upstream.close()
        raise UpstreamFailed(f"status {upstream.status} is not a final answer")
    return upstream
