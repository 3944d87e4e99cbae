"""Large bodies parsed in the worker process (http/parse_worker.py; docs/design.md §6,
Parsing off the loop): the same request, or the same refusal, as the loop would make of
them; the worker started again when it died; and a fair line to it."""

from __future__ import annotations

import asyncio
import json
import os
from functools import partial
from typing import Any

import pytest
from proxy_lab import KEYS, MODEL, Lab, proxy_config

from sfq_proxy.config import Config
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.inference_request import InferenceRequest, Kind, parse, parse_extra
from sfq_proxy.http import parse_worker
from sfq_proxy.http.handler import _extra_cost
from sfq_proxy.http.parse_worker import WORKER, _Line

RERANK = "/v1/rerank"
TEXT = "word " * 5000  # 25 kB: above the 16 KiB parsed on the loop
AFFINITY_POOL = {"affinity": {"prefix_chars": 64, "use_user_field": True}}


def _config(**options: Any) -> Config:
    extra = [{"path": RERANK, "cost": {"fixed": 3, "input_fields": ["query", "documents"]}}]
    pool = {**AFFINITY_POOL, "extra_paths": extra}
    return proxy_config(["http://127.0.0.1:9"], pool=pool, **options)


def _here(config: Config, kind: Kind, raw: bytes, path: str) -> InferenceRequest:
    """What the loop makes of ``raw`` (as the handler calls the parser)."""
    if kind is Kind.EXTRA:
        return parse_extra(raw, path, partial(_extra_cost, config, path))
    usage, affinity = config.reports_stream_usage, config.affinity_for_model
    return parse(kind, raw, usage, affinity, config.limits)


BODIES = [
    (Kind.CHAT, {"messages": [{"role": "user", "content": TEXT}], "user": "u1"}),
    (Kind.CHAT, {"messages": [{"role": "user", "content": TEXT}], "stream": True}),
    (
        Kind.CHAT,
        {
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": TEXT},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                ]},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_tokens": 7,
            "n": 2,
        },
    ),
    (Kind.RESPONSES, {"input": [{"role": "user", "content": TEXT}], "instructions": "Be."}),
    (Kind.COMPLETION, {"prompt": [TEXT, TEXT], "stream": True}),
    (Kind.EMBEDDING, {"input": [TEXT]}),
    (Kind.EXTRA, {"query": TEXT, "documents": ["a", "b"]}),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "fields"), BODIES)
async def test_a_large_body_is_parsed_in_the_worker_as_on_the_loop(
    kind: Kind, fields: dict[str, Any]
) -> None:
    config = _config()
    raw = json.dumps({"model": MODEL, **fields}).encode()
    path = RERANK if kind is Kind.EXTRA else kind.value
    assert len(raw) > config.limits.parse_in_loop_bytes
    there = await WORKER.parse(config, "A", kind, raw, path)
    assert there == _here(config, kind, raw, path)
    if there.raw == raw:  # sent back as the very bytes the proxy holds, not a copy
        assert there.raw is raw


@pytest.mark.parametrize(
    ("kind", "raw", "status", "says"),
    [
        (Kind.CHAT, {"messages": [{"content": "x"}] * 2001}, 400, "(limits.max_messages)"),
        (Kind.CHAT, {"messages": [{"content": TEXT}], "max_tokens": 0}, 400, "'max_tokens'"),
        (Kind.CHAT, b'{"messages": "\\ud800' + b" " * 20000 + b'"}', 400, "surrogate"),
        (Kind.EXTRA, {"query": TEXT, "model": "elsewhere"}, 404, "not served at /v1/rerank"),
    ],
)
async def test_a_large_bodys_refusal_is_the_one_the_loop_makes(
    kind: Kind, raw: dict[str, Any] | bytes, status: int, says: str
) -> None:
    config = _config()
    body = raw if isinstance(raw, bytes) else json.dumps({"model": MODEL, **raw}).encode()
    path = RERANK if kind is Kind.EXTRA else kind.value
    with pytest.raises(ApiError) as there:
        await WORKER.parse(config, "A", kind, body, path)
    with pytest.raises(ApiError) as here:
        _here(config, kind, body, path)
    assert (there.value.status, there.value.message, there.value.code) == (
        here.value.status, here.value.message, here.value.code,
    )  # fmt: skip
    assert there.value.status == status
    assert says in there.value.message


async def test_the_caps_of_a_reloaded_config_apply_in_the_worker() -> None:
    raw = json.dumps({"model": MODEL, "messages": [{"content": TEXT}] * 3}).encode()
    assert (await WORKER.parse(_config(), "A", Kind.CHAT, raw, "/")).messages == 3
    tight = _config(limits={"max_messages": 2})
    with pytest.raises(ApiError, match=r"at most 2 are accepted \(limits.max_messages\)"):
        await WORKER.parse(tight, "A", Kind.CHAT, raw, "/")


async def test_a_worker_that_died_is_started_again() -> None:
    config = _config()
    raw = json.dumps({"model": MODEL, "messages": [{"content": TEXT}]}).encode()
    await WORKER.parse(config, "A", Kind.CHAT, raw, "/")
    popen = WORKER._process._popen
    assert popen is not None
    popen.kill()
    popen.wait()
    assert (await WORKER.parse(config, "A", Kind.CHAT, raw, "/")).text == TEXT
    assert WORKER._process._popen is not popen


async def test_a_proxy_parsing_every_body_in_the_worker_serves_them(lab: Lab) -> None:
    """With ``parse_in_loop_bytes: 0`` every body goes to the worker: a chat and a stream
    are served, the stream with its usage asked for, and a refusal is the proxy's 400."""
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url], limits={"parse_in_loop_bytes": 0}))
    client = lab.client(served)
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 3
    chunks = [
        c async for c in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    ]  # fmt: skip
    assert chunks[-1].usage is None  # asked for by the proxy, stripped for a client that did not
    http = await lab.http()
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    body = {"model": MODEL, "messages": [{"content": "x"}] * 2001}
    async with http.post(f"{served.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 400
        assert "(limits.max_messages)" in (await r.json())["error"]["message"]


# -- the line to the worker ------------------------------------------------------------------


async def _served_in_order(line: _Line, first: str, orgs: list[str]) -> list[str]:
    """The order in which bodies of ``orgs``, arriving in that order while the worker has
    one of ``first``, get it."""
    order: list[str] = []

    async def one(org: str) -> None:
        await line.turn(org)
        order.append(org)
        await asyncio.sleep(0)
        line.done()

    await line.turn(first)
    tasks = []
    for org in orgs:
        tasks.append(asyncio.create_task(one(org)))
        await asyncio.sleep(0)  # each arrives after the one before, and waits
    assert not order
    line.done()
    await asyncio.gather(*tasks)
    return order


async def test_orgs_take_turns_and_another_org_waits_for_one_body_at_most() -> None:
    line = _Line(asyncio.get_running_loop())
    order = await _served_in_order(line, "A", ["A", "A", "A", "B", "C", "B"])
    assert order == ["B", "C", "A", "B", "A", "A"]
    assert await _served_in_order(line, "A", ["B", "A", "B"]) == ["B", "A", "B"]


async def test_a_body_that_leaves_the_line_gives_up_its_place_or_passes_its_turn() -> None:
    line = _Line(asyncio.get_running_loop())
    await line.turn("A")  # the worker is busy
    waiting = asyncio.create_task(line.turn("B"))
    after = asyncio.create_task(line.turn("C"))
    await asyncio.sleep(0)
    waiting.cancel()  # B leaves before its turn
    await asyncio.gather(waiting, return_exceptions=True)
    line.done()
    await after  # C's turn came: B's place was given up
    late = asyncio.create_task(line.turn("D"))
    await asyncio.sleep(0)
    line.done()  # D's turn comes...
    late.cancel()  # ...but it left meanwhile: the turn is passed on, the worker free
    await asyncio.gather(late, return_exceptions=True)
    await asyncio.wait_for(line.turn("E"), 1)


async def test_the_worker_runs_below_the_loops_priority() -> None:
    raw = json.dumps({"model": MODEL, "messages": [{"content": TEXT}]}).encode()
    await WORKER.parse(_config(), "A", Kind.CHAT, raw, "/")
    popen = WORKER._process._popen
    assert popen is not None
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, popen.pid) == min(19, ours + parse_worker.NICE)
