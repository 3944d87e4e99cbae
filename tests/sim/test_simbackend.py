"""End-to-end tests of the simulated vLLM backend, over real sockets.

The openai SDK is the client wherever the behaviour is visible through it; raw aiohttp or
raw sockets are used for wire-level details (SSE framing, error bodies, disconnects).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, TypeVar

import aiohttp
import openai
import pytest
from images import png_part

from sfq_proxy.sim.api import estimate_prompt_tokens
from sfq_proxy.sim.command import add_parser
from sfq_proxy.sim.server import SimBackend
from sfq_proxy.sim.settings import SimConfig

T = TypeVar("T")
MODEL = "sim-llama"
# 12 characters → 3 tokens, plus the per-message overhead of 4.
MESSAGES = [{"role": "user", "content": "hello world!"}]
MESSAGES_TOKENS = 7


def make_config(**overrides: Any) -> SimConfig:
    """Fast engine: 40 tok/s decode sped up 200x, so a 100-token answer takes ~15 ms."""
    base: dict[str, Any] = {
        "models": [MODEL],
        "max_num_seqs": 4,
        "prefill_tokens_per_s": 4000.0,
        "decode_tokens_per_s": 40.0,
        "batch_slowdown": 0.02,
        "time_scale": 200.0,
        "max_model_len": 1024,
        "default_max_tokens": 20,
    }
    return SimConfig(**{**base, **overrides})


def slow_config(**overrides: Any) -> SimConfig:
    """Real-time engine (25 ms per token): long answers outlive the test unless aborted."""
    return make_config(time_scale=1.0, **overrides)


def chat_body(max_tokens: int = 5, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, **extra}


async def eventually(predicate: Callable[[], bool], within: float = 1.0) -> None:
    """Wait until predicate() holds; fail after ``within`` seconds."""
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.002)
    assert predicate(), "condition not reached in time"


async def drain(source: AsyncIterable[T], into: list[T]) -> None:
    """Collect items until the source ends or raises; what arrived stays in ``into``."""
    async for item in source:
        into.append(item)


async def raw_post(port: int, path: str, body: dict[str, Any]) -> asyncio.StreamWriter:
    """Send a request over a bare socket, so the test decides exactly when it hangs up."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    return writer


@pytest.fixture
async def sim() -> AsyncIterator[SimBackend]:
    async with SimBackend(make_config()) as backend:
        yield backend


@pytest.fixture
async def client(sim: SimBackend) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


# ------------------------------------------------------------------- engine model, pure


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"messages": [{"role": "user", "content": "abcd"}]}, 1 + 4),
        ({"messages": [{"role": "user", "content": "abcde"}]}, 2 + 4),
        ({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]}, 9),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "abcdefgh"},
                            {"type": "image_url", "image_url": {}},
                            {"type": "text", "text": "ij"},
                        ],
                    }
                ]
            },
            3 + 4 + 765,  # an image of unknown size: the default price of an image
        ),
        ({"messages": [{"role": "assistant", "content": None}]}, 4),
        ({"prompt": "abcdefghi"}, 3),
        ({"prompt": [5, 6, 7]}, 3),
        ({"prompt": ["abcd", "abcde"]}, 3),
    ],
)
def test_estimate_prompt_tokens(body: dict[str, Any], expected: int) -> None:
    assert estimate_prompt_tokens(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": ["hi"]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        {"prompt": []},
        {"prompt": 3},
        {"prompt": [1, "a"]},
        {},
    ],
)
def test_estimate_prompt_tokens_rejects_bad_shapes(body: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        estimate_prompt_tokens(body)


def test_timing_model() -> None:
    cfg = SimConfig(prefill_tokens_per_s=1000.0, decode_tokens_per_s=50.0, batch_slowdown=0.1,
                    time_scale=2.0)  # fmt: skip
    assert cfg.prefill_seconds(500) == pytest.approx(0.25)
    assert cfg.decode_interval(1) == pytest.approx(0.01)
    assert cfg.decode_interval(11) == pytest.approx(0.02)  # a bigger batch decodes slower


# ------------------------------------------------------------------- OpenAI surface


async def test_chat_non_streaming(sim: SimBackend, client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, user="alice"
    )
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    assert resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.message.content.split()) == 5
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.model_dump(
        include={"prompt_tokens", "completion_tokens", "total_tokens"}
    ) == {
        "prompt_tokens": MESSAGES_TOKENS,
        "completion_tokens": 5,
        "total_tokens": MESSAGES_TOKENS + 5,
    }
    (rec,) = sim.stats.log
    assert (rec.user, rec.model, rec.outcome, rec.had_authorization) == (
        "alice",
        MODEL,
        "completed",
        True,
    )
    assert rec.arrived_at <= rec.started_at <= rec.ended_at
    assert (sim.stats.completed, sim.stats.prompt_tokens, sim.stats.completion_tokens) == (1, 7, 5)


async def test_chat_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = chunks[1:-1]
    assert len(content) == 6  # one event per token
    assert all(c.usage is None for c in content)
    assert [c.choices[0].finish_reason for c in content] == [None] * 5 + ["length"]
    text = "".join(c.choices[0].delta.content for c in content)
    assert len(text.split()) == 6
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (MESSAGES_TOKENS, 6)


async def test_streaming_wire_format_without_usage(
    sim: SimBackend, http: aiohttp.ClientSession
) -> None:
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(3, stream=True)) as r:
        assert r.status == 200
        assert r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(payloads) == 4  # role chunk + 3 tokens, and no usage chunk
    assert all("usage" not in p and len(p["choices"]) == 1 for p in payloads)
    assert sim.stats.log[0].had_authorization is False


async def test_completions_non_streaming(client: openai.AsyncOpenAI) -> None:
    resp = await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4)
    assert resp.id.startswith("cmpl-")
    assert resp.object == "text_completion"
    assert len(resp.choices[0].text.split()) == 4
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (3, 4)
    assert resp.usage.total_tokens == 7


async def test_completions_streaming(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model=MODEL, prompt="abcdefgh", max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert {c.object for c in chunks} == {"text_completion"}
    assert len("".join(c.choices[0].text for c in chunks[:-1]).split()) == 3
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 3)


async def test_max_completion_tokens_and_default(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=2
    )
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 2
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 20  # default_max_tokens
    # The default shrinks to what is left of the context window.
    resp = await client.completions.create(model=MODEL, prompt=list(range(1020)))
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 4


async def test_models_health_metrics(sim: SimBackend, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [(MODEL, "model")]
    async with http.get(sim.url + "/health") as r:
        assert (r.status, await r.read()) == (200, b"")
    sim.faults.health_status = 503
    async with http.get(sim.url + "/health") as r:
        assert r.status == 503
    async with http.get(sim.url + "/metrics") as r:
        assert r.content_type == "text/plain"
        metrics = await r.text()
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0' in metrics
    assert f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0' in metrics


async def test_models_via_sdk(client: openai.AsyncOpenAI) -> None:
    assert [m.id async for m in client.models.list()] == [MODEL]


# ------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000),
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/chat/completions", {"model": MODEL}),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("/v1/completions", {"model": MODEL, "messages": MESSAGES}),
        ("/v1/chat/completions", chat_body(0)),
        ("/v1/chat/completions", chat_body(-3)),
        ("/v1/chat/completions", chat_body("5")),
        ("/v1/chat/completions", chat_body(2.5)),
        ("/v1/chat/completions", chat_body(True)),
        ("/v1/chat/completions", chat_body(1024 - MESSAGES_TOKENS + 1)),
        ("/v1/completions", {"model": MODEL, "prompt": list(range(1024))}),
        ("/v1/chat/completions", chat_body(stream="yes")),
    ],
)
async def test_bad_requests_are_400(
    sim: SimBackend, http: aiohttp.ClientSession, path: str, body: bytes | dict[str, Any]
) -> None:
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(sim.url + path, **kwargs) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert error["message"]
    assert sim.stats.requests_seen == 0


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.status_code == 404
    assert "nope" in info.value.message


async def test_context_overflow_via_sdk(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1020)


# ------------------------------------------------------------------- scheduling


async def test_max_num_seqs_is_respected_and_fifo(http: aiohttp.ClientSession) -> None:
    async with SimBackend(make_config(max_num_seqs=2)) as sim:

        async def one(i: int) -> int:
            body = chat_body(60, user=f"u{i}")
            async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status

        seen: list[tuple[int, int]] = []
        jobs = asyncio.gather(*(one(i) for i in range(10)))
        while not jobs.done():
            seen.append((sim.stats.running, sim.stats.waiting))
            await asyncio.sleep(0.0005)
        assert await jobs == [200] * 10

    assert max(running for running, _ in seen) == 2
    assert max(waiting for _, waiting in seen) > 0
    stats = sim.stats
    assert (stats.completed, stats.running, stats.waiting) == (10, 0, 0)
    assert stats.max_concurrent > 2
    log = stats.log
    starts = [rec.started_at for rec in log]
    assert starts == sorted(starts)  # FIFO: slots are granted in arrival order
    for rec in log:  # at no instant more than two sequences hold a slot
        overlapping = [o for o in log if o.started_at <= rec.started_at < o.ended_at]
        assert len(overlapping) <= 2


async def test_stream_disconnect_aborts_and_frees_slot(http: aiohttp.ClientSession) -> None:
    async with SimBackend(slow_config(max_num_seqs=1)) as sim:
        long = await http.post(sim.url + "/v1/chat/completions", json=chat_body(1000, stream=True))
        await long.content.readline()  # the first event: the sequence is running

        async def short() -> int:
            async with http.post(sim.url + "/v1/chat/completions", json=chat_body(2)) as r:
                await r.read()
                return r.status

        queued = asyncio.create_task(short())
        await eventually(lambda: sim.stats.waiting == 1)
        long.close()
        await eventually(lambda: sim.stats.aborted == 1, within=1.0)
        assert await asyncio.wait_for(queued, 1.0) == 200
        assert [rec.outcome for rec in sim.stats.log] == ["aborted", "completed"]
        assert 0 < sim.stats.log[0].completion_tokens < 1000


async def test_non_streaming_disconnect_aborts_running_and_waiting() -> None:
    async with SimBackend(slow_config(max_num_seqs=1)) as sim:
        running = await raw_post(sim.port, "/v1/chat/completions", chat_body(1000))
        await eventually(lambda: sim.stats.running == 1)
        waiting = await raw_post(sim.port, "/v1/completions",
                                 {"model": MODEL, "prompt": "x", "max_tokens": 5})  # fmt: skip
        await eventually(lambda: sim.stats.waiting == 1)

        waiting.close()
        await eventually(lambda: sim.stats.aborted == 1 and sim.stats.waiting == 0)
        assert sim.stats.log[1].started_at is None
        running.close()
        await eventually(lambda: sim.stats.aborted == 2 and sim.stats.running == 0)
        assert sim.stats.log[0].outcome == "aborted"


async def test_stop_aborts_inflight_sequences(http: aiohttp.ClientSession) -> None:
    sim = SimBackend(slow_config())
    await sim.start()
    resp = await http.post(sim.url + "/v1/chat/completions", json=chat_body(1000, stream=True))
    await resp.content.readline()
    await asyncio.wait_for(sim.stop(), 2.0)
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    assert (sim.stats.aborted, sim.stats.running) == (1, 0)


# ------------------------------------------------------------------- faults


async def test_fail_rate(sim: SimBackend, client: openai.AsyncOpenAI) -> None:
    sim.faults.fail_rate = 1.0
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert info.value.status_code == 503
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == 503
    assert info.value.body["message"]
    assert (sim.stats.requests_seen, sim.stats.failed_injected) == (1, 1)
    assert sim.stats.log[0].outcome == "failed"


async def test_die_after_tokens_streaming(sim: SimBackend, http: aiohttp.ClientSession) -> None:
    sim.faults.die_after_tokens = 3
    lines: list[bytes] = []
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(10, stream=True)) as r:
        with pytest.raises(aiohttp.ClientPayloadError):  # the chunked body never finishes
            await drain(r.content, lines)
    events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert [e["choices"][0]["delta"].get("role") for e in events] == ["assistant", None, None, None]
    assert (sim.stats.failed_injected, sim.stats.log[0].outcome) == (1, "failed")


async def test_die_after_tokens_via_sdk(sim: SimBackend, client: openai.AsyncOpenAI) -> None:
    sim.faults.die_after_tokens = 2
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, stream=True
    )
    chunks: list[Any] = []
    with pytest.raises(openai.APIConnectionError):
        await drain(stream, chunks)
    assert len("".join(c.choices[0].delta.content for c in chunks).split()) == 2
    with pytest.raises(openai.APIConnectionError):  # non-streaming: hung up, no response
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10)
    assert sim.stats.failed_injected == 2
    sim.faults.die_after_tokens = 10  # never reached by a 10-token answer
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10)
    assert resp.choices[0].finish_reason == "length"


async def test_refuse_connections(sim: SimBackend, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.url + "/health") as r:  # leaves an idle keep-alive connection
        assert r.status == 200
    port = sim.port
    await sim.pause_listening()
    assert sim.faults.refuse_connections is True
    with pytest.raises(aiohttp.ClientConnectorError):  # the pooled connection was dropped too
        async with http.get(sim.url + "/health"):
            pass
    await sim.resume_listening()
    assert sim.port == port
    async with http.get(sim.url + "/health") as r:
        assert r.status == 200


async def test_faults_over_http(sim: SimBackend, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/sim/faults", json={"refuse_connections": True}) as r:
        assert r.status == 200  # the request that closes the door still gets its answer
        assert (await r.json())["refuse_connections"] is True
    with pytest.raises(aiohttp.ClientConnectorError):
        await http.get(sim.url + "/health")
    await sim.update_faults(refuse_connections=False, fail_status=500)
    async with http.post(sim.url + "/sim/faults", json={"fail_rate": 1.0}) as r:
        assert (await r.json())["fail_rate"] == 1.0
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body()) as r:
        assert r.status == 500
        assert (await r.json())["error"]["code"] == 500
    for bad in ({"fail_rate": 2}, {"bogus": 1}, {"die_after_tokens": -1}, {"fail_status": 599}):
        async with http.post(sim.url + "/sim/faults", json=bad) as r:
            assert r.status == 400
    assert sim.faults.fail_rate == 1.0


async def test_stats_endpoint_and_reset(sim: SimBackend, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(3, user="bob")) as r:
        assert r.status == 200
    async with http.get(sim.url + "/sim/stats") as r:
        stats = await r.json()
    assert (stats["requests_seen"], stats["completed"], stats["completion_tokens"]) == (1, 1, 3)
    assert stats["log"][0]["user"] == "bob"
    assert stats["log"][0]["outcome"] == "completed"
    async with http.post(sim.url + "/sim/reset") as r:
        assert r.status == 200
    assert (sim.stats.requests_seen, sim.stats.completed, sim.stats.log) == (0, 0, [])


# ------------------------------------------------------------------- determinism


async def _random_mode_outputs(seed: int) -> list[tuple[str, int, str]]:
    async with (
        SimBackend(make_config(output_mode="random", seed=seed)) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        outputs = []
        for _ in range(8):
            resp = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=30
            )
            assert resp.usage is not None
            outputs.append(
                (resp.choices[0].message.content, resp.usage.completion_tokens,
                 resp.choices[0].finish_reason)
            )  # fmt: skip
        return outputs


async def test_same_seed_same_outputs() -> None:
    first, again, other = await asyncio.gather(*(_random_mode_outputs(s) for s in (7, 7, 8)))
    assert first == again
    assert first != other
    lengths = [n for _, n, _ in first]
    assert all(1 <= n <= 30 for n in lengths)
    assert len(set(lengths)) > 1
    assert all(len(text.split()) == n for text, n, _ in first)
    assert all(reason == ("length" if n == 30 else "stop") for _, n, reason in first)


# ------------------------------------------------------------------- CLI


def test_cli_parser() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["sim-backend", "--port", "9000", "--model", "a", "--model", "b", "--max-num-seqs", "3",
         "--time-scale", "10", "--output-mode", "random", "--seed", "5"]
    )  # fmt: skip
    assert (args.port, args.models, args.max_num_seqs) == (9000, ["a", "b"], 3)
    assert (args.time_scale, args.output_mode, args.seed) == (10.0, "random", 5)
    assert callable(args.func)


# ------------------------------------------------------------------- what a real server does
# (issue 16: the tricks a tenant may play on the proxy's estimate need a backend that does
# what vLLM does with them: generate up to the context, n sequences, price images)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ([png_part(1024, 1024), {"type": "text", "text": "abcd"}], 765 + 1),
        ([png_part(2048, 4096)], 1105),  # OpenAI's worked examples of the tile rule
        ([png_part(4096, 8192, detail="low")], 85),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], 100),
        ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], 200),
        ([{"type": "file", "file": {"file_id": "f"}}], 300),
        ([{"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}], 400),
        ([{"type": "x-unknown"}], 300),  # an unknown kind is priced as a file, never free
        (["abcdefgh"], 2),  # a bare string part is text
    ],
)
def test_prompt_tokens_count_media_parts_and_the_template(content: list, expected: int) -> None:
    """Each message costs the template's tokens, its text and its media parts; an image whose
    size is readable by OpenAI's tile rule, any other part at the configured price."""
    media = {"image": 100, "audio": 200, "file": 300, "video": 400}
    body = {"messages": [{"role": "user", "content": content}]}
    assert estimate_prompt_tokens(body, 4.0, 7, media) == 7 + expected


async def test_the_prompt_of_a_chat_with_images_as_the_server_reports_it() -> None:
    async with (
        SimBackend(make_config(max_model_len=8192, tokens_per_message=7)) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        content = [{"type": "text", "text": "what is this?"}, png_part(1024, 1024)]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
        resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == (7 + 2) + (7 + 4 + 765)


async def test_without_max_tokens_vllm_generates_up_to_the_context() -> None:
    """default_max_tokens None: the rest of the context window, as vLLM does; a request's
    own max_completion_tokens wins over its max_tokens (the first of them that is set)."""
    async with (
        SimBackend(make_config(default_max_tokens=None)) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        both = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=3
        )
    assert resp.usage is not None
    assert both.usage is not None
    assert resp.usage.completion_tokens == 1024 - MESSAGES_TOKENS
    assert resp.choices[0].finish_reason == "length"
    assert both.usage.completion_tokens == 3
    assert [r.asked for r in sim.stats.log] == [{}, {"max_tokens": 9, "max_completion_tokens": 3}]
    assert [r.max_tokens for r in sim.stats.log] == [1024 - MESSAGES_TOKENS, 3]


async def test_n_choices_each_generate_and_are_all_counted(
    sim: SimBackend, client: openai.AsyncOpenAI
) -> None:
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(len(c.message.content.split()) == 5 for c in resp.choices)
    assert len({c.message.content for c in resp.choices}) > 1  # three sequences, not one copy
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (MESSAGES_TOKENS, 15)
    (rec,) = sim.stats.log
    assert (rec.sequences, rec.completion_tokens, rec.asked) == (3, 15, {"max_tokens": 5, "n": 3})


async def test_n_choices_stream_as_vllm_streams_them(client: openai.AsyncOpenAI) -> None:
    """A role chunk per choice first, then one chunk per token carrying its choice's index."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert all(len(c.choices) == 1 for c in chunks[:-1])
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    tokens = chunks[2:-1]
    for index in (0, 1):
        mine = [c.choices[0] for c in tokens if c.choices[0].index == index]
        assert len(mine) == 4
        assert [c.finish_reason for c in mine] == [None, None, None, "length"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


async def test_best_of_generates_more_than_it_returns(
    sim: SimBackend, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    """Completions' best_of: best_of sequences are generated, n returned; usage counts what
    is returned (as vLLM did), the backend's own count everything. As vLLM and OpenAI do,
    such a request is answered as one JSON body even when it asks for a stream."""
    resp = await client.completions.create(model=MODEL, prompt="abcd", max_tokens=4, best_of=3)
    assert [c.index for c in resp.choices] == [0]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 4
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 4, "best_of": 3, "n": 2,
            "stream": True}  # fmt: skip
    async with http.post(sim.url + "/v1/completions", json=body) as r:
        assert r.content_type == "application/json"
        answer = await r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 8
    assert [(r.sequences, r.completion_tokens, r.stream) for r in sim.stats.log] == [
        (3, 12, False),
        (3, 12, False),
    ]


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", {"n": 0}),
        ("/v1/chat/completions", {"n": "2"}),
        ("/v1/chat/completions", {"n": True}),
        ("/v1/completions", {"n": 3, "best_of": 2}),
        ("/v1/completions", {"best_of": 0}),
    ],
)
async def test_bad_choice_counts_are_400(
    sim: SimBackend, http: aiohttp.ClientSession, path: str, fields: dict[str, Any]
) -> None:
    body = chat_body(**fields) if "chat" in path else {"model": MODEL, "prompt": "x", **fields}
    async with http.post(sim.url + path, json=body) as r:
        assert r.status == 400
    assert sim.stats.requests_seen == 0


async def test_each_sequence_takes_a_batch_slot_and_none_waits_forever() -> None:
    """n sequences hold n of max_num_seqs at once, granted whole and in arrival order, so
    requests that each need most of the batch never hold parts of it and wait for the rest."""
    async with (
        SimBackend(make_config(max_num_seqs=4)) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):

        async def one(n: int) -> int:
            resp = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=30, n=n
            )
            return len(resp.choices)

        assert await asyncio.gather(*(one(3) for _ in range(6)), one(9)) == [3] * 6 + [9]
    log = sim.stats.log
    for rec in log:  # never more sequences running at once than the batch holds
        overlapping = [o for o in log if o.started_at <= rec.started_at < o.ended_at]
        assert sum(min(o.sequences, 4) for o in overlapping) <= 4
    assert sim.stats.max_concurrent > 4  # they did wait for each other


def test_sim_options_are_checked() -> None:
    for bad in ({"default_max_tokens": 0}, {"tokens_per_message": -1}, {"image_tokens": -5}):
        with pytest.raises(ValueError, match="must be"):
            make_config(**bad)
    assert make_config(default_max_tokens=None).default_max_tokens is None


def test_cli_parser_reads_the_new_options() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["sim-backend", "--default-max-tokens", "context", "--tokens-per-message", "7",
         "--image-tokens", "100", "--video-tokens", "5"]
    )  # fmt: skip
    assert (args.default_max_tokens, args.tokens_per_message) == (None, 7)
    assert (args.image_tokens, args.audio_tokens, args.video_tokens) == (100, 1500, 5)
    assert parser.parse_args(["sim-backend"]).default_max_tokens == 256
    with pytest.raises(SystemExit):
        parser.parse_args(["sim-backend", "--default-max-tokens", "lots"])


async def test_a_request_leaving_the_head_of_the_queue_lets_the_next_one_in() -> None:
    """Head-of-line: a 1-sequence request waits behind a 4-sequence one even with a slot
    free; when the 4-sequence one is abandoned, the next is granted at once."""
    async with SimBackend(slow_config(max_num_seqs=4)) as sim:
        running = await raw_post(sim.port, "/v1/chat/completions", chat_body(1000, n=3))
        await eventually(lambda: sim.stats.running == 3)
        big = await raw_post(sim.port, "/v1/chat/completions", chat_body(5, n=4))
        await eventually(lambda: sim.stats.waiting == 4)
        small = await raw_post(sim.port, "/v1/chat/completions", chat_body(1000))
        await eventually(lambda: sim.stats.waiting == 5)
        big.close()
        await eventually(lambda: sim.stats.running == 4 and sim.stats.waiting == 0)
        assert [r.outcome for r in sim.stats.log] == [None, "aborted", None]
        running.close()
        small.close()
        await eventually(lambda: sim.stats.running == 0)


async def test_hold_stalls_the_engine_until_release() -> None:
    """Held, the server accepts requests and serves none; released, it serves them in
    arrival order."""
    async with SimBackend(make_config()) as sim:
        sim.hold()
        async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as c:
            asks = [
                asyncio.create_task(
                    c.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=2, user=f"u{i}"
                    )
                )
                for i in range(3)
            ]
            await eventually(lambda: sim.stats.waiting == 3)
            assert (sim.stats.running, sim.stats.completed) == (0, 0)
            sim.release()
            await asyncio.gather(*asks)
    starts = [rec.started_at for rec in sim.stats.log]
    assert starts == sorted(starts)
    assert sim.stats.completed == 3


# ------------------------------------------------------------------- the Responses API


async def test_responses_non_streaming_as_vllm_answers(
    sim: SimBackend, client: openai.AsyncOpenAI
) -> None:
    answer = await client.responses.create(
        model=MODEL, instructions="abcd", input="hello world!", max_output_tokens=6
    )
    assert (answer.object, answer.model, answer.instructions) == ("response", MODEL, "abcd")
    assert answer.id.startswith("resp_")
    assert (answer.status, answer.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # type: ignore[union-attr]
    [message] = answer.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")  # type: ignore[union-attr]
    assert len(answer.output_text.split()) == 6
    # a system message of 1 token and the user's of 3, each with the template's 4
    assert answer.usage is not None
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (1 + 4 + 3 + 4, 6)
    assert answer.usage.total_tokens == 18
    assert sim.stats.log[0].asked == {"max_output_tokens": 6}
    short = await client.responses.create(model=MODEL, input="x", max_output_tokens=100)
    assert short.usage is not None
    assert short.usage.output_tokens == 100  # asked for, within the context


async def test_responses_input_items_are_the_chat_template_messages(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "abcdefgh"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ab"}],
            },
            {"role": "user", "content": "abcd"},
        ],
        max_output_tokens=1,
    )
    assert answer.usage is not None
    assert answer.usage.input_tokens == (2 + 4) + (1 + 4) + (1 + 4)


async def test_responses_stream_as_vllm_sends_it(
    sim: SimBackend, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "input": "hello world!", "max_output_tokens": 3, "stream": True}
    async with http.post(sim.url + "/v1/responses", json=body) as r:
        assert (r.status, r.content_type) == (200, "text/event-stream")
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]  # and no [DONE]
    data = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert [d["type"] for d in data] == kinds
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert data[0]["response"]["usage"] is None
    final = data[-1]["response"]
    assert final["usage"]["input_tokens"] == MESSAGES_TOKENS
    assert final["usage"]["output_tokens"] == 3
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text == data[-4]["text"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL},
        {"model": MODEL, "input": []},
        {"model": MODEL, "input": [3]},
        {"model": MODEL, "input": "x", "instructions": 3},
        {"model": MODEL, "input": "x", "max_output_tokens": 0},
        {"model": MODEL, "input": "x", "max_output_tokens": 1024},
    ],
)
async def test_bad_responses_requests_are_400(
    sim: SimBackend, http: aiohttp.ClientSession, body: dict[str, Any]
) -> None:
    async with http.post(sim.url + "/v1/responses", json=body) as r:
        assert r.status == 400
    assert sim.stats.requests_seen == 0


async def test_tokenize_counts_a_prompt_or_messages(
    sim: SimBackend, http: aiohttp.ClientSession
) -> None:
    async with http.post(sim.url + "/tokenize", json={"model": MODEL, "prompt": "abcdefghi"}) as r:
        answer = await r.json()
    assert (answer["count"], len(answer["tokens"]), answer["max_model_len"]) == (3, 3, 1024)
    async with http.post(sim.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}) as r:
        assert (await r.json())["count"] == MESSAGES_TOKENS
    async with http.post(sim.url + "/tokenize", json={"model": "nope", "prompt": "x"}) as r:
        assert r.status == 404
    async with http.post(sim.url + "/tokenize", json={"model": MODEL}) as r:
        assert r.status == 400
    assert sim.stats.requests_seen == 0  # no generation, no batch slot


# ------------------------------------------------------------------- the engine (issue 41)
# max_num_seqs and a KV cache, the engine's own queue behind them, preemption, priority, and
# the metrics vLLM exposes of it (its labels: engine="0" and the served model's name)

LABELS = f'engine="0",model_name="{MODEL}"'


def metric_values(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page, by series (name and labels)."""
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return {series: float(value) for series, value in samples}


async def metrics_of(sim: SimBackend, http: aiohttp.ClientSession) -> dict[str, float]:
    async with http.get(sim.url + "/metrics") as r:
        return metric_values(await r.text())


async def test_metrics_show_the_batch_and_the_engines_queue_as_vllm_does(
    http: aiohttp.ClientSession,
) -> None:
    """max_num_seqs 2 and 5 requests at once: 2 running, 3 waiting in the engine's queue
    (accepted over HTTP, not in the batch), in vLLM's series and labels."""
    async with SimBackend(slow_config(max_num_seqs=2)) as sim:
        clients = [await raw_post(sim.port, "/v1/chat/completions", chat_body(1000))
                   for _ in range(5)]  # fmt: skip
        await eventually(lambda: (sim.stats.running, sim.stats.waiting) == (2, 3))
        async with http.get(sim.url + "/metrics") as r:
            text = await r.text()
        m = metric_values(text)
        assert m[f"vllm:num_requests_running{{{LABELS}}}"] == 2
        assert m[f"vllm:num_requests_waiting{{{LABELS}}}"] == 3
        assert m[f'vllm:num_requests_waiting_by_reason{{{LABELS},reason="capacity"}}'] == 3
        assert m[f'vllm:num_requests_waiting_by_reason{{{LABELS},reason="deferred"}}'] == 0
        assert m[f"vllm:num_preemptions_total{{{LABELS}}}"] == 0
        assert m[f"vllm:prompt_tokens_total{{{LABELS}}}"] == 5 * MESSAGES_TOKENS
        assert m[f"vllm:generation_tokens_total{{{LABELS}}}"] == sim.stats.completion_tokens
        # an unlimited cache: the share of one holding every sequence at a full context
        assert 0 < m[f"vllm:kv_cache_usage_perc{{{LABELS}}}"] < 0.05
        for kind, name in (("gauge", "num_requests_running"), ("gauge", "kv_cache_usage_perc"),
                           ("counter", "num_preemptions_total")):  # fmt: skip
            assert f"# TYPE vllm:{name} {kind}" in text
        for client in clients:
            client.close()
        await eventually(lambda: (sim.stats.running, sim.stats.waiting) == (0, 0))
    assert sim.stats.aborted == 5


async def test_a_small_kv_cache_queues_and_preempts_and_every_answer_is_whole(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM 0.32 with 2,048 tokens of KV cache and 8 concurrent 500-token requests: usage up to
    1.0, up to 5 waiting, 5 preemptions. Here the same: the batch fills the cache, requests
    wait and are preempted (recomputed), the cache never overflows, and each client still
    gets its 500 tokens once, in order."""
    config = make_config(max_num_seqs=16, kv_cache_tokens=2048, max_model_len=2048)
    async with (
        SimBackend(config) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):

        async def one() -> tuple[int, str]:
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=500, stream=True
            )
            text = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return len([t for t in text if t]), "".join(text)

        seen: list[tuple[int, int, int]] = []
        jobs = asyncio.gather(*(one() for _ in range(8)))
        while not jobs.done():
            seen.append((sim.stats.running, sim.stats.waiting, sim.stats.kv_used))
            await asyncio.sleep(0.0005)
        answers = await jobs
        m = await metrics_of(sim, http)
    assert all(tokens == 500 and len(text.split()) == 500 for tokens, text in answers)
    assert max(kv for _, _, kv in seen) <= 2048
    assert max(waiting for _, waiting, _ in seen) > 0
    assert max(kv for _, _, kv in seen) > 0.9 * 2048
    assert sim.stats.preemptions > 0
    assert sum(rec.preemptions for rec in sim.stats.log) == sim.stats.preemptions
    assert m[f"vllm:num_preemptions_total{{{LABELS}}}"] == sim.stats.preemptions
    assert [rec.completion_tokens for rec in sim.stats.log] == [500] * 8


async def start_order(policy: str, priorities: tuple[int, ...]) -> list[int]:
    """Requests of these priorities queued one after the other on a held engine of one
    place, then released: their indexes in the order they entered the batch."""
    config = make_config(max_num_seqs=1, scheduling_policy=policy)
    async with (
        SimBackend(config) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        sim.hold()
        asks = []
        for i, priority in enumerate(priorities):
            asks.append(asyncio.create_task(client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"priority": priority}
            )))  # fmt: skip
            await eventually(lambda i=i: sim.stats.waiting == i + 1)
        sim.release()
        await asyncio.gather(*asks)
    log = sim.stats.log
    assert [rec.priority for rec in log] == list(priorities)
    return [rec.index for rec in sorted(log, key=lambda rec: rec.started_at or math.inf)]


async def test_priority_orders_the_engines_queue_lower_first() -> None:
    """--scheduling-policy priority: the waiting requests enter the batch by their
    ``priority``, lower first, then in arrival order."""
    assert await start_order("priority", (5, 3, 4, 3)) == [1, 3, 2, 0]


async def test_fcfs_accepts_a_priority_and_ignores_it() -> None:
    """As vLLM 0.32: without the priority policy the field is checked, then ignored."""
    assert await start_order("fcfs", (5, 3, 4, -3)) == [0, 1, 2, 3]


async def test_a_smaller_priority_preempts_a_running_larger_one_whose_stream_goes_on() -> None:
    """With the batch full, a request of a smaller priority value takes the place of the
    running one of the largest; that one waits, prefills again what it had, and its client
    gets the rest of its answer: every token once, in order."""
    async with (
        SimBackend(slow_config(max_num_seqs=1, scheduling_policy="priority")) as sim,
        openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=30, stream=True, extra_body={"priority": 9}
        )
        chunks = [await anext(aiter(stream)) for _ in range(4)]  # the role, then 3 tokens
        urgent = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"priority": 1}
        )
        chunks += [chunk async for chunk in stream]
    assert urgent.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 30
    low, high = sim.stats.log
    assert (low.preemptions, high.preemptions, sim.stats.preemptions) == (1, 0, 1)
    assert low.completion_tokens == 30
    assert low.started_at is not None
    assert high.started_at is not None
    assert high.ended_at is not None
    assert low.ended_at is not None
    assert low.started_at < high.started_at < high.ended_at < low.ended_at


@pytest.mark.parametrize(
    ("priority", "says"),
    [
        ("1", "a valid integer"),
        (1.5, "a valid integer"),
        (True, "a valid integer"),
        (None, "a valid integer"),
        (2**63, "less than or equal to 9223372036854775807"),
        (-(2**63) - 1, "greater than or equal to -9223372036854775808"),
    ],
)
async def test_a_bad_priority_is_400_as_vllm_says_it(
    sim: SimBackend, http: aiohttp.ClientSession, priority: object, says: str
) -> None:
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(priority=priority)) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["type"] == "BadRequestError"
    assert error["message"] == f"priority: Input should be {says}"
    assert sim.stats.requests_seen == 0
    for extreme in (2**63 - 1, -(2**63)):
        body = chat_body(priority=extreme)
        async with http.post(sim.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200


async def test_sequences_that_could_outgrow_the_kv_cache_are_400(
    http: aiohttp.ClientSession,
) -> None:
    config = make_config(kv_cache_tokens=1024, max_model_len=1024)
    async with SimBackend(config) as sim:
        async with http.post(sim.url + "/v1/chat/completions", json=chat_body(600, n=2)) as r:
            assert r.status == 400
            assert "KV cache" in (await r.json())["error"]["message"]
        async with http.post(sim.url + "/v1/chat/completions", json=chat_body(500, n=2)) as r:
            assert r.status == 200
    assert sim.stats.requests_seen == 1


def test_the_engine_options_are_checked_and_read_from_the_command_line() -> None:
    with pytest.raises(ValueError, match="kv_cache_tokens must hold one request"):
        make_config(kv_cache_tokens=1000, max_model_len=1024)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_config(scheduling_policy="sjf")
    engine = make_config(kv_cache_tokens=4096, scheduling_policy="priority").engine
    assert (engine.max_num_seqs, engine.kv_cache_tokens, engine.scheduling_policy) == (
        4, 4096, "priority",
    )  # fmt: skip
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["sim-backend", "--kv-cache-tokens", "2048", "--scheduling-policy", "priority"]
    )
    assert (args.kv_cache_tokens, args.scheduling_policy) == (2048, "priority")
    defaults = parser.parse_args(["sim-backend"])
    assert (defaults.kv_cache_tokens, defaults.scheduling_policy) == (None, "fcfs")
    with pytest.raises(SystemExit):
        parser.parse_args(["sim-backend", "--scheduling-policy", "sjf"])
