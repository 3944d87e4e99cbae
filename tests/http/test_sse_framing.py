"""Server-sent events framed with CRLF (sse-starlette's default, as llama.cpp's Python server
sends them) go through the proxy as they arrive, with the usage event it asked for taken out."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from proxy_lab import MODEL, Lab, proxy_config

CHAT = [{"role": "user", "content": "Count to five."}]
WORDS = ["one", " two", " three", " four", " five"]
FINGERPRINT = "fp-crlf"


def _event(choices: list[dict], **extra: object) -> bytes:
    chunk = {"id": "c-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
             "choices": choices, **extra}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n"


class CrlfBackend:
    """Streams the five words 0.2 s apart, ending events with CRLF CRLF; with usage when
    asked, vLLM's way (the system fingerprint on the usage chunk, not the finishing one)."""

    def __init__(self) -> None:
        self.last_sent = asyncio.Event()  # set just before the last word goes out
        self.asked_usage: list[bool] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.asked_usage.append(usage)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": ping\r\n\r\n")
        for n, word in enumerate(WORDS):
            if n == len(WORDS) - 1:
                self.last_sent.set()
            delta = {"role": "assistant", "content": word} if n == 0 else {"content": word}
            await response.write(_event([{"index": 0, "delta": delta, "finish_reason": None}]))
            await asyncio.sleep(0.2)
        finish = [{"index": 0, "delta": {}, "finish_reason": "stop"}]
        if usage:
            await response.write(_event(finish))
            counts = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
            await response.write(_event([], usage=counts, system_fingerprint=FINGERPRINT))
        else:
            await response.write(_event(finish, system_fingerprint=FINGERPRINT))
        await response.write(b"data: [DONE]\r\n\r\n")
        await response.write_eof()
        return response


async def test_crlf_events_arrive_as_sent_without_the_usage_asked_for_the_client(
    lab: Lab,
) -> None:
    backend = CrlfBackend()
    port = await lab.serve(backend.app())
    served = await lab.proxy(proxy_config([f"http://127.0.0.1:{port}"]))
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True
    )
    chunks = []
    async for chunk in stream:
        if not chunks:  # the first event, long before the backend has sent its last one
            assert not backend.last_sent.is_set()
        chunks.append(chunk)
    assert backend.asked_usage == [True]  # the proxy asked for it, for its own accounting
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(WORDS)
    assert all(c.usage is None and c.choices for c in chunks)  # no usage chunk reached it
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].system_fingerprint == FINGERPRINT  # moved back where it would have been
    labels = {"org": "A", "class": "batch", "pool": "sim"}
    registry = served.state.metrics.registry
    assert registry.get_sample_value("sfq_prompt_tokens_total", labels) == 7
    assert registry.get_sample_value("sfq_completion_tokens_total", labels) == 5
