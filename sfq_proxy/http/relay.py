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
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from ..core.errors import ApiError
from ..core.inference_request import InferenceRequest
from ..core.placement import Backend
from .pool_runtime import Pool

log = logging.getLogger(__name__)
# Upstream response headers worth passing on; hop-by-hop and length headers are not.
_PASS_HEADERS = ("Content-Type", "Retry-After")
QUEUE_WAIT_HEADER = "X-Queue-Wait"
COST_HEADER = "X-Cost-Charged"
_TAIL_BYTES = 16384  # enough to hold a stream's last events, where its usage is
# Marks found by a byte search, never by parsing. A compiled pattern, not bytes.find: one
# pass for both spellings, and no per-call setup, which dominates on a one-token event.
_NO_CHOICES = re.compile(rb'"choices": ?\[\]')  # the mark of the usage-only chunk
_FINISHING = re.compile(rb'"finish_reason": ?"')  # null while tokens flow
_MARKS = re.compile(rb'"finish_reason": ?"|"choices": ?\[\]')
_USAGE = b'"usage"'
_USAGE_BYTES = 4096  # more than any usage object: the part of the tail that is parsed
_DECODER = json.JSONDecoder()
_FINGERPRINT = re.compile(rb'("system_fingerprint":\s*(?:"[^"]*"|null))')
MAX_USAGE_TOKENS = 1_000_000_000  # a usage count above this is a lying backend, not usage
_ERROR_STATUSES = frozenset({429, 503})  # what must say when to come back


class UpstreamFailed(Exception):
    """The backend failed before the client was sent anything: retrying elsewhere is safe,
    unless ``answer`` says what the client gets instead (a body that went silent: 504)."""

    def __init__(self, reason: str, answer: ApiError | None = None) -> None:
        super().__init__(reason)
        self.answer = answer


class UpstreamStalled(aiohttp.ClientPayloadError):
    """The backend sent nothing for ``timeouts.idle_s`` after its headers."""


class _Watchdog:
    """Ends a read from ``reader`` once the backend has been silent for ``idle_s``.

    One timer per answer, re-armed when it fires rather than per chunk: the loop only notes
    the time of each chunk. The read is ended by putting an error into the reader, which
    wakes it even where closing the connection would not (aiohttp's C parser leaves a read
    waiting forever after a malformed chunk).
    """

    def __init__(self, reader: aiohttp.StreamReader, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = reader
        self._idle_s = idle_s
        self.progress = self._loop.time()
        self._timer = self._loop.call_at(self.progress + idle_s, self._check)

    def _check(self) -> None:
        now, deadline = self._loop.time(), self.progress + self._idle_s
        if now < deadline:  # inf while the proxy itself is busy: look again later
            self._timer = self._loop.call_at(min(deadline, now + self._idle_s), self._check)
        else:
            self._reader.set_exception(UpstreamStalled(f"silent for {self._idle_s:g} s"))

    def progressed(self) -> None:
        """The proxy reads again: the backend's silence counts from now."""
        self.progress = self._loop.time()

    def busy(self) -> None:
        """The proxy is writing to a slow client: that time is not the backend's silence."""
        self.progress = math.inf

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
    # backend's "upstream_cut" or "upstream_timeout", or "proxy" for a fault of our own
    fault: str | None = None
    tail: bytes = b""  # the end of a 200 answer, where its usage is (see ``read_usage``)


async def forward(
    session: aiohttp.ClientSession,
    pool: Pool,
    backend: Backend,
    client: web.Request,
    inference: InferenceRequest,
    request_id: str,
    own_headers: Mapping[str, str],
    on_headers: Callable[[float], None],
) -> Relayed:
    """Send ``inference`` to ``backend`` and relay its answer to ``client``.

    The answer carries ``own_headers`` beside the upstream's: the proxy's ``X-Request-Id``,
    ``X-Queue-Wait`` (seconds spent queued in the proxy, retries included, so a client can
    tell waiting from generating) and ``X-Cost-Charged`` (what its flow's meter was charged).

    ``on_headers`` learns the time to the response headers as soon as they arrive, even if
    the relay is cancelled later.

    Streams are relayed chunk by chunk; anything else is passed through unchanged with
    its status. The upstream connection is closed at once when the client goes away
    (the handler is cancelled), which makes vLLM abort the generation.
    """
    sent = pool.clock()
    upstream = await _open(session, pool, backend, inference, request_id)
    on_headers(pool.clock() - sent)
    try:
        headers = {h: upstream.headers[h] for h in _PASS_HEADERS if h in upstream.headers}
        headers.update(own_headers)
        if upstream.status in _ERROR_STATUSES:
            headers.setdefault("Retry-After", "1")
        if not (inference.stream and upstream.status == 200):
            watchdog = _Watchdog(upstream.content, pool.spec.timeouts.idle_s)
            try:
                body = await upstream.read()
            except UpstreamStalled as exc:
                raise UpstreamFailed(str(exc), _stalled(pool)) from None
            except aiohttp.ClientError as exc:  # died before answering: the client saw nothing
                raise UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc
            finally:
                watchdog.cancel()
            response: web.StreamResponse = web.Response(
                status=upstream.status, body=body, headers=headers
            )
            return Relayed(
                response, pool.clock() - sent, tail=body if upstream.status == 200 else b""
            )
        response = web.StreamResponse(status=200, headers=headers)
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(client)
        relayed = Relayed(response, 0.0)
        await _relay_stream(upstream, relayed, inference.strip_usage, pool, sent)
        relayed.upstream_s = pool.clock() - sent
        return relayed
    except BaseException:
        upstream.close()
        raise
    finally:
        upstream.release()


async def _relay_stream(
    upstream: aiohttp.ClientResponse,
    relayed: Relayed,
    strip_usage: bool,
    pool: Pool,
    sent: float,
) -> None:
    """Write the stream's bytes as they come, then end it; keep only its tail, where the
    usage is. A stream that breaks off ends with an error event: its client is told, and
    every later request finds the pool whole."""
    tail: deque[bytes] = deque()  # the last chunks, about _TAIL_BYTES of them
    kept = 0
    stripper = _UsageStripper() if strip_usage else None
    watchdog = _Watchdog(upstream.content, pool.spec.timeouts.idle_s)
    try:
        async for chunk in upstream.content.iter_any():
            watchdog.busy()
            if relayed.first_chunk_s is None:
                relayed.first_chunk_s = pool.clock() - sent
            tail.append(chunk)
            kept += len(chunk)
            while kept - len(tail[0]) >= _TAIL_BYTES:
                kept -= len(tail.popleft())
            out = chunk if stripper is None else stripper.feed(chunk)
            if out:
                await relayed.response.write(out)
            watchdog.progressed()
    except ConnectionResetError:  # the client left as we wrote (aiohttp's is a ClientError)
        raise
    except aiohttp.ClientError as exc:  # bad chunking, early close, silence: the backend's
        log.warning("pool %s: a backend broke off a stream: %s", pool.name, exc)
        relayed.fault = "upstream_timeout" if isinstance(exc, UpstreamStalled) else "upstream_cut"
    except Exception:  # a fault of ours: the answer has started, so it must end here
        log.exception("pool %s: relaying a stream failed", pool.name)
        relayed.fault = "proxy"
    finally:
        watchdog.cancel()
    rest = b""
    if relayed.fault is not None:
        at_boundary = not tail or tail[-1].endswith(b"\n\n")
        rest = (b"" if at_boundary else b"\n\n") + _error_event(relayed.fault)
    elif stripper is not None:
        rest = stripper.close()
    await relayed.response.write_eof(rest)  # one write
    relayed.tail = b"".join(tail)


def backend_failed(relayed: Relayed) -> bool:
    """Whether an answer counts against its backend's health: a 5xx, or a stream that the
    backend broke off (not one that a fault of the proxy's own ended)."""
    return relayed.response.status >= 500 or relayed.fault in ("upstream_cut", "upstream_timeout")


def _stalled(pool: Pool) -> ApiError:
    idle_s = pool.spec.timeouts.idle_s
    return ApiError(504, f"The backend went silent for {idle_s:g} s.", code="upstream_timeout")


def _error_event(fault: str) -> bytes:
    """An OpenAI-style error as a stream's last event (the SDK raises it), then ``[DONE]``."""
    kind, code = (
        ("server_error", "internal_error") if fault == "proxy" else ("upstream_error", fault)
    )
    message = "The stream broke off before its end."
    error = {"error": {"message": message, "type": kind, "code": code}}
    return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


class _UsageStripper:
    """Drops the usage-only event that the proxy asked for and the client did not.

    Chunks pass at once unless they hold a finishing or a usage-only event (found by a
    byte search, not by parsing): a finishing event waits for the next one, because vLLM
    moves its ``system_fingerprint`` from the finishing chunk to the usage chunk when usage
    is asked for; it is moved back, so the client gets exactly the events it asked for.
    The usage chunk comes after the last choice has finished, so until one has, each chunk
    is searched for the finishing mark only.
    """

    def __init__(self) -> None:
        self._partial = b""  # an event not complete yet
        self._held = b""  # a finishing event, until we know whether usage follows it
        self._finished = False  # a choice has finished: the usage chunk may come from now on

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk  # no copy while no event is cut in two
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self._partial = data
            return b""
        if cut == len(data):  # whole events, as servers send them: passed on uncopied
            complete, self._partial = data, b""
        else:
            complete, self._partial = data[:cut], data[cut:]
        # until a choice finishes, one mark is searched for, not all of them
        found = (_MARKS if self._finished else _FINISHING).search(complete)
        if found is None and not self._held:
            return complete
        self._finished = True
        # the events before the first marked one go as they came; the rest one by one
        boundary = -1 if self._held or found is None else complete.rfind(b"\n\n", 0, found.start())
        start = boundary + 2 if boundary >= 0 else 0
        out = [complete[:start]]
        for event in complete[start:].split(b"\n\n")[:-1]:
            if _USAGE in event and _NO_CHOICES.search(event):
                self._held = _with_fingerprint_of(self._held, event)
                continue
            if self._held:
                out.append(self._held + b"\n\n")
                self._held = b""
            if _FINISHING.search(event):
                self._held = event
            else:
                out.append(event + b"\n\n")
        return b"".join(out)

    def close(self) -> bytes:
        held = self._held + b"\n\n" if self._held else b""
        return held + self._partial


def _with_fingerprint_of(finishing: bytes, usage_event: bytes) -> bytes:
    """Put the usage event's ``system_fingerprint`` back on the finishing event (vLLM)."""
    found = _FINGERPRINT.search(usage_event)
    if not finishing or found is None or b'"system_fingerprint"' in finishing:
        return finishing
    return finishing[:-1] + b"," + found.group(1) + b"}"


def read_usage(relayed: Relayed) -> None:
    """Take the last ``"usage": {...}`` of the answer's tail (a body, or a stream's last
    chunks), parsing that object alone: an answer's usage is at its end, so the answer is
    never parsed whole."""
    data = relayed.tail
    end = len(data)
    while (at := data.rfind(_USAGE, 0, end)) >= 0:
        end = at
        text = data[at + len(_USAGE) : at + _USAGE_BYTES].decode(errors="replace").lstrip()
        if not text.startswith(":"):
            continue  # the word in a text, not the key
        try:
            usage, _ = _DECODER.raw_decode(text, len(text) - len(text[1:].lstrip()))
        except (ValueError, RecursionError):  # not JSON, or nested beyond reason
            continue
        if isinstance(usage, dict):
            relayed.prompt_tokens = _token_count(usage.get("prompt_tokens"))
            relayed.completion_tokens = _token_count(usage.get("completion_tokens"))
            return


def _token_count(value: object) -> int | None:
    """A usage count as a sane int, or None: a backend's lie must not reach the meters."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USAGE_TOKENS:
        return value
    return None


async def _open(
    session: aiohttp.ClientSession,
    pool: Pool,
    backend: Backend,
    inference: InferenceRequest,
    request_id: str,
) -> aiohttp.ClientResponse:
    """POST the client's bytes; return once the response headers are in."""
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if pool.upstream_key:
        headers["Authorization"] = f"Bearer {pool.upstream_key}"
    timeouts = pool.spec.timeouts
    try:
        async with asyncio.timeout(timeouts.first_byte_s):
            upstream = await session.post(
                backend.url + inference.kind.value,
                data=inference.raw,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
            )
    except aiohttp.ClientError as exc:  # refused, reset, connect timeout, not HTTP at all
        raise UpstreamFailed(f"{type(exc).__name__}: {exc}") from exc
    except TimeoutError:
        raise ApiError(
            504,
            f"The backend sent nothing within {timeouts.first_byte_s:g} s.",
            code="upstream_timeout",
        ) from None
    if not 200 <= upstream.status <= 599:  # an informational or made-up status: not an answer
        upstream.close()
        raise UpstreamFailed(f"status {upstream.status} is not a final answer")
    return upstream
