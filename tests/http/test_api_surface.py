"""The API surface through the real proxy (docs/design.md §6, §8): the Responses API, a
model by id, a pool's extra paths, keys in ``api-key``/``x-api-key``, unknown routes, 429s
that name their limit with OpenAI's ``x-ratelimit-*`` headers, and W3C trace context."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy
from provider_double import RATE_LIMIT_HEADERS, ProviderDouble
from proxy_lab import (
    KEYS,
    MODEL,
    AccessLines,
    Lab,
    Served,
    config_yaml,
    eventually,
    proxy_config,
)

from sfq_proxy.config import load_config
from sfq_proxy.core.throttle import duration
from sfq_proxy.runner.server import bound_url, running

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
RERANKER = "bge-reranker"
A = {"org": "A", "class": "batch", "pool": "sim"}


def metric(served: Served, name: str, **labels: str) -> float:
    return served.state.metrics.registry.get_sample_value(name, {**A, **labels}) or 0.0


# -- a backend that records what it is sent and answers as scripted ---------------------------


@dataclass(frozen=True)
class Received:
    path: str
    headers: CIMultiDictProxy[str]
    body: bytes


@dataclass
class Scripted:
    """Answers ``GET /health``, and each POSTed path with the bytes scripted for it (an
    event stream when they are a list of chunks, written one by one)."""

    answers: dict[str, bytes | list[bytes]]
    received: list[Received] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/{path:.*}", self._answer)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(Received(request.path, request.headers.copy(), body))  # type: ignore[arg-type]
        answer = self.answers.get(request.path)
        if answer is None:
            return web.json_response({"error": {"message": "no such path"}}, status=404)
        if isinstance(answer, bytes):
            return web.Response(body=answer, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in answer:
            await response.write(chunk)
        await response.write_eof()
        return response


async def scripted(lab: Lab, **answers: bytes | list[bytes]) -> tuple[Scripted, str]:
    backend = Scripted({"/" + path.replace("__", "/"): a for path, a in answers.items()})
    port = await lab.serve(backend.app())
    return backend, f"http://127.0.0.1:{port}"


def event(kind: str, data: dict[str, Any], nl: bytes = b"\n") -> bytes:
    payload = json.dumps({**data, "type": kind}, separators=(",", ":")).encode()
    return b"event: " + kind.encode() + nl + b"data: " + payload + nl + nl


# -- the Responses API ------------------------------------------------------------------------


async def test_responses_answered_through_the_proxy_and_priced_like_a_chat(
    lab: Lab, access_log: AccessLines
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    client = lab.client(served)
    raw = await client.responses.with_raw_response.create(
        model=MODEL, instructions="Be brief.", input="Say something fair.", max_output_tokens=6
    )
    answer = raw.parse()
    assert (answer.object, answer.status, answer.model) == ("response", "incomplete", MODEL)
    assert len(answer.output_text.split()) == 6
    assert answer.usage is not None
    assert answer.usage.output_tokens == 6
    # 9 + 19 characters of instructions and input at 4 a token (ceil), plus 6 of output
    assert float(raw.headers["X-Cost-Charged"]) == math.ceil(28 / 4) + 6

    whole = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}])
    assert whole.usage is not None
    assert sim.stats.log[-1].asked == {"max_output_tokens": 512}  # the charged default, sent
    assert whole.usage.output_tokens == 512  # not the sim's own default: what was charged

    [first, second] = await access_log()
    assert (first["status"], first["outcome"], first["completion_tokens"]) == (200, "completed", 6)
    assert first["prompt_tokens"] == answer.usage.input_tokens
    assert second["completion_tokens"] == 512
    assert metric(served, "sfq_completion_tokens_total") == 6 + 512
    assert metric(served, "sfq_cost_actual_total") > 0


async def test_a_responses_stream_through_the_sdk_and_its_usage_counted(
    lab: Lab, access_log: AccessLines
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    stream = await lab.client(served).responses.create(
        model=MODEL, input="Stream, please.", max_output_tokens=5, stream=True
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 5
    assert kinds[-1] == "response.completed"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None
    assert final.usage.output_tokens == 5
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "stream_options" not in sim.stats.log[0].asked  # nothing added to its body
    [line] = await access_log()
    assert (line["outcome"], line["completion_tokens"]) == ("completed", 5)
    assert line["prompt_tokens"] == final.usage.input_tokens
    assert metric(served, "sfq_time_to_first_token_seconds_count") == 1


@pytest.mark.parametrize("nl", [b"\n", b"\r\n"])
async def test_a_responses_stream_is_relayed_byte_for_byte(
    lab: Lab, access_log: AccessLines, nl: bytes
) -> None:
    usage = {"input_tokens": 11, "output_tokens": 2, "total_tokens": 13}
    chunks = [
        event("response.created", {"response": {"status": "in_progress", "usage": None}}, nl),
        event("response.output_text.delta", {"delta": "Hi"}, nl)[:20],  # cut mid-event
        event("response.output_text.delta", {"delta": "Hi"}, nl)[20:]
        + event("response.output_text.delta", {"delta": " there"}, nl),
        b": a comment" + nl + nl,
        event("response.completed", {"response": {"status": "completed", "usage": usage}}, nl),
    ]
    backend, url = await scripted(lab, v1__responses=chunks)
    served = await lab.proxy(proxy_config([url]))
    http = await lab.http()
    body = {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 9}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}/v1/responses", json=body, headers=headers) as r:
        assert r.status == 200
        got = await r.read()
    assert got == b"".join(chunks)
    assert json.loads(backend.received[0].body) == body  # sent as it came
    [line] = await access_log()
    assert (line["prompt_tokens"], line["completion_tokens"], line["outcome"]) == (
        11,
        2,
        "completed",
    )


async def test_a_responses_stream_that_fails_is_no_completion(
    lab: Lab, access_log: AccessLines
) -> None:
    failed = {"response": {"status": "failed", "error": {"code": "server_error"}, "usage": None}}
    chunks = [event("response.created", {"response": {}}), event("response.failed", failed)]
    _, url = await scripted(lab, v1__responses=chunks)
    served = await lab.proxy(proxy_config([url]))
    http = await lab.http()
    body = {"model": MODEL, "input": "hi", "stream": True}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}/v1/responses", json=body, headers=headers) as r:
        assert (r.status, await r.read()) == (200, b"".join(chunks))
    [line] = await access_log()
    assert (line["outcome"], line["reason"]) == ("failed", "error_event")


# -- a model by id ----------------------------------------------------------------------------


async def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_model_not_found(lab: Lab) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url], pool={"models": [MODEL, "org/with-slash"]}))
    client = lab.client(served)
    model = await client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "sim")
    assert (await client.models.retrieve("org/with-slash")).id == "org/with-slash"
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.models.retrieve("gpt-17")
    assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert unknown.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    nobody = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await nobody.models.retrieve(MODEL)
    await nobody.close()


# -- extra paths ------------------------------------------------------------------------------


def two_pools(sim_url: str, rerank_url: str, **options: Any) -> Any:
    config = proxy_config(
        [sim_url],
        pool={"extra_paths": [{"path": "/tokenize", "cost": {"input_fields": ["prompt"]}}]},
        **options,
    )
    pools = {name: spec.model_dump() for name, spec in config.pools.items()}
    pools["rerank"] = {
        "models": [RERANKER],
        "backends": [{"url": rerank_url, "slots": 1}],
        "extra_paths": [{"path": "/v1/rerank", "cost": {"fixed": 50}}],
    }
    return proxy_config([sim_url], pools=pools, **options)


RERANKED = json.dumps({"id": "rerank-1", "results": [{"index": 0, "relevance_score": 0.9}],
                       "usage": {"total_tokens": 9}}).encode()  # fmt: skip


async def test_extra_paths_are_relayed_at_their_cost_through_the_fair_queue(
    lab: Lab, access_log: AccessLines
) -> None:
    sim = await lab.backend()
    reranker, url = await scripted(lab, v1__rerank=RERANKED)
    served = await lab.proxy(two_pools(sim.url, url))
    http = await lab.http()
    headers = {"Authorization": f"Bearer {KEYS['A']}", "Content-Type": "application/json"}

    sent = b'{"model": "bge-reranker", "query": "fair?", "documents": ["a", "b"]}'
    async with http.post(f"{served.url}/v1/rerank", data=sent, headers=headers) as r:
        assert (r.status, await r.read()) == (200, RERANKED)
        assert r.headers["X-Cost-Charged"] == "50"  # its fixed cost
    assert [(x.path, x.body) for x in reranker.received] == [("/v1/rerank", sent)]

    prompt = {"model": MODEL, "prompt": "x" * 40}
    async with http.post(f"{served.url}/tokenize", json=prompt, headers=headers) as r:
        assert r.status == 200
        assert (await r.json())["count"] == 10  # the sim's own answer
        assert r.headers["X-Cost-Charged"] == "10"  # its prompt's 40 characters

    # the model decides the pool, as on every route: the sim's pool does not serve rerank
    async with http.post(f"{served.url}/v1/rerank", json=prompt, headers=headers) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
    async with http.get(f"{served.url}/v1/rerank", headers=headers) as r:
        assert (r.status, r.headers["Allow"]) == (405, "POST")
    async with http.post(f"{served.url}/v1/rerank", data=b"{", headers=headers) as r:
        assert r.status == 400
    async with http.post(f"{served.url}/v1/rerank", json={"model": RERANKER}) as r:
        assert r.status == 401  # a key, as everywhere

    flows = [d["flow"] for d in served.state.state()["rerank"]["recent_dispatches"]]
    assert flows == ["A/batch"]  # dispatched by the pool's scheduler
    lines = await access_log()
    assert [(x["pool"], x["status"], x["cost"]) for x in lines[:2]] == [
        ("rerank", 200, 50.0),
        ("sim", 200, 10.0),
    ]


async def test_an_extra_path_waits_its_flows_turn_and_counts_against_its_orgs_tpm(
    lab: Lab,
) -> None:
    sim = await lab.backend(max_num_seqs=1)
    reranker, url = await scripted(lab, v1__rerank=RERANKED)
    served = await lab.proxy(two_pools(sim.url, url, orgs={"A": {"tpm": 120}}))
    http = await lab.http()
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    body = {"model": RERANKER, "query": "q", "documents": ["d"]}
    answers = []
    for _ in range(3):  # 50 tokens each: the third overdraws 120 a minute
        async with http.post(f"{served.url}/v1/rerank", json=body, headers=headers) as r:
            answers.append((r.status, int(r.headers["x-ratelimit-remaining-tokens"])))
            if r.status == 429:
                assert (await r.json())["error"]["code"] == "tpm"
    assert [status for status, _ in answers] == [200, 200, 429]
    left = [remaining for _, remaining in answers]  # 2 tokens come back a second
    assert 70 <= left[0] < 120
    assert 20 <= left[1] < left[0]
    assert left[1] <= left[2] < 50
    assert len(reranker.received) == 2


async def test_a_reload_changes_a_pools_extra_paths(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = await lab.backend()
    monkeypatch.setenv("ADMIN_KEY", "sk-admin-extra")
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml([sim.url], admin_key_env="ADMIN_KEY"))
    http = await lab.http()
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    prompt = {"model": MODEL, "prompt": "x" * 8}
    async with running(load_config(path), config_path=path) as runner:
        url = bound_url(runner)
        async with http.post(f"{url}/tokenize", json=prompt, headers=headers) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (404, "not_found")
        extra = [{"path": "/tokenize", "cost": {"fixed": 3, "input_fields": ["prompt"]}}]
        path.write_text(
            config_yaml([sim.url], admin_key_env="ADMIN_KEY", pool={"extra_paths": extra})
        )
        admin = {"Authorization": "Bearer sk-admin-extra"}
        async with http.post(f"{url}/admin/reload", headers=admin) as r:
            assert r.status == 200
        async with http.post(f"{url}/tokenize", json=prompt, headers=headers) as r:
            assert (r.status, (await r.json())["count"]) == (200, 2)
            assert r.headers["X-Cost-Charged"] == "5"  # 3 fixed, 8 characters at 4 a token


# -- keys in other headers, and what reaches the backend ----------------------------------------


async def test_api_key_and_x_api_key_are_keys_and_never_go_upstream(lab: Lab) -> None:
    provider = ProviderDouble(key=None)
    port = await lab.serve(provider.app())
    served = await lab.proxy(
        proxy_config([f"http://127.0.0.1:{port}/v1"], pool={"family": "openai"})
    )
    azure_style = {"Authorization": openai.Omit(), "api-key": KEYS["B"]}  # the key alone
    chat = await lab.client(served, "A").chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        extra_headers=azure_style,
    )
    assert chat.choices[0].message.content
    http = await lab.http()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    async with http.post(
        f"{served.url}/v1/chat/completions", json=body, headers={"x-api-key": KEYS["C"]}
    ) as r:
        assert r.status == 200
    async with http.get(f"{served.url}/v1/models/{MODEL}", headers={"x-api-key": KEYS["C"]}) as r:
        assert r.status == 200
    async with http.post(
        f"{served.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer sk-wrong", "api-key": KEYS["B"]},
    ) as r:
        assert r.status == 401  # Authorization first, and it decides
    flows = [d["flow"] for d in served.state.state()["sim"]["recent_dispatches"]]
    assert flows == ["B/batch", "C/interactive"]
    for received in provider.chats():
        for name in ("Authorization", "api-key", "x-api-key"):
            assert name not in received.headers


# -- W3C trace context ------------------------------------------------------------------------


async def test_a_valid_traceparent_goes_upstream_and_into_the_access_log(
    lab: Lab, access_log: AccessLines
) -> None:
    provider = ProviderDouble(key=None)
    port = await lab.serve(provider.app())
    served = await lab.proxy(
        proxy_config([f"http://127.0.0.1:{port}/v1"], pool={"family": "openai"})
    )
    client = lab.client(served)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    await client.chat.completions.create(
        **chat, extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=opaque"}
    )
    await client.chat.completions.create(
        **chat, extra_headers={"traceparent": TRACEPARENT.upper(), "tracestate": "vendor=x"}
    )
    with pytest.raises(openai.AuthenticationError):  # logged with its trace id all the same
        await client.chat.completions.create(
            **chat, extra_headers={"traceparent": TRACEPARENT, "Authorization": "Bearer sk-nope"}
        )
    valid, invalid = provider.chats()
    assert (valid.headers["traceparent"], valid.headers["tracestate"]) == (
        TRACEPARENT,
        "vendor=opaque",
    )
    assert "traceparent" not in invalid.headers
    assert "tracestate" not in invalid.headers
    lines = await access_log()
    assert [line["trace_id"] for line in lines] == [TRACE, None, TRACE]


# -- 429s that name their limit, and x-ratelimit-* --------------------------------------------


async def test_answers_carry_the_orgs_limits_and_a_429_names_the_one_that_refused(
    lab: Lab,
) -> None:
    provider = ProviderDouble(key=None)
    port = await lab.serve(provider.app())
    config = proxy_config(
        [f"http://127.0.0.1:{port}/v1"], pool={"family": "openai"}, orgs={"A": {"rpm": 2}}
    )
    served = await lab.proxy(config)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}

    first = await lab.client(served, "A").chat.completions.with_raw_response.create(**chat)
    limits = {k: v for k, v in first.headers.items() if k.startswith("x-ratelimit-")}
    # the org's, and only those it has: the provider's (its key, every tenant's) left out
    assert set(limits) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }
    assert (limits["x-ratelimit-limit-requests"], limits["x-ratelimit-remaining-requests"]) == (
        "2",
        "1",
    )
    reset = duration(limits["x-ratelimit-reset-requests"])  # written as OpenAI does
    assert reset is not None
    assert 0 < reset <= 30
    await lab.client(served, "A").chat.completions.create(**chat)
    with pytest.raises(openai.RateLimitError) as refused:
        await lab.client(served, "A").chat.completions.create(**chat)
    error, headers = refused.value.body, refused.value.response.headers
    assert (error["code"], error["type"]) == ("rpm", "rate_limit_error")  # type: ignore[index]
    assert "org 'A' allows 2 requests per minute (rpm)" in error["message"]  # type: ignore[index]
    assert headers["x-ratelimit-remaining-requests"] == "0"
    wait = duration(headers["x-ratelimit-reset-requests"])
    assert wait is not None
    assert 30 < wait <= 60
    assert int(headers["Retry-After"]) == math.ceil(float(headers["Retry-After"]))
    assert len(provider.chats()) == 2

    # an org without limits gets the provider's headers as they came
    other = await lab.client(served, "B").chat.completions.with_raw_response.create(**chat)
    assert {k: v for k, v in other.headers.items() if k in RATE_LIMIT_HEADERS} == RATE_LIMIT_HEADERS


async def test_queue_full_and_queue_age_name_their_limits(lab: Lab) -> None:
    sim = await lab.backend(max_num_seqs=1)
    classes = {
        "system": {"priority": True, "max_in_flight": 1, "max_queue_age_s": 30, "max_queue_len": 1},
        "interactive": {"weight": 6, "max_queue_age_s": 0.3},
        "batch": {"max_queue_len": 1},
    }
    served = await lab.proxy(proxy_config([sim.url], slots=1, classes=classes))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    blocker = await lab.client(served, "B").chat.completions.create(
        **{**chat, "max_tokens": 4000}, stream=True
    )
    queued = asyncio.create_task(lab.client(served, "A").chat.completions.create(**chat))
    await eventually(lambda: served.queue().backlog("A/batch") == 1)
    with pytest.raises(openai.RateLimitError) as full:
        await lab.client(served, "A").chat.completions.create(**chat)
    assert full.value.body["code"] == "queue_full"  # type: ignore[index]
    assert "max_queue_len" in full.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.RateLimitError) as aged:
        await lab.client(served, "C").chat.completions.create(**chat)
    assert aged.value.body["code"] == "queue_age"  # type: ignore[index]
    assert "max_queue_age_s" in aged.value.body["message"]  # type: ignore[index]
    await blocker.close()
    await queued


# -- unknown routes ---------------------------------------------------------------------------


async def test_an_unknown_route_is_not_found_and_a_known_one_405_with_allow(lab: Lab) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    client = lab.client(served)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.post("/assistants", cast_to=object, body={})
    assert missing.value.body["code"] == "not_found"  # type: ignore[index]
    http = await lab.http()
    async with http.get(f"{served.url}/v1/responses") as r:
        assert (r.status, r.headers["Allow"]) == (405, "POST")
        assert (await r.json())["error"]["code"] == "method_not_allowed"
    async with http.delete(f"{served.url}/v1/models") as r:
        assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD")
