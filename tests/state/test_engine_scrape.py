"""Engine dispatch (docs/design.md §5, "Engine-aware dispatch") through the real proxy in
front of simulated vLLM servers, with the ``openai`` SDK: the engine's own queue stays
within the allowance where static slots fill it, stale or missing metrics fall back to
static slots without halting, and a class's engine ceiling leaves room for the classes
above it.

The engine's load is read as the proxy reads it, from the simulated vLLM's ``/metrics``,
sampled every few milliseconds while the requests run.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import openai
import pytest
from engine_lab import engine_config, sampled
from proxy_lab import MODEL, Lab, Served, eventually, leftovers, scrape

from sfq_proxy.state import engine_scrape

CHAT = [{"role": "user", "content": "hi"}]


async def flood(lab: Lab, served: Served, orgs: str, per_org: int, tokens: int) -> None:
    """``per_org`` chat requests of each of ``orgs`` at once (their default class)."""
    asks = [
        lab.client(served, org).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=tokens, user=org
        )
        for _ in range(per_org)
        for org in orgs
    ]
    for answer in await asyncio.gather(*asks):
        assert answer.choices[0].finish_reason == "length"


def orgs_dispatched(served: Served) -> list[str]:
    return [d.flow.split("/")[0] for d in served.state.pools["sim"].recent]


async def engine_queue(
    lab: Lab, slots: int, dispatch: dict[str, Any] | None
) -> tuple[list[tuple[int, int]], list[str]]:
    """Orgs A and B, 20 requests each at once, on one engine of 4 sequences given ``slots``:
    the engine's (running, waiting) samples, and the dispatch order. Before, 8 requests at once
    teach an engine gate the engine's capacity: with ``slots: N`` it trusts N until the
    engine shows it runs fewer (requests waiting for room; docs/design.md §5)."""
    sim = await lab.backend(max_num_seqs=4, time_scale=2.0)
    served = await lab.proxy(engine_config([sim.url], slots, dispatch=dispatch))
    await flood(lab, served, "C", 8, tokens=60)  # ~0.4 s saturated: several readings
    gate = served.state.pools["sim"].placement.backends[0].gate
    assert gate is None or gate.capacity() == 4
    served.state.pools["sim"].recent.clear()
    async with sampled(lab, sim) as samples:
        await flood(lab, served, "AB", 20, tokens=12)
    assert samples
    assert not leftovers(served)
    return samples, orgs_dispatched(served)


async def test_engine_dispatch_keeps_the_engine_queue_within_the_allowance(lab: Lab) -> None:
    """32 slots on an engine of 4: static dispatch sends 32 of the 40 requests, and the engine
    queues what it cannot run; engine dispatch holds them in the fair queue, the engine
    never holding more than the allowance (1) waiting, plus one: a completion the proxy
    credits before the engine's gauges dropped it may let one more in (the gate's
    guarantee assumes every dispatch reaches the engine within settle_s, which two shared,
    busy cores do not promise)."""
    static, _ = await engine_queue(lab, 32, None)
    gated, order = await engine_queue(lab, 32, {})
    assert max(w for _, w in static) >= 24, static  # of the 32 - 4 it can: the slots bind
    assert max(w for _, w in gated) <= 1 + 1, gated
    assert max(r for r, _ in gated) == 4  # and it runs full
    # SFQ decides who goes: of equal weight and cost, the orgs take turns while both wait
    # (never more than one apart: the bound of docs/design.md §3 for these requests)
    gaps = []
    counts: Counter[str] = Counter()
    for org in order:
        counts[org] += 1
        if counts["A"] < 20 and counts["B"] < 20:
            gaps.append(abs(counts["A"] - counts["B"]))
    assert max(gaps) <= 1, order


async def test_a_llama_server_says_its_slots_and_the_gate_skips_the_ramp(lab: Lab) -> None:
    """A llama-server (simulated: its metrics and ``/props``) tells its slots: the gate knows
    the capacity from the first reading, before the engine was ever full, and the first
    burst neither waits in the engine beyond the allowance nor leaves a slot idle while the
    ramp would."""
    sim = await lab.backend(max_num_seqs=4, time_scale=2.0, metrics_format="llama-server")
    config = engine_config([sim.url], "auto", dispatch={}, family="llama-server")
    served = await lab.proxy(config)
    gate = served.state.pools["sim"].placement.backends[0].gate
    assert gate is not None
    await eventually(lambda: gate.reported == 4)
    assert (gate.capacity(), gate.bounded(), gate.learned) == (4, True, 0)
    async with sampled(lab, sim) as samples:
        await flood(lab, served, "AB", 6, tokens=12)
    assert max(w for _, w in samples) <= 1 + 1, samples  # as in the test above
    assert max(r for r, _ in samples) == 4, samples
    assert not leftovers(served)


async def test_a_llama_server_still_starting_is_asked_its_slots_again_soon(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/props`` failing at first (a server still starting) is asked again after
    ``DISCOVERY_RETRY_S``, not after the minute a description that was read stands."""
    monkeypatch.setattr(engine_scrape, "DISCOVERY_RETRY_S", 0.3)
    sim = await lab.backend(max_num_seqs=4, metrics_format="llama-server")
    sim.faults.metrics_status = 503
    config = engine_config([sim.url], "auto", dispatch={}, family="llama-server")
    served = await lab.proxy(config)
    gate = served.state.pools["sim"].placement.backends[0].gate
    assert gate is not None
    await eventually(lambda: gate.problem == "no_metrics")
    sim.faults.metrics_status = 200
    await eventually(lambda: gate.reported == 4)


async def test_gate_metrics_and_admin_state(lab: Lab) -> None:
    """The readings, their age and the gate's capacity are in /metrics and /admin/state;
    refusals are counted by reason."""
    sim = await lab.backend(max_num_seqs=2, time_scale=2.0)
    served = await lab.proxy(engine_config([sim.url], 8, dispatch={}))
    await flood(lab, served, "AB", 6, tokens=12)
    await asyncio.sleep(0.15)  # a reading after the last completion
    samples = await scrape(lab, served)
    at = frozenset({"pool": "sim", "backend": f"127.0.0.1:{sim.port}"}.items())
    assert samples[("sfq_engine_running", at)] == 0
    assert samples[("sfq_engine_waiting", at)] == 0
    assert ("sfq_engine_kv_usage", at) in samples
    assert 0 <= samples[("sfq_engine_reading_age_seconds", at)] < 0.5
    assert samples[("sfq_engine_capacity", at)] == 2  # learned: 2 ran while requests waited
    refused = {
        dict(labels)["reason"]: value
        for (name, labels), value in samples.items()
        if name == "sfq_dispatch_gated_total"
    }
    assert refused.get("engine_queue", 0) > 0, refused
    engine = served.state.state()["sim"]["backends"][0]["engine"]
    assert engine["reading"]["running"] == 0
    assert engine["capacity"] == 2
    assert engine["fresh"]
    assert engine["problem"] is None
    assert 0 <= engine["age_s"] < 0.5


async def stale_run(lab: Lab, slots: int | str, faults: dict[str, Any]) -> int:
    """12 requests at once to an engine of 8 whose /metrics fail as ``faults`` say (from the
    start): the most it ran at once. Every request is served."""
    sim = await lab.backend(max_num_seqs=8, time_scale=2.0)
    await sim.update_faults(**faults)
    dispatch = {"fallback_slots": 2}
    served = await lab.proxy(engine_config([sim.url], slots, dispatch=dispatch))
    async with sampled(lab, sim) as samples:
        await asyncio.wait_for(flood(lab, served, "AB", 6, tokens=12), 20)
    assert not leftovers(served)
    engine = served.state.state()["sim"]["backends"][0]["engine"]
    assert engine["problem"] == "no_metrics", engine
    assert not engine["fresh"]
    return max(running + waiting for running, waiting in samples)


async def test_broken_metrics_fall_back_to_static_slots(lab: Lab) -> None:
    """/metrics answering 500: slots N dispatches up to N; slots auto up to fallback_slots
    (nothing learned); dispatch never halts."""
    assert await stale_run(lab, 3, {"metrics_status": 500}) == 3
    assert await stale_run(lab, "auto", {"metrics_status": 500}) == 2


async def test_hanging_metrics_fall_back_to_static_slots(lab: Lab) -> None:
    """/metrics hanging past timeout_s is a failed reading too."""
    assert await stale_run(lab, 3, {"metrics_delay_s": 5.0}) == 3


async def test_metrics_that_stop_answering_turn_stale_and_come_back(lab: Lab) -> None:
    """A gate with readings whose engine's /metrics starts failing falls back to static
    slots once its last reading is max_age_s old, and dispatches on readings again once
    they are back."""
    sim = await lab.backend(max_num_seqs=4, time_scale=2.0)
    served = await lab.proxy(engine_config([sim.url], 6, dispatch={}))
    gate = served.state.pools["sim"].placement.backends[0].gate
    assert gate is not None
    await flood(lab, served, "A", 4, tokens=4)
    assert gate.fresh(served.state.pools["sim"].clock())
    await sim.update_faults(metrics_status=503)
    await asyncio.sleep(0.6)
    assert gate.problem == "no_metrics"
    assert not gate.fresh(served.state.pools["sim"].clock())
    await flood(lab, served, "AB", 6, tokens=4)  # served on static slots
    await sim.update_faults(metrics_status=200)
    await asyncio.sleep(0.15)
    assert gate.problem is None
    assert gate.fresh(served.state.pools["sim"].clock())


CLASSES = {
    "system": {"priority": True, "max_in_flight": 1, "max_queue_age_s": 5, "max_queue_len": 9},
    "batch": {"weight": 1, "engine_ceiling": 0.75},
    "interactive": {"weight": 4},
}


async def ttft(client: openai.AsyncOpenAI) -> float:
    """Seconds to the first token of an interactive stream."""
    start = time.monotonic()
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, stream=True, user="C"
    )
    async for _ in stream:
        first = time.monotonic() - start
        break
    await stream.close()
    return first


async def ceiling_run(
    lab: Lab, dispatch: dict[str, Any]
) -> tuple[list[tuple[int, int]], float, float]:
    """An engine of 4 (its capacity known: no ramp), slots 4, batch at engine_ceiling 0.75:
    the engine's samples while only batch (A and B, 12 each) ran, and an interactive
    stream's time to its first token, least of 3, during that flood and before it."""
    sim = await lab.backend(max_num_seqs=4, time_scale=1.0, decode_tokens_per_s=200.0)
    config = engine_config([sim.url], 4, dispatch=dispatch, classes=CLASSES, capacity=4)
    served = await lab.proxy(config)
    client = lab.client(served, "C")
    unloaded = min([await ttft(client) for _ in range(3)])
    async with sampled(lab, sim) as samples:
        batch = asyncio.create_task(flood(lab, served, "AB", 12, tokens=20))
        await asyncio.sleep(0.3)  # the flood is queued and running
        batch_only = list(samples)
        loaded = min([await ttft(client) for _ in range(3)])
        await batch
    assert not leftovers(served)
    return batch_only, loaded, unloaded


async def test_a_class_ceiling_leaves_room_for_interactive(lab: Lab) -> None:
    """Batch at engine_ceiling 0.75 on an engine of 4 runs at most 3 at once; an interactive
    request arriving during the batch flood starts at once, about as fast as unloaded (the
    4th sequence is free for it: no batch request need end first)."""
    batch_only, loaded, unloaded = await ceiling_run(lab, {})
    assert max(running + waiting for running, waiting in batch_only) <= 3, batch_only
    assert max(running for running, _ in batch_only) == 3
    assert loaded < unloaded + 0.05, (loaded, unloaded)


async def test_a_reload_turns_engine_dispatch_on_and_off(lab: Lab) -> None:
    """A reload gives the backends gates (told of the request already running, so its end
    is counted) and takes them away again; the scrape loop follows."""
    sim = await lab.backend(max_num_seqs=4, time_scale=1.0, decode_tokens_per_s=50.0)
    served = await lab.proxy(engine_config([sim.url], 4))
    backend = served.state.pools["sim"].placement.backends[0]
    assert backend.gate is None
    stream = await lab.client(served, "A").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, stream=True
    )
    assert served.state.reload(engine_config([sim.url], 4, dispatch={})) == []
    gate = backend.gate
    assert gate is not None
    assert gate.in_flight == 1
    async for _ in stream:
        pass
    await flood(lab, served, "AB", 3, tokens=4)
    assert gate.in_flight == 0
    # scraped since the reload (within the static pool's interval, 0.5 s: the loop's sleep)
    await eventually(lambda: gate.reading is not None, within=1.0)
    assert served.state.reload(engine_config([sim.url], 4)) == []
    assert backend.gate is None
    assert served.state.pools["sim"].scheduler.ceilings is None
    await flood(lab, served, "AB", 3, tokens=4)
    assert not leftovers(served)
