"""Forward one dispatched request to its backend and relay the answer as it arrives."""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from .errors import ApiError
from .placement import Backend
from .pool import Pool
from .request import InferenceRequest

# Upstream response headers worth passing on; hop-by-hop and length headers are not.
_PASS_HEADERS = ("Content-Type", "Retry-After")
QUEUE_WAIT_HEADER = "X-Queue-Wait"
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


class UpstreamUnreachable(Exception):
    """The backend failed before the client was sent anything: retrying elsewhere is safe."""


@dataclass(slots=True)
class Relayed:
    """The answer relayed, with what the proxy saw of it (for metrics and the access log)."""

    response: web.StreamResponse
    upstream_s: float  # send → last byte
    first_chunk_s: float | None = None  # send → first streamed chunk (time to first token)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


async def forward(
    session: aiohttp.ClientSession,
    pool: Pool,
    backend: Backend,
    client: web.Request,
    inference: InferenceRequest,
    request_id: str,
    queue_wait_s: float,
    on_headers: Callable[[float], None],
) -> Relayed:
    """Send ``inference`` to ``backend`` and relay its answer to ``client``.

    The answer carries ``X-Request-Id`` and ``X-Queue-Wait`` (seconds spent queued in the
    proxy, retries included), so a client can tell waiting from generating.

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
        if upstream.status >= 500:
            pool.report_failure(backend)
        headers = {h: upstream.headers[h] for h in _PASS_HEADERS if h in upstream.headers}
        headers["X-Request-Id"] = request_id
        headers[QUEUE_WAIT_HEADER] = f"{queue_wait_s:.6f}"
        if not (inference.stream and upstream.status == 200):
            try:
                body = await upstream.read()
            except aiohttp.ClientError as exc:  # died before answering: the client saw nothing
                pool.report_failure(backend)
                raise UpstreamUnreachable(str(exc)) from exc
            response = web.Response(status=upstream.status, body=body, headers=headers)
            relayed = Relayed(response, pool.clock() - sent)
            if upstream.status == 200:
                _read_usage(relayed, body)
            return relayed
        response = web.StreamResponse(status=200, headers=headers)
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(client)
        relayed = Relayed(response, 0.0)
        try:
            await _relay_stream(upstream, relayed, inference.strip_usage, pool, sent)
        except aiohttp.ClientPayloadError:  # the backend died mid-stream
            pool.report_failure(backend)
            raise
        relayed.upstream_s = pool.clock() - sent
        return relayed
    except BaseException:
        upstream.close()
        raise
    finally:
        upstream.release()


async def _relay_stream(
    upstream: aiohttp.ClientResponse, relayed: Relayed, strip_usage: bool, pool: Pool, sent: float
) -> None:
    """Write the stream's bytes as they come, then end it; keep only its tail, where the
    usage is."""
    tail: deque[bytes] = deque()  # the last chunks, about _TAIL_BYTES of them
    kept = 0
    stripper = _UsageStripper() if strip_usage else None
    async for chunk in upstream.content.iter_any():
        if relayed.first_chunk_s is None:
            relayed.first_chunk_s = pool.clock() - sent
        tail.append(chunk)
        kept += len(chunk)
        while kept - len(tail[0]) >= _TAIL_BYTES:
            kept -= len(tail.popleft())
        out = chunk if stripper is None else stripper.feed(chunk)
        if out:
            await relayed.response.write(out)
    await relayed.response.write_eof(stripper.close() if stripper else b"")  # one write
    _read_usage(relayed, b"".join(tail))


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


def _read_usage(relayed: Relayed, data: bytes) -> None:
    """Take the last ``"usage": {...}`` in ``data`` (a body, or a stream's tail), parsing that
    object alone: an answer's usage is at its end, so the answer is never parsed whole."""
    end = len(data)
    while (at := data.rfind(_USAGE, 0, end)) >= 0:
        end = at
        text = data[at + len(_USAGE) : at + _USAGE_BYTES].decode(errors="replace").lstrip()
        if not text.startswith(":"):
            continue  # the word in a text, not the key
        try:
            usage, _ = _DECODER.raw_decode(text, len(text) - len(text[1:].lstrip()))
        except ValueError:
            continue
        if isinstance(usage, dict):
            relayed.prompt_tokens = usage.get("prompt_tokens")
            relayed.completion_tokens = usage.get("completion_tokens")
            return


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
            return await session.post(
                backend.url + inference.kind.value,
                data=inference.raw,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s),
            )
    except aiohttp.ClientConnectionError as exc:  # refused, reset, connect timeout, ...
        pool.report_failure(backend)
        raise UpstreamUnreachable(str(exc)) from exc
    except TimeoutError:
        raise ApiError(
            504,
            f"The backend sent nothing within {timeouts.first_byte_s:g} s.",
            code="upstream_timeout",
        ) from None
