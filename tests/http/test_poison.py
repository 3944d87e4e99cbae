"""Nothing one client or one backend sends can break a pool.

Each test replays what once broke a pool for every org — a huge ``max_tokens``, a request
larger than a provider's bucket, a backend that answers garbage, a fault of our own at any
step of a request's life — and then shows the pool whole: nothing left queued or held, and
a burst right after reaches the pool's full concurrency.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from typing import Any

import openai
import pytest
import yaml
from aiohttp import web
from proxy_lab import KEYS, MODEL, Lab, Served, config_yaml, eventually, leftovers, proxy_config

from sfq_proxy.sim.server import SimBackend

CHAT = [{"role": "user", "content": "hi"}]
AUTH = {"Authorization": f"Bearer {KEYS['A']}", "Content-Type": "application/json"}


async def assert_whole(lab: Lab, served: Served, sim: SimBackend, slots: int) -> None:
    """Nothing is left behind, and a burst of ``slots`` requests runs all at once on ``sim``."""
    await eventually(lambda: not leftovers(served))
    sim.stats.reset()
    client = lab.client(served, "B")
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200)
            for _ in range(slots)
        )
    )
    assert [r.usage.completion_tokens for r in replies] == [200] * slots
    assert sim.stats.max_concurrent == slots  # every slot was free: none leaked
    assert not leftovers(served)


async def healthy(request: web.Request) -> web.Response:
    return web.Response(text="ok")


# -- what a client sends ------------------------------------------------------------------------


async def test_a_huge_max_tokens_is_400_and_the_pool_keeps_serving(lab: Lab) -> None:
    """``max_tokens`` of 10^305 used to pass, then overflow inside the fair queue after it
    was taken off its flow: every later request of every org got a 500, 0 of 6 served."""
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url], slots=6))
    body = '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1%s}'
    http = await lab.http()
    url = f"{served.url}/v1/chat/completions"
    async with http.post(url, data=body % (MODEL, "0" * 305), headers=AUTH) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert "'max_tokens'" in error["message"]
    assert "10000000" in error["message"]
    assert sim.stats.requests_seen == 0
    await assert_whole(lab, served, sim, 6)


async def test_one_request_larger_than_a_providers_bucket_cannot_lock_the_pool(lab: Lab) -> None:
    """Charged to the pool's tokens-per-minute bucket, ``max_tokens: 1e7`` used to leave every
    org a 429 for about 930 s (it is now above the pool's ceiling per request too). One
    within the ceiling that can never fit the bucket is refused, and nothing is taken."""
    sim = await lab.backend()
    rate = {"rate": {"tokens_per_minute": 60_000}}
    served = await lab.proxy(proxy_config([sim.url], slots=2, pool=rate))
    with pytest.raises(openai.BadRequestError) as refused:
        await lab.client(served).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=100_000
        )
    assert refused.value.body["code"] == "tokens_exceed_limit"
    assert "60000 tokens per minute of pool sim" in refused.value.body["message"]
    await assert_whole(lab, served, sim, 2)  # B at once: no 429


async def test_tokens_come_back_when_the_backend_refuses_without_generating(lab: Lab) -> None:
    """An org of 1,000 tokens a minute sends five 900-token requests that its backend refuses
    at once (e.g. a context too long): each answer is the backend's own 400, never a 429,
    because nothing was generated and the org's and the pool's buckets got their tokens
    back. Without the refund the second one would wait a minute."""

    async def refuse(request: web.Request) -> web.Response:
        error = {"message": "context too long", "type": "invalid_request_error", "code": None}
        return web.json_response({"error": error}, status=400)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    app.router.add_get("/health", healthy)
    port = await lab.serve(app)
    served = await lab.proxy(
        proxy_config(
            [f"http://127.0.0.1:{port}"],
            orgs={"A": {"tpm": 1000}},
            pool={"rate": {"tokens_per_minute": 1000}},
        )
    )
    client = lab.client(served)
    for _ in range(5):  # 1 input token (chars/4) + 899
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=899)
        assert refused.value.body["message"] == "context too long"  # the backend's, not ours


async def test_an_upstream_429_without_retry_after_gets_one(lab: Lab) -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=429)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", busy)
    app.router.add_get("/health", healthy)
    port = await lab.serve(app)
    served = await lab.proxy(proxy_config([f"http://127.0.0.1:{port}"]))
    with pytest.raises(openai.RateLimitError) as limited:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert limited.value.response.headers["Retry-After"] == "1"


# -- what a backend sends -----------------------------------------------------------------------

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
GARBAGE = {
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n",
    "bad-status-line": b"HTTP/1.1 two hundred OK\r\n\r\n",
    "bad-header": OK_HEAD + b"No colon in this header\r\nContent-Length: 2\r\n\r\n{}",
    "bad-chunking": OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "early-close": OK_HEAD + b'Content-Length: 100\r\n\r\n{"id":',
    "hangs-up": b"",
    "status-999": b"HTTP/1.1 999 Weird\r\nContent-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("answer", GARBAGE.values(), ids=GARBAGE.keys())
async def test_a_backend_answering_garbage_is_a_502_and_is_taken_out(
    lab: Lab, answer: bytes
) -> None:
    garbage = await lab.raw(answer)
    sim = await lab.backend()
    pool = {"health": {"interval_s": 0.1, "cooldown_s": 60, "timeout_s": 5}}
    served = await lab.proxy(
        proxy_config([garbage, sim.url], slots=2, pool=pool, retry={"max_attempts": 1})
    )
    with pytest.raises(openai.InternalServerError) as failed:  # first listed: the garbage
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert failed.value.status_code == 502
    assert (failed.value.body["type"], failed.value.body["code"]) == (
        "upstream_error",
        "bad_gateway",
    )
    assert not served.state.pools["sim"].placement.backends[0].healthy
    await assert_whole(lab, served, sim, 2)


async def test_a_body_the_backend_stops_sending_is_a_504_within_idle_s(lab: Lab) -> None:
    silent = await lab.raw(OK_HEAD + b'Content-Length: 100\r\n\r\n{"id":', 30.0)
    sim = await lab.backend()
    pool = {
        "health": {"interval_s": 0.1, "cooldown_s": 60, "timeout_s": 5},
        "timeouts": {"connect_s": 1, "first_byte_s": 10, "idle_s": 0.5},
    }
    served = await lab.proxy(
        proxy_config([silent, sim.url], slots=2, pool=pool, retry={"max_attempts": 1})
    )
    with pytest.raises(openai.APIStatusError) as stalled:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT)
    assert (stalled.value.status_code, stalled.value.body["code"]) == (504, "upstream_timeout")
    assert not served.state.pools["sim"].placement.backends[0].healthy
    await assert_whole(lab, served, sim, 2)


EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
)
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + f"{len(EVENT):x}\r\n".encode() + EVENT + b"\r\n"
)  # fmt: skip
BROKEN_STREAMS = {
    "bad-chunk-size": (STREAM_HEAD, b"zz\r\n", 30.0),  # aiohttp's parser then waits forever
    "chunk-extension-garbage": (STREAM_HEAD, b"5;\x00\r\nabcde\r\n", 30.0),
    "closes-mid-stream": (STREAM_HEAD,),
    "goes-silent": (STREAM_HEAD, 30.0),
}


@pytest.mark.parametrize("answer", BROKEN_STREAMS.values(), ids=BROKEN_STREAMS.keys())
async def test_a_stream_the_backend_breaks_off_ends_with_an_error_event(
    lab: Lab, answer: tuple[bytes | float, ...]
) -> None:
    """The client keeps what it got, then an error event (the SDK raises it) and the end;
    the slot is free within ``timeouts.idle_s`` even when the backend never closes."""
    garbage = await lab.raw(*answer)
    sim = await lab.backend()
    pool = {
        "health": {"interval_s": 0.1, "cooldown_s": 60, "timeout_s": 5},
        "timeouts": {"connect_s": 1, "first_byte_s": 10, "idle_s": 0.5},
    }
    served = await lab.proxy(proxy_config([garbage, sim.url], slots=2, pool=pool))
    stream = await lab.client(served).chat.completions.create(
        model=MODEL, messages=CHAT, stream=True
    )
    got: list[str | None] = []

    async def read() -> None:
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content)

    with pytest.raises(openai.APIError, match="broke off"):  # the SDK raises the error event
        await read()
    assert got == ["Hi"]
    assert not served.state.pools["sim"].placement.backends[0].healthy
    await assert_whole(lab, served, sim, 2)


# -- a fault of the proxy's own, at each step of a request's life --------------------------------

BEFORE_THE_ANSWER = [
    ("sfq_proxy.core.flows.Authenticator.identify", 500),
    ("sfq_proxy.http.handler.parse", 500),
    ("sfq_proxy.http.handler.classify", 500),
    ("sfq_proxy.core.cost.CostModel.price", 500),
    ("sfq_proxy.core.admission.Admission.admit", 500),
    ("sfq_proxy.observability.metrics.Metrics.seen", 500),
    ("sfq_proxy.state.pool.Pool.acquire", 500),
    ("sfq_proxy.http.relay._open", 500),
]
AFTER_IT_STARTED = [("sfq_proxy.http.relay._UsageStripper.feed", "cut")]
WHILE_COUNTING = [
    ("sfq_proxy.http.handler.read_usage", "intact"),
    ("sfq_proxy.http.handler._account", "intact"),
    ("sfq_proxy.core.cost.CostModel.observe", "intact"),
    ("sfq_proxy.observability.metrics.Metrics.first_byte", 500),  # called as the headers arrive
]


@pytest.mark.parametrize(
    ("target", "expected"), BEFORE_THE_ANSWER + AFTER_IT_STARTED + WHILE_COUNTING
)
async def test_a_fault_at_any_step_loses_nothing(
    lab: Lab, monkeypatch: pytest.MonkeyPatch, target: str, expected: Any
) -> None:
    """Before the answer starts the client gets an OpenAI-style 500; once a stream has
    started it ends with an error event; a failure to count an answer leaves it intact.
    Whichever: no queue entry, slot or idempotency key is left behind."""
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url], slots=4))

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(target, fail)
    http = await lab.http()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True}
    headers = {**AUTH, "Idempotency-Key": "once"}
    async with http.post(f"{served.url}/v1/chat/completions", json=body, headers=headers) as r:
        status, data = r.status, await r.read()
    monkeypatch.undo()
    events = data.split(b"\n\n")
    if expected == 500:
        assert status == 500
        assert json.loads(data)["error"]["code"] == "internal_error"
    elif expected == "cut":
        assert status == 200
        assert events[-2:] == [b"data: [DONE]", b""]
        assert b'"internal_error"' in events[-3]  # the proxy's own fault, said as such
    else:
        assert status == 200
        assert events[-2:] == [b"data: [DONE]", b""]
        assert b'"finish_reason":"length"' in events[-3].replace(b" ", b"")
    await assert_whole(lab, served, sim, 4)


# -- what never reaches a log --------------------------------------------------------------------


def test_no_key_reaches_the_log_even_in_a_header_aiohttp_refuses(tmp_path: Any) -> None:
    """aiohttp's own error for a malformed header quotes it, value and all; the proxy's
    answer and its log line say only the kind of error (http/connections.py), and the log
    lines are redacted as they are written anyway, whichever logger wrote them."""
    secret = KEYS["A"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = yaml.safe_load(config_yaml(["http://127.0.0.1:9"]))
    data["listen"]["port"] = port
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(data))
    proxy = subprocess.Popen(
        [sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "SFQ_LOG_LEVEL": "debug"},
    )
    try:
        assert proxy.stdout is not None
        assert b"listening" in proxy.stdout.readline()
        for header in (f"Bearer {secret}\x01", f"Bearer {secret}\x7f", f"Basic {secret}\x00"):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    + b"Authorization: " + header.encode("latin-1") + b"\r\n"
                    + b"Content-Length: 2\r\n\r\n{}"
                )  # fmt: skip
                answer = conn.recv(65536)
                assert answer.split(b" ")[1] == b"400"
                assert b'"code": "invalid_request"' in answer
                assert secret[3:].encode() not in answer
    finally:
        proxy.terminate()
        _, stderr = proxy.communicate(timeout=30)
    assert stderr.count(b"was not valid HTTP") == 3  # the kind of error, logged
    assert secret.encode() not in stderr
    assert secret[3:].encode() not in stderr
