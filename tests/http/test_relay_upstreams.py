"""Upstreams as they are, not as vLLM is: a body compressed whatever the proxy asked for,
provider headers (rate limits, ids, timings) the client needs, headers that must stop at
the proxy, and a base URL written with or without ``/v1`` (docs/design.md §5, Relay)."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import openai
import pytest
from aiohttp import web
from provider_double import WORDS, Coding, ProviderDouble
from proxy_lab import MODEL, AccessLines, Lab, proxy_config

CHAT = [{"role": "user", "content": "Say something fair."}]
# what a provider sends beside its answer, and the client wants (names as OpenAI sends them)
PROVIDER_HEADERS = {
    "x-ratelimit-limit-requests": "500",
    "x-ratelimit-remaining-requests": "499",
    "x-ratelimit-reset-tokens": "6ms",
    "retry-after-ms": "250",
    "openai-processing-ms": "42",
    "openai-version": "2020-10-01",
    "openai-organization": "user-abc",
}
# what must stop at the proxy
STOPPED_HEADERS = {
    "Connection": "keep-alive, X-Hop-Secret",  # names a header as hop-by-hop
    "X-Hop-Secret": "for the proxy only",
    "Keep-Alive": "timeout=5",
    "Set-Cookie": "affinity=backend-1; Path=/",
    "Server": "upstream-double/1.0",
    "x-request-id": "req_upstream",  # the proxy's own id wins
}


def upstream_double(coding: Coding, prefix: str = "/v1") -> ProviderDouble:
    """A provider-like double (tests/support/provider_double.py) that needs no key, compresses every
    answer with ``coding`` whatever it is asked ("raw-deflate": "deflate" as some servers
    send it, without the zlib header), sends provider and hop-by-hop headers, answers its
    ``/health`` and records what reached it."""
    return ProviderDouble(
        key=None,
        coding=coding,
        prefix=prefix,
        health=True,
        extra_headers={**PROVIDER_HEADERS, **STOPPED_HEADERS},
    )


def accept_encodings(upstream: ProviderDouble) -> list[str | None]:
    return [r.headers.get("Accept-Encoding") for r in upstream.chats()]


def paths(upstream: ProviderDouble) -> list[str]:
    return [r.path for r in upstream.received]


async def _proxied(lab: Lab, upstream: ProviderDouble, url_path: str) -> Any:
    port = await lab.serve(upstream.app())
    return await lab.proxy(proxy_config([f"http://127.0.0.1:{port}{url_path}"]))


def _assert_headers_relayed(headers: Any, request_id: str) -> None:
    for name, value in PROVIDER_HEADERS.items():
        assert headers.get(name) == value, name
    for name in ("X-Hop-Secret", "Keep-Alive", "Set-Cookie", "Content-Encoding"):
        assert name not in headers, name
    assert headers.get("Server") != STOPPED_HEADERS["Server"]
    assert headers["X-Request-Id"] == request_id != "req_upstream"
    assert "X-Queue-Wait" in headers
    assert "X-Cost-Charged" in headers


async def test_a_gzipping_provider_under_v1_is_relayed_decoded_with_its_headers(
    lab: Lab, access_log: AccessLines
) -> None:
    """The double gzips its JSON answer and its stream although the proxy asks for
    ``identity``; its URL is written as providers document it, with ``/v1``. The SDK gets
    answers it can parse (it used to fail on the gzip bytes, sent without their
    Content-Encoding), the provider's headers but not the hop-by-hop ones or the cookie, and
    the proxy reads the usage of both answers."""
    upstream = upstream_double("gzip")
    served = await _proxied(lab, upstream, "/v1")
    client = lab.client(served)

    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT)
    chat = raw.parse()
    assert chat.choices[0].message.content == "".join(WORDS)
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5

    raw_stream = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, stream=True
    )
    chunks = [chunk async for chunk in raw_stream.parse()]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(WORDS)
    assert all(c.choices for c in chunks)  # the usage chunk the proxy asked for is not passed

    lines = await access_log()
    assert [(line["status"], line["outcome"]) for line in lines] == [(200, "completed")] * 2
    assert [(line["prompt_tokens"], line["completion_tokens"]) for line in lines] == [(11, 5)] * 2
    _assert_headers_relayed(raw.headers, lines[0]["request_id"])
    _assert_headers_relayed(raw_stream.headers, lines[1]["request_id"])
    labels = {"org": "A", "class": "batch", "pool": "sim"}
    completion = served.state.metrics.registry.get_sample_value(
        "sfq_completion_tokens_total", labels
    )
    assert completion == 10
    assert accept_encodings(upstream) == ["identity", "identity"]
    assert "/v1/chat/completions" in paths(upstream)
    assert not [p for p in paths(upstream) if p.startswith("/v1/v1")]


@pytest.mark.parametrize(
    ("prefix", "url_path", "health"),
    [
        ("/v1", "", "/health"),  # vLLM as usually written: the host alone
        ("/v1", "/v1", "/health"),  # a provider as documented
        ("/v1", "/v1/", "/health"),
        ("/openai/v1", "/openai/v1", "/openai/health"),  # a gateway's prefix is kept
    ],
)
async def test_base_urls_with_or_without_v1_reach_v1_once(
    lab: Lab, prefix: str, url_path: str, health: str
) -> None:
    """Requests go to ``<base>/v1/chat/completions`` and probes to ``<base>/health``, where
    the base is the URL without a trailing ``/v1``; the proxy asks for ``identity``."""
    upstream = upstream_double(None, prefix)
    served = await _proxied(lab, upstream, url_path)
    chat = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert chat.choices[0].message.content == "".join(WORDS)
    assert f"{prefix}/chat/completions" in paths(upstream)
    assert set(paths(upstream)) <= {f"{prefix}/chat/completions", health}
    assert accept_encodings(upstream) == ["identity"]


@pytest.mark.parametrize("raw_deflate", [False, True])
async def test_a_deflated_answer_is_decoded_in_either_flavour(
    lab: Lab, access_log: AccessLines, raw_deflate: bool
) -> None:
    """``deflate`` is zlib data by the RFC and raw deflate from some servers: both decode."""
    upstream = upstream_double("raw-deflate" if raw_deflate else "deflate")
    served = await _proxied(lab, upstream, "/v1")
    chat = await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert chat.choices[0].message.content == "".join(WORDS)
    assert [line["completion_tokens"] for line in await access_log()] == [5]


async def test_a_coding_the_proxy_cannot_read_is_a_502_not_undecodable_bytes(
    lab: Lab, access_log: AccessLines
) -> None:
    """A body in brotli (or zstd) would reach a client that never asked for it, and its
    usage could not be read: it is a bad answer, retried elsewhere, else a 502."""
    served = await _proxied(lab, upstream_double("br"), "/v1")
    with pytest.raises(openai.InternalServerError) as failed:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert failed.value.status_code == 502
    assert [line["status"] for line in await access_log()] == [502]


async def healthy(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_a_gzip_stream_that_breaks_off_ends_with_an_error_event(lab: Lab) -> None:
    """Corrupt compressed data mid-stream is the backend's cut, told to the client."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"}
        )
        await response.prepare(request)
        compressor = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
        event = b'data: {"id":"1","object":"chat.completion.chunk","created":1,"model":"m",'
        event += b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
        await response.write(compressor.compress(event) + compressor.flush(zlib.Z_SYNC_FLUSH))
        await asyncio.sleep(0.1)  # the good part arrives on its own
        await response.write(b"\xff\xfe not deflate at all")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", healthy)
    port = await lab.serve(app)
    served = await lab.proxy(proxy_config([f"http://127.0.0.1:{port}"]))
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True
    )
    seen: list[str | None] = []

    async def read() -> None:
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content)

    with pytest.raises(openai.APIError, match="broke off"):
        await read()
    assert seen == ["Hi"]
