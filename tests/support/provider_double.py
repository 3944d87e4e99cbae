"""A hosted OpenAI-compatible API's stand-in, for the end-to-end tests.

What a provider looks like from the proxy, and what vLLM does not do: every path needs its
key (an OpenAI-style 401 without), there is no ``/health`` (404), the API lives under
``/v1`` (its backend URL is written with ``/v1``), answers are gzipped when the request's
``Accept-Encoding`` allows it, and every answer carries the provider's headers
(``x-ratelimit-*``, ``openai-processing-ms``, ``x-request-id``). It can be told to refuse
the next requests (a 429 with ``retry-after`` and/or ``retry-after-ms``, a 503…), to
misbehave on the next ones (hang before its headers, go silent or hang up mid-body), and
to hold its answers until a number of them are in flight at once (to show a pool's full
concurrency without timing). It records what it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

PROVIDER_KEY = "sk-provider-secret"
MODEL = "sim-llama"  # the lab's model name (tests/support/proxy_lab.py)
WORDS = ("Fair", " queues", " for", " all", ".")
USAGE = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
CHAT_PATH = "/v1/chat/completions"
# the provider's rate-limit state, as OpenAI names it (far from any limit)
RATE_LIMIT_HEADERS = {
    "x-ratelimit-limit-requests": "500",
    "x-ratelimit-remaining-requests": "499",
    "x-ratelimit-reset-requests": "120ms",
    "x-ratelimit-limit-tokens": "30000",
    "x-ratelimit-remaining-tokens": "29984",
    "x-ratelimit-reset-tokens": "32ms",
}
PROCESSING_MS = "42"
# what the stand-in does to one request instead of answering it
Fault = Literal["hang", "stall", "cut"]
# Content-Encoding: "auto" as Accept-Encoding allows (gzip or nothing); a coding by name
# whatever was asked (as some gateways do); None never
Coding = Literal["auto", "gzip", "deflate", "raw-deflate", "br"] | None


@dataclass(frozen=True)
class Received:
    """One request as it reached the stand-in."""

    method: str
    path: str
    headers: CIMultiDictProxy[str]
    body: bytes

    @property
    def keyed(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {PROVIDER_KEY}"

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class _Refusal:
    status: int
    headers: dict[str, str]
    error: dict[str, Any]


@dataclass
class ProviderDouble:
    """The stand-in; ``app()`` is its aiohttp application (serve it with ``Lab.serve``).

    ``status`` other than 200 answers every chat request with that status (a provider that
    is down); ``refuse`` and ``misbehave`` act on the next requests only.
    """

    key: str | None = PROVIDER_KEY  # None: no key needed
    coding: Coding = "auto"
    prefix: str = "/v1"
    crlf: bool = False  # end SSE lines with CRLF (sse-starlette's default) instead of LF
    health: bool = False  # answer ``GET <base>/health`` (as a gateway in front of vLLM may)
    extra_headers: dict[str, str] = field(default_factory=dict)  # sent with every answer
    status: int = 200
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    hung_up: int = 0  # requests whose caller went away before the stand-in had finished
    _refusals: deque[_Refusal] = field(default_factory=deque)
    _faults: deque[Fault] = field(default_factory=deque)
    _gate: int | None = None
    _gate_open: asyncio.Event = field(default_factory=asyncio.Event)
    _served: int = 0

    # -- what to do next ---------------------------------------------------------------------

    def refuse(
        self,
        times: int = 1,
        *,
        status: int = 429,
        retry_after: str | None = None,
        retry_after_ms: str | None = None,
    ) -> None:
        """Answer the next ``times`` chat requests with ``status`` (429: rate limited, with
        the rate-limit headers of an exhausted bucket; else overloaded), with the given
        ``retry-after`` (seconds) and ``retry-after-ms`` headers."""
        headers = {**RATE_LIMIT_HEADERS}
        if status == 429:
            headers["x-ratelimit-remaining-requests"] = "0"
            error = {
                "message": "Rate limit reached for requests",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        else:
            error = {
                "message": "The server is overloaded or not ready yet.",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        if retry_after is not None:
            headers["retry-after"] = retry_after
        if retry_after_ms is not None:
            headers["retry-after-ms"] = retry_after_ms
        self._refusals.extend(_Refusal(status, headers, error) for _ in range(times))

    def misbehave(self, fault: Fault, times: int = 1) -> None:
        """Do ``fault`` to the next ``times`` chat requests: ``hang`` sends nothing at all,
        ``stall`` sends the headers and the first part of the body then nothing more,
        ``cut`` sends the same then hangs up. Each waits until the caller hangs up."""
        self._faults.extend([fault] * times)

    def hold_until(self, in_flight: int) -> None:
        """Hold every answer until ``in_flight`` chat requests are in flight at once (or 10 s
        passed): ``max_in_flight`` then shows whether a burst reached that concurrency."""
        self._gate, self.max_in_flight = in_flight, 0
        self._gate_open.clear()

    # -- what it saw -------------------------------------------------------------------------

    def chats(self) -> list[Received]:
        return [r for r in self.received if r.path == self.prefix + "/chat/completions"]

    def probes(self) -> list[tuple[str, str, bool]]:
        """Everything but chat requests, as (method, path, had the key): the probes."""
        chat = self.prefix + "/chat/completions"
        return [(r.method, r.path, r.keyed) for r in self.received if r.path != chat]

    # -- the application ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record_and_check_key])
        app.router.add_post(self.prefix + "/chat/completions", self._chat)
        app.router.add_get(self.prefix + "/models", self._models)  # HEAD too
        if self.health:
            app.router.add_get(self.prefix.removesuffix("/v1") + "/health", self._healthy)
        return app

    async def _healthy(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def _record_and_check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Received(
                request.method, request.path, CIMultiDictProxy(CIMultiDict(request.headers)), body
            )
        )
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            return self._error(
                401,
                {
                    "message": "Incorrect API key provided.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                },
            )
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return self._error(
                404,
                {
                    "message": f"Invalid URL ({request.method} {request.path})",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                },
            )

    def _error(self, status: int, error: dict[str, Any], **headers: str) -> web.Response:
        return web.json_response(
            {"error": error}, status=status, headers={"x-request-id": self._request_id(), **headers}
        )

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self._refusals:
            refusal = self._refusals.popleft()
            return self._error(refusal.status, refusal.error, **refusal.headers)
        if self.status != 200:
            return self._error(self.status, {"message": "boom", "type": "server_error"})
        fault = self._faults.popleft() if self._faults else None
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if fault == "hang":
                await self._until_hung_up(request)
                return web.Response()  # never reaches anyone
            await self._wait_for_gate()
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, include_usage, fault)
            return await self._json(request, fault)
        finally:
            self.in_flight -= 1

    async def _wait_for_gate(self) -> None:
        if self._gate is None:
            return
        if self.in_flight >= self._gate:
            self._gate_open.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._gate_open.wait(), 10)

    def _headers(self, request: web.Request, content_type: str) -> tuple[dict[str, str], Any]:
        headers = {
            **RATE_LIMIT_HEADERS,
            "openai-processing-ms": PROCESSING_MS,
            "x-request-id": self._request_id(),
            "Content-Type": content_type,
            **self.extra_headers,
        }
        coding = self.coding
        if coding == "auto":
            accepted = request.headers.get("Accept-Encoding", "")
            coding = "gzip" if "gzip" in accepted.lower() else None
        if coding is not None:
            headers["Content-Encoding"] = "deflate" if coding == "raw-deflate" else coding
        return headers, coding

    def _request_id(self) -> str:
        self._served += 1
        return f"req_{self._served:06d}"

    async def _json(self, request: web.Request, fault: Fault | None) -> web.StreamResponse:
        answer = json.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(WORDS)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": USAGE,
            }
        ).encode()
        headers, coding = self._headers(request, "application/json")
        data = _compress_all(answer, coding)
        if fault is None:
            return web.Response(body=data, headers=headers)
        response = web.StreamResponse(headers=headers)
        response.content_length = len(data)
        await response.prepare(request)
        await response.write(data[: len(data) // 2])
        return await self._break_off(request, response, fault)

    async def _stream(
        self, request: web.Request, include_usage: bool, fault: Fault | None
    ) -> web.StreamResponse:
        headers, coding = self._headers(request, "text/event-stream")
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        compressor = _compressor(coding)
        events = sse_events(include_usage)
        if fault is not None:
            events = events[:2]  # the role, and the first word
        for event in events:
            data = b"data: " + event + (b"\r\n\r\n" if self.crlf else b"\n\n")
            if compressor is not None:  # one flushed block per event, as a gzip middleware
                data = compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)
            await response.write(data)
        if fault is not None:
            return await self._break_off(request, response, fault)
        await response.write_eof(compressor.flush() if compressor is not None else b"")
        return response

    async def _break_off(
        self, request: web.Request, response: web.StreamResponse, fault: Fault
    ) -> web.StreamResponse:
        if fault == "cut":
            await asyncio.sleep(0.1)  # what was sent arrives on its own
            assert request.transport is not None
            request.transport.close()
        else:
            await self._until_hung_up(request)
        return response

    async def _until_hung_up(self, request: web.Request, within: float = 60.0) -> None:
        """Send nothing until the caller hangs up (or ``within`` s pass)."""
        for _ in range(round(within / 0.02)):
            if request.transport is None or request.transport.is_closing():
                self.hung_up += 1
                return
            await asyncio.sleep(0.02)


def sse_events(include_usage: bool) -> list[bytes]:
    """The data of a stream's events: the role, the words, the finish, the usage chunk when
    asked (with empty ``choices``, as OpenAI sends it), and ``[DONE]``."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return json.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": MODEL,
                "choices": choices,
                **extra,
            }
        ).encode()

    def delta(content: dict[str, Any], finish: str | None = None) -> bytes:
        return chunk([{"index": 0, "delta": content, "finish_reason": finish}])

    events = [delta({"role": "assistant", "content": ""})]
    events += [delta({"content": word}) for word in WORDS]
    events.append(delta({}, "stop"))
    if include_usage:
        events.append(chunk([], usage=USAGE))
    return [*events, b"[DONE]"]


def _compressor(coding: str | None) -> Any:
    if coding == "gzip":
        return zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    if coding == "deflate":
        return zlib.compressobj(wbits=zlib.MAX_WBITS)
    if coding == "raw-deflate":
        return zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return None


def _compress_all(data: bytes, coding: str | None) -> bytes:
    if coding == "gzip":
        return gzip.compress(data)
    compressor = _compressor(coding)
    if compressor is not None:
        return compressor.compress(data) + compressor.flush()
    return data  # identity, or "br" and the like: bytes labelled with a coding they are not
