"""The proxy in front of real llama.cpp servers (llama-cpp-python, the tiny Llama as GGUF).

llama-cpp-python 0.3.36 holds a stream's text back while it is not whole UTF-8, and the
random model picks lone bytes: the stream then goes silent until its end, and slower with
every token (300 tokens: 1 event, then 10.8 s of nothing, against 0.17 s without those
tokens). The server looks for a client that left only when it sends an event, so a silent
stream keeps the server's lock after its client is gone. The tests bar those tokens.

The servers are started once per session (``llamacpp_servers`` in conftest, skipped until
`make llamacpp` has built them); each test runs its own proxy in front of them. A server
runs one request at a time, so each backend has one slot, and with the server's default a
request arriving during a stream ends that stream early: a stream that ends whole shows
that nothing overlapped it on its server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Any

import aiohttp
import pytest
import vllm_backend
from llamacpp_backend import SERVED_NAME, LlamaCppServer
from proxy_lab import (
    KEYS,
    Lab,
    Served,
    assert_alternate,
    dispatched_behind,
    eventually,
    proxy_config,
)

pytestmark = pytest.mark.llamacpp

CHAT = [{"role": "user", "content": "def fair_share(teams):"}]
AUTH = {"Authorization": f"Bearer {KEYS['A']}"}


@functools.cache
def barred_tokens() -> dict[str, float]:
    """A ``logit_bias`` that bars the end of text, and the tokens that are not whole UTF-8 on
    their own (a lone continuation byte). The random model picks those; llama-cpp-python
    then holds a stream's text back until it decodes, which it never does: the stream goes
    silent until its end, slower with every token (it retries the tail's prefixes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    byte_of = {chr(b): b for b in printable}  # GPT-2's byte-level alphabet
    others = sorted(set(range(256)) - set(printable))
    byte_of.update({chr(256 + n): b for n, b in enumerate(others)})
    tokenizer = json.loads((vllm_backend.MODEL / "tokenizer.json").read_text())
    barred = {}
    for piece, token_id in tokenizer["model"]["vocab"].items():
        try:
            bytes(byte_of[c] for c in piece).decode()
        except (KeyError, UnicodeDecodeError):
            barred[str(token_id)] = -100.0
    (end,) = [t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>"]
    barred[str(end)] = -100.0
    return barred


def exact_body(n: int) -> dict[str, Any]:
    """Greedy and exactly ``n`` tokens. llama-cpp-python has no ``ignore_eos``; its
    ``min_tokens`` would do, but not beside a ``logit_bias``: with both, it drops both
    (``logits_processor = logits_processor.extend(...)``, which is None)."""
    return {"max_tokens": n, "temperature": 0, "logit_bias": barred_tokens()}


def exact(n: int) -> dict[str, Any]:
    """:func:`exact_body` as the SDK's arguments."""
    return {"max_tokens": n, "temperature": 0, "extra_body": {"logit_bias": barred_tokens()}}


async def proxy_for(lab: Lab, servers: list[LlamaCppServer]) -> Served:
    """A ``family: llamacpp`` pool: probed at the server's lock-free path, streams not
    asked for usage they never carry, their tokens counted from their events."""
    health = {"interval_s": 0.1, "cooldown_s": 0.2, "timeout_s": 5}
    pool = {"models": [SERVED_NAME], "family": "llamacpp", "health": health}
    return await lab.proxy(proxy_config([s.url for s in servers], slots=1, pool=pool))


def completion_tokens(served: Served, org: str = "A") -> float | None:
    labels = {"org": org, "class": "batch", "pool": "sim"}
    registry = served.state.metrics.registry
    return registry.get_sample_value("sfq_completion_tokens_total", labels)


async def sse_events(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[bytes, list[bytes]]:
    """The raw stream and its events (split on blank lines, whichever line ending)."""
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    return raw, [e for e in re.split(rb"\r?\n\r?\n", raw) if e.strip()]


async def read_to_the_end(response: aiohttp.ClientResponse) -> bytes:
    """What an interrupted stream sent: the server ends it with ``data: [DONE]``, then
    either ends the body or drops the connection mid-body (no last chunk of the chunked
    encoding), as the race between its generator and its lock goes: CI has seen both."""
    raw = b""
    try:
        async for line in response.content:
            raw += line
    except aiohttp.ClientPayloadError:
        pass
    return raw


def chunks(events: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(e.removeprefix(b"data: ")) for e in events if e != b"data: [DONE]"]


def text_of(events: list[bytes]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks(events))


async def test_a_chat_through_the_proxy_is_what_llamacpp_answers(
    lab: Lab, llamacpp_servers: list[LlamaCppServer]
) -> None:
    server = llamacpp_servers[0]
    served = await proxy_for(lab, [server])
    client = lab.client(served)
    reply = await client.chat.completions.create(model=SERVED_NAME, messages=CHAT, **exact(8))
    http = await lab.http()
    body = {"model": SERVED_NAME, "messages": CHAT, **exact_body(8)}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
        direct = await r.json()

    assert reply.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == direct["choices"][0]["finish_reason"] == "length"
    assert reply.usage is not None
    assert reply.usage.model_dump(exclude_none=True) == direct["usage"]
    assert reply.usage.completion_tokens == 8
    assert completion_tokens(served) == 8


async def test_a_completion_through_the_proxy_is_what_llamacpp_answers(
    lab: Lab, llamacpp_servers: list[LlamaCppServer]
) -> None:
    """``/v1/completions`` too; and a request without ``max_tokens`` is sent the pool's
    default, so it generates what it was charged for (llama-cpp-python's own default is 16)."""
    server = llamacpp_servers[0]
    served = await proxy_for(lab, [server])
    client = lab.client(served)
    prompt = "def fair_share(teams):"
    reply = await client.completions.create(model=SERVED_NAME, prompt=prompt, **exact(8))
    http = await lab.http()
    body = {"model": SERVED_NAME, "prompt": prompt, **exact_body(8)}
    async with http.post(f"{server.url}/v1/completions", json=body) as r:
        direct = await r.json()
    assert reply.choices[0].text == direct["choices"][0]["text"]
    assert reply.choices[0].text
    assert reply.usage is not None
    assert reply.usage.model_dump(exclude_none=True) == direct["usage"]
    assert completion_tokens(served) == 8

    unbounded = exact(8)
    del unbounded["max_tokens"]
    reply = await client.completions.create(model=SERVED_NAME, prompt=prompt, **unbounded)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 512  # proxy_config's default_max_tokens, injected


async def test_a_stream_through_the_proxy_is_byte_true_but_for_ids(
    lab: Lab, llamacpp_servers: list[LlamaCppServer]
) -> None:
    """The body goes as the client sent it (a llamacpp pool asks for no usage, which the
    server would ignore), and the events are the server's own, ids and timestamps aside."""
    server = llamacpp_servers[0]
    served = await proxy_for(lab, [server])
    http = await lab.http()
    body = {"model": SERVED_NAME, "messages": CHAT, "stream": True, **exact_body(12)}
    raw_direct, direct = await sse_events(http, server.url, body, {})
    raw_proxied, proxied = await sse_events(http, served.url, body, AUTH)

    volatile = rb'"(id|created)": ?("(?:[^"\\]|\\.)*"|\d+)'
    assert re.sub(volatile, b"", raw_proxied) == re.sub(volatile, b"", raw_direct)
    assert text_of(proxied)
    assert text_of(proxied) == text_of(direct)
    assert proxied[-1] == b"data: [DONE]"
    assert chunks(proxied)[-1]["choices"][0]["finish_reason"] == "length"
    assert not any(b'"usage"' in e for e in proxied)


@pytest.mark.parametrize("asked", [True, False])
async def test_streams_have_no_usage_so_the_proxy_counts_their_token_events(
    lab: Lab, llamacpp_servers: list[LlamaCppServer], asked: bool
) -> None:
    """A family difference: no usage chunk, ``include_usage`` or not (vLLM sends one); the
    proxy counts the output from the events, one per token, as the server generated it."""
    served = await proxy_for(lab, llamacpp_servers[:1])
    client = lab.client(served)
    options = {"stream_options": {"include_usage": True}} if asked else {}
    stream = await client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, stream=True, **options, **exact(10)
    )
    got = [chunk async for chunk in stream]
    assert all(c.usage is None for c in got)
    assert got[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert text
    assert completion_tokens(served) == 10


async def test_overlap_ends_a_stream_early_and_the_proxy_never_overlaps(
    lab: Lab, llamacpp_servers: list[LlamaCppServer]
) -> None:
    """Directly, a second request cuts the running stream short (no finishing event); through
    the proxy, with one slot per server, twelve streams at once all end whole."""
    server = llamacpp_servers[0]
    http = await lab.http()
    body = {"model": SERVED_NAME, "messages": CHAT, "stream": True, **exact_body(400)}
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as first:
        raw = await first.content.readline()  # the stream is running
        async with http.get(f"{server.url}/v1/models") as second:  # waits for the lock
            assert second.status == 200
        raw += await read_to_the_end(first)
    cut = [e for e in re.split(rb"\r?\n\r?\n", raw) if e.strip()]
    assert cut[-1] == b"data: [DONE]"
    assert len(cut) < 400
    assert not any(c["choices"][0]["finish_reason"] for c in chunks(cut))

    served = await proxy_for(lab, llamacpp_servers)
    client = lab.client(served)

    async def one(i: int) -> tuple[int, str | None]:
        stream = await client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": f"x{i}"}],
            stream=True,
            **exact(60),
        )
        got = [chunk async for chunk in stream]
        return len(got), got[-1].choices[0].finish_reason

    ends = await asyncio.gather(*(one(i) for i in range(12)))
    assert ends == [(62, "length")] * 12  # role, 60 tokens, the finishing event: none cut short


async def test_disconnect_aborts_in_llamacpp_and_a_queued_leaver_never_reaches_it(
    lab: Lab, llamacpp_servers: list[LlamaCppServer]
) -> None:
    """llama-cpp-python has no metrics: its log says what it did (uvicorn's access lines, and
    its own line when it drops a stream whose client left)."""
    server = llamacpp_servers[1]
    served = await proxy_for(lab, [server])
    start = server.log_path.stat().st_size

    def log() -> bytes:
        with server.log_path.open("rb") as f:
            f.seek(start)
            return f.read()

    stream = await lab.client(served, "A").completions.create(
        model=SERVED_NAME, prompt="def fair_share(teams):", stream=True, **exact(1000)
    )
    got = []

    async def read() -> None:  # keeps reading: the server looks for a leaver per chunk sent
        async for chunk in stream:
            got.append(chunk)

    reader = asyncio.create_task(read())
    await eventually(lambda: bool(got))
    leaver = asyncio.create_task(
        lab.client(served, "B").completions.create(
            model=SERVED_NAME, prompt="never sent", max_tokens=5
        )
    )
    await eventually(lambda: served.queue().backlog("B/batch") == 1)
    leaver.cancel()
    await eventually(lambda: served.queue().backlog("B/batch") == 0)
    reader.cancel()
    await stream.close()
    await eventually(lambda: b"Disconnected from client" in log(), within=5)
    assert len(got) < 1000  # aborted, not finished

    after = await lab.client(served, "A").chat.completions.create(
        model=SERVED_NAME, messages=CHAT, **exact(4)
    )
    assert after.choices[0].finish_reason == "length"  # the lock was given back
    assert log().count(b"POST /v1/completions") == 1  # the leaver never got there
    assert log().count(b"POST /v1/chat/completions") == 1


async def test_two_orgs_flooding_one_server_alternate(
    lab: Lab, llamacpp_servers: list[LlamaCppServer]
) -> None:
    """The fair queue in front of a server that runs one request at a time: A and B queue
    10 requests each behind C's stream, and once it ends they are served by turns."""
    served = await proxy_for(lab, llamacpp_servers[:1])
    blocker = await lab.client(served, "C").chat.completions.create(
        model=SERVED_NAME, messages=CHAT, stream=True, **exact(1000)
    )
    flood = [
        lab.client(served, org).chat.completions.create(
            model=SERVED_NAME, messages=CHAT, **exact(8)
        )
        for _ in range(10)
        for org in "AB"
    ]
    order = await dispatched_behind(served, blocker, flood, within=60)
    assert_alternate(order, per_org=10)


async def test_a_stopped_server_is_routed_around_and_used_again_after_restart(
    lab: Lab, llamacpp_servers: list[LlamaCppServer]
) -> None:
    """Its probe fails, the pool takes it out and serves everything on the other; once it is
    back, its first good probe after the cooldown puts it back in rotation."""
    served = await proxy_for(lab, llamacpp_servers)
    stopped = llamacpp_servers[1]
    backend = served.state.pools["sim"].placement.backends[1]
    client = lab.client(served)

    async def one(i: int) -> int:
        reply = await client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": f"n{i}"}], **exact(6)
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    try:
        await asyncio.to_thread(stopped.stop)
        await eventually(lambda: not backend.healthy, within=5)
        assert await asyncio.gather(*(one(i) for i in range(6))) == [6] * 6
    finally:
        await asyncio.to_thread(stopped.start)
        await asyncio.to_thread(stopped.wait_ready)
    await eventually(lambda: backend.healthy, within=10)
    recent = served.state.pools["sim"].recent
    start = len(recent)
    assert await asyncio.gather(*(one(i) for i in range(8))) == [6] * 8
    used = {d.backend for d in list(recent)[start:]}
    assert backend.name in used  # back in rotation
