"""Calibration through the real proxy: usage seen for every request, estimates that learn."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from proxy_lab import (
    KEYS,
    MODEL,
    AccessLines,
    Lab,
    Served,
    dispatched_behind,
    eventually,
    proxy_config,
)

from sfq_proxy.http.proxy import PROXY
from sfq_proxy.lab.scenario import Request, load_scenario
from sfq_proxy.runner.server import bound_url, running
from sfq_proxy.sim.api import MESSAGE_OVERHEAD_TOKENS

AZURE = Path(__file__).resolve().parents[2] / "config" / "scenarios" / "azure-conv.yaml"

CHAT = [{"role": "user", "content": "Tell me about fair queueing."}]


async def _events(lab: Lab, url: str, key: str | None, body: dict) -> list[bytes]:
    """The raw SSE events of a streamed answer, with the one volatile field blanked."""
    http = await lab.http()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        raw = await r.read()
    return [re.sub(rb'"created":\d+', b'"created":0', e) for e in raw.split(b"\n\n") if e]


async def test_stream_usage_is_asked_for_and_stripped_unless_the_client_wanted_it(
    lab: Lab,
) -> None:
    direct, behind = await lab.backend(seed=5), await lab.backend(seed=5)
    served = await lab.proxy(proxy_config([behind.url]))
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "stream": True}
    # both servers see their first request, so they generate the same answer
    expected = await _events(lab, direct.url, None, body)
    got = await _events(lab, served.url, KEYS["A"], body)
    assert got == expected  # byte for byte: no usage chunk the client did not ask for
    assert not any(b'"usage"' in event for event in got)
    labels = {"org": "A", "class": "batch", "pool": "sim"}
    registry = served.state.metrics.registry
    assert registry.get_sample_value("sfq_completion_tokens_total", labels) == 6
    assert (
        registry.get_sample_value("sfq_prompt_tokens_total", labels) == behind.stats.prompt_tokens
    )

    asked = {**body, "stream_options": {"include_usage": True}}
    events = await _events(lab, served.url, KEYS["A"], asked)
    usage = json.loads(events[-2].removeprefix(b"data: "))
    assert (usage["choices"], usage["usage"]["completion_tokens"]) == ([], 6)
    assert registry.get_sample_value("sfq_completion_tokens_total", labels) == 12


def mape(charged: list[float], actual: list[float]) -> float:
    return sum(abs(c - a) / a for c, a in zip(charged, actual, strict=True)) / len(actual)


async def test_calibration_brings_charges_close_to_actual_cost_on_the_azure_trace(
    lab: Lab, access_log: AccessLines
) -> None:
    trace = load_scenario(AZURE).requests[:1500]  # max_tokens = 4 × the real output
    sim = await lab.backend(output_mode="min_tokens", max_num_seqs=64, time_scale=1000,
                            max_model_len=1 << 20)  # fmt: skip
    config = proxy_config(
        [sim.url], slots=64, pool={"cost": {"input_weight": 1, "output_weight": 2}},
        calibration={"half_life_requests": 200, "min_org_samples": 20},
    )  # fmt: skip
    served = await lab.proxy(config)
    http, gate = await lab.http(), asyncio.Semaphore(32)
    headers = {"Authorization": f"Bearer {KEYS['A']}"}

    async def send(request: Request) -> None:
        body = {"model": MODEL, "prompt": "x" * (4 * request.input_tokens),
                "max_tokens": request.max_tokens, "min_tokens": request.output_tokens}  # fmt: skip
        async with gate, http.post(f"{served.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()

    for start in range(0, len(trace), 100):  # in order, so later requests see what was learned
        await asyncio.gather(*(send(r) for r in trace[start : start + 100]))
    lines = await access_log()
    assert len(lines) == len(trace)
    actual = [line["prompt_tokens"] + 2 * line["completion_tokens"] for line in lines]
    uncalibrated = [r.input_tokens + 2 * r.max_tokens for r in trace]  # the default estimate
    before = mape(uncalibrated, actual)
    after = mape([line["cost"] for line in lines[750:]], actual[750:])
    print(f"charged vs actual cost, MAPE: uncalibrated {before:.1%}, calibrated {after:.1%}")
    assert after <= 0.25 < before
    pool = served.state.pools["sim"].state()["calibration"]
    assert pool["output_ratio"]["value"] == pytest.approx(0.25, abs=0.01)
    # one prompt string of exactly 4 chars/token: no template tokens, whatever its length
    assert pool["input"]["chars_per_token"] == pytest.approx(4.0, abs=0.01)
    assert pool["input"]["tokens_per_message"] == pytest.approx(0.0, abs=0.01)


async def test_calibration_learns_the_chat_templates_tokens_apart_from_chars_per_token(
    lab: Lab,
) -> None:
    """Short chats to the simulated server, whose template adds MESSAGE_OVERHEAD_TOKENS a
    message: the pool learns that apart from the text's 4 chars/token (as a ratio, these
    chats would have sunk chars/token to its floor), and shows both in its state and
    metrics. A long single message is then priced at its real count."""
    sim = await lab.backend()
    calibration = {"half_life_requests": 1000, "min_org_samples": 10}
    served = await lab.proxy(proxy_config([sim.url], calibration=calibration))
    client, rng = lab.client(served, "A"), random.Random(16)
    for _ in range(30):  # 4 to 40 characters a message: exactly 1 to 10 tokens
        count = rng.randint(1, 6)
        chat = [{"role": "user", "content": "x" * 4 * rng.randint(1, 10)} for _ in range(count)]
        await client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)

    def learned() -> dict:
        return served.state.pools["sim"].state()["calibration"]["input"]

    await eventually(lambda: learned()["samples"] == 30)
    assert learned()["tokens_per_message"] == pytest.approx(MESSAGE_OVERHEAD_TOKENS, abs=1e-6)
    assert learned()["chars_per_token"] == pytest.approx(4.0, rel=1e-6)
    registry = served.state.metrics.registry
    expected = {"tokens_per_message": MESSAGE_OVERHEAD_TOKENS, "chars_per_token": 4}
    for quantity, value in expected.items():
        labels = {"pool": "sim", "org": "", "quantity": quantity}
        assert registry.get_sample_value("sfq_calibration", labels) == pytest.approx(value)
        assert registry.get_sample_value("sfq_calibration_samples", labels) == 30
    model = served.state.pools["sim"].cost.input_model()
    assert model.tokens(1, 3996) == pytest.approx(MESSAGE_OVERHEAD_TOKENS + 999, rel=1e-6)


async def _contended_dispatches(lab: Lab, served: Served, per_org: int) -> Counter[str]:
    """A and B (same real output, B asking 8× more max_tokens) queue behind one slot; how
    many of ``per_org`` dispatches after the blocker went to each (from the second on: the
    first is decided by the tie of two flows joining at the same meter)."""
    blocker = await lab.client(served, "C").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2000, stream=True
    )
    flood = [_ask(lab, served, org) for _ in range(per_org) for org in "AB"]
    order = await dispatched_behind(served, blocker, flood)
    return Counter(order[1 : 1 + per_org])


async def _ask(lab: Lab, served: Served, org: str) -> None:
    max_tokens = {"A": 80, "B": 640}[org]  # both really generate 40
    await lab.client(served, org).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=max_tokens, extra_body={"min_tokens": 40}
    )


async def test_an_org_is_not_punished_for_its_max_tokens_before_or_after_calibration(
    lab: Lab,
) -> None:
    """B asks 8× A's max_tokens for the same real output. Before calibration B's estimate is
    8× A's, yet each of its requests is trued up to the 40 tokens it got at its end
    (docs/design.md §3 rule 3), so it is not served less (estimate-only, it got under a
    third of A's dispatches); calibrated, its estimate is right to begin with."""
    calibration = {"half_life_requests": 50, "min_org_samples": 20}
    fresh_sim = await lab.backend(output_mode="min_tokens", max_num_seqs=1)
    fresh = await lab.proxy(proxy_config([fresh_sim.url], slots=1, calibration=calibration))
    uncalibrated = await _contended_dispatches(lab, fresh, per_org=40)
    assert abs(uncalibrated["A"] - uncalibrated["B"]) <= 0.2 * max(uncalibrated.values())

    sim = await lab.backend(output_mode="min_tokens", max_num_seqs=1)
    served = await lab.proxy(proxy_config([sim.url], slots=1, calibration=calibration))
    for _ in range(25):  # each org's own ratio is learned from 20+ completed requests
        await asyncio.gather(_ask(lab, served, "A"), _ask(lab, served, "B"))
    calibrated = await _contended_dispatches(lab, served, per_org=40)
    # the same real output per request, so served actual tokens ∝ dispatches
    assert abs(calibrated["A"] - calibrated["B"]) <= 0.2 * max(calibrated.values()), calibrated


async def test_calibration_survives_a_restart_and_a_corrupt_file_does_not_stop_the_proxy(
    lab: Lab, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await lab.backend(output_mode="min_tokens")
    state_file = tmp_path / "calibration.json"
    config = proxy_config(
        [sim.url], calibration={"state_file": str(state_file), "min_org_samples": 1}
    )
    async with running(config) as runner:
        first = Served(bound_url(runner), runner.app[PROXY])
        for _ in range(3):
            await _ask(lab, first, "A")
        learned = first.state.pools["sim"].state()["calibration"]
    assert learned["orgs"]["A"]["samples"] == 3
    assert json.loads(state_file.read_text())  # saved at shutdown
    async with running(config) as runner:
        assert runner.app[PROXY].pools["sim"].state()["calibration"] == learned

    state_file.write_text("{not json")
    caplog.set_level(logging.WARNING, logger="sfq_proxy.state.calibration_file")
    async with running(config) as runner:
        again = Served(bound_url(runner), runner.app[PROXY])
        await _ask(lab, again, "A")  # serves, from the defaults
        assert again.state.pools["sim"].state()["calibration"]["orgs"]["A"]["samples"] == 1
    assert any("corrupt" in rec.getMessage() for rec in caplog.records)
