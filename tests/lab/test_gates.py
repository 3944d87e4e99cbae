"""Engine-gated dispatch in the lab (issue 41): the scenario's ``dispatch`` section, and the
simulator driving the core's ``EngineGate`` with readings of the simulated engine, against
static slots on the same scenario (config/scenarios/engine-slots.yaml: one engine of 4, 150
long batch jobs at t=0, a chat turn every second)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sfq_proxy.config import ConfigError
from sfq_proxy.lab import report
from sfq_proxy.lab.commands import with_dispatch, with_engine_ceiling, with_slots
from sfq_proxy.lab.policies import make_policy
from sfq_proxy.lab.scenario import Scenario, Served, load_scenario, parse_scenario
from sfq_proxy.lab.simulator import EngineSample, simulate

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SLOTS = ROOT / "config" / "scenarios" / "engine-slots.yaml"
CAPACITY = 4  # the scenario's max_num_seqs


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return load_scenario(ENGINE_SLOTS)


def run(scenario: Scenario) -> tuple[list[Served], list[EngineSample]]:
    log: list[EngineSample] = []
    served = simulate(scenario, make_policy("sfq", quantum=1, priority_order=[]), engine_log=log)
    assert sorted(s.request.id for s in served) == list(range(len(scenario.requests)))
    return served, log


def engine(scenario: Scenario, slots: int | str = "auto", **dispatch: object) -> Scenario:
    """``scenario`` with engine dispatch, ``slots`` and ``dispatch`` settings."""
    gated = with_dispatch(scenario, "engine")
    pool = gated.pool
    gated = replace(gated, pool=replace(pool, dispatch=replace(pool.dispatch, **dispatch)))
    return with_slots(gated, slots)  # type: ignore[arg-type]


def engine_waits(served: list[Served], team: str) -> list[float]:
    return sorted(s.admitted_s - s.start_s for s in served
                  if s.request.team == team and s.admitted_s is not None)  # fmt: skip


def ttft(served: list[Served], team: str) -> list[float]:
    return sorted(s.first_token_s - s.request.time_s for s in served
                  if s.request.team == team and s.first_token_s is not None)  # fmt: skip


def mean_running(log: list[EngineSample], start: float, end: float) -> float:
    """The engine's batch, time-weighted over [start, end] (one backend)."""
    area, last, running = 0.0, start, 0
    for x in log:
        if x.time_s > start:
            area += running * (min(x.time_s, end) - last)
            last = min(x.time_s, end)
        running = x.running
        if x.time_s >= end:
            break
    return area / (end - start)


def backlog_end(served: list[Served]) -> float:
    """When the last batch job left the proxy's queue: the batch had a backlog until then."""
    return max(s.start_s for s in served if s.request.team == "batch")


@pytest.mark.parametrize("allowance", [1, 2])
def test_engine_dispatch_holds_the_engines_queue_to_the_allowance_and_its_batch_full(
    scenario: Scenario, allowance: int
) -> None:
    """slots: auto: at every change of the engine (every reading included) it holds at most
    ``allowance`` waiting, and while batch has a backlog it runs full (the ramp from 0 is
    by the allowance a reading, a couple of seconds)."""
    served, log = run(engine(scenario, allowance=allowance))
    assert max(x.waiting for x in log) == allowance
    assert max(x.running for x in log) == CAPACITY
    assert mean_running(log, 5.0, backlog_end(served)) >= 0.9 * CAPACITY


def test_static_slots_above_the_engine_move_the_queue_into_it(scenario: Scenario) -> None:
    """The same scenario with 32 static slots: the engine's queue holds all the proxy sent
    beyond its batch, and the chat turns wait in it behind batch jobs; engine dispatch on
    the same engine keeps them in the fair queue, where they go first."""
    static, static_log = run(with_slots(scenario, 32))
    gated, gated_log = run(engine(scenario))
    assert max(x.waiting for x in static_log) == 32 - CAPACITY
    assert max(x.waiting for x in gated_log) == 1
    assert report.percentile(ttft(static, "chat"), 50) > 100
    assert report.percentile(ttft(gated, "chat"), 50) < 5


def test_slots_too_high_are_a_ceiling_and_the_gate_ramps_as_with_auto(
    scenario: Scenario,
) -> None:
    """Engine dispatch with ``slots: 32`` on an engine of 4: 32 is a ceiling, not what the
    engine runs, so the gate ramps as with ``auto``: the burst at t=0 never reaches the
    engine whole (static 32 left 28 waiting there), and chat's turns do not wait for it."""
    served, log = run(engine(scenario, 32))
    auto, _ = run(engine(scenario, "auto"))
    assert max(x.waiting for x in log) <= 1
    assert [(s.request.id, s.start_s) for s in served] == [
        (s.request.id, s.start_s) for s in auto
    ]  # the same dispatches as auto: nothing learned from 32
    assert report.percentile(ttft(served, "chat"), 50) < 10


def test_a_class_ceiling_leaves_the_interactive_team_room(scenario: Scenario) -> None:
    """Batch's engine_ceiling 0.75: it never runs more than 3 of the 4 and never waits in the
    engine, so a chat turn finds a free sequence: its wait in the engine drops from up to a
    batch job's turnover to at most another chat turn's."""
    base, _ = run(engine(scenario))
    known = engine(scenario)  # a ceiling applies to a known capacity: the engine's 4
    known = replace(known, pool=replace(known.pool, capacity=CAPACITY))
    ceiled, log = run(with_engine_ceiling(known, "batch", 0.75))
    assert max(engine_waits(ceiled, "batch")) == 0
    chat, chat_before = engine_waits(ceiled, "chat"), engine_waits(base, "chat")
    assert report.percentile(chat, 99) < 2.0 < report.percentile(chat_before, 99)
    assert report.percentile(chat, 50) < 0.5
    running = {s.request.id: s for s in ceiled}
    for x in log:  # batch alone never holds the 4th sequence
        batch_running = sum(
            1
            for s in running.values()
            if s.request.team == "batch" and s.admitted_s is not None
            and s.admitted_s <= x.time_s < s.end_s
        )  # fmt: skip
        assert batch_running <= 3


def test_stale_readings_fall_back_to_static_slots(scenario: Scenario) -> None:
    """A scrape slower than max_age_s: every reading is stale when it arrives. With slots 4
    the gate admits what static slots admit, to the last record; with auto it dispatches on
    at fallback_slots at once, and every request is still served."""
    stale = {"scrape_delay_s": 3.0, "max_age_s": 2.0}
    assert run(engine(scenario, 4, **stale)) == run(with_slots(scenario, 4))
    for fallback in (1, 2):
        _, log = run(engine(scenario, fallback_slots=fallback, **stale))
        assert max(x.running + x.waiting for x in log) == fallback


def test_same_inputs_same_outputs(scenario: Scenario) -> None:
    first = run(with_engine_ceiling(engine(scenario, allowance=2), "batch", 0.75))
    again = run(with_engine_ceiling(engine(scenario, allowance=2), "batch", 0.75))
    assert first == again


def test_first_tokens(scenario: Scenario) -> None:
    """A request's first token comes when its first run's prefill is done: after it joined
    the batch (at the engine's prefill speed) and before its end."""
    served, _ = run(engine(scenario))
    prefill = scenario.pool.engine.prefill_seconds
    for s in served:
        assert s.first_token_s is not None
        assert s.admitted_s is not None
        assert s.first_token_s == pytest.approx(s.admitted_s + prefill(s.request.prompt_tokens))
        assert s.first_token_s <= s.end_s


def test_classes_engine_priorities_reach_the_engine() -> None:
    """The priority policy with chat at 0 and batch at 1: with 32 static slots a chat turn
    no longer waits behind batch jobs in the engine: it preempts one."""
    text = ENGINE_SLOTS.read_text()
    text = text.replace("max_num_seqs: 4 ", "max_num_seqs: 4\n    scheduling_policy: priority ")
    text = text.replace("interactive: {weight: 1}", "interactive: {weight: 1, engine_priority: 0}")
    text = text.replace("batch: {weight: 1}", "batch: {weight: 1, engine_priority: 1}")
    served, _ = run(parse_scenario(text, ROOT, duration_s=60))
    assert max(engine_waits(served, "chat")) == 0
    assert sum(s.preemptions for s in served if s.request.team == "batch") > 0


POOL = """
name: bad
seed: 1
duration_s: 10
pool:
  backends: 1
  engine: {prefill_tokens_per_s: 8000, decode_tokens_per_s: 40}
teams:
  a:
    class: batch
    arrivals: {kind: at_start, count: 1}
    input_tokens: {kind: fixed, value: 10}
    output_tokens: {kind: fixed, value: 10}
"""


@pytest.mark.parametrize(
    ("pool", "classes", "error"),
    [
        ("slots: auto", "", "pool.slots: auto only with dispatch.mode: engine"),
        ("slots: many", "", "pool.slots: expected an integer, or auto"),
        ("slots: 0", "", "pool.slots: must be > 0"),
        ("slots: 4\n  capacity: 4", "", "pool.capacity: only with dispatch.mode: engine"),
        ("slots: auto\n  dispatch: {mode: engine}", "",
         "pool.engine.max_num_seqs: required with slots: auto"),
        ("slots: 4\n  dispatch: {mode: engine, interval_s: 2}", "",
         "pool.dispatch.max_age_s: must be above interval_s"),
        ("slots: 4\n  dispatch: {mode: gpu}", "", "pool.dispatch.mode:"),
        ("slots: 4\n  dispatch: {allowance: 0}", "", "pool.dispatch.allowance: must be >= 1"),
        ("slots: 4\n  dispatch: {timeout_s: 1}", "", "pool.dispatch.timeout_s: unknown field"),
        ("slots: 4", "batch: {engine_ceiling: 0}", "classes.batch.engine_ceiling: must be > 0"),
        ("slots: 4", "batch: {engine_priority: 1}",
         "classes.batch.engine_priority: only with pool.engine.scheduling_policy: priority"),
    ],
)  # fmt: skip
def test_dispatch_settings_are_checked_with_their_paths(
    pool: str, classes: str, error: str
) -> None:
    text = POOL.replace("  backends: 1", f"  backends: 1\n  {pool}")
    if classes:
        text += f"classes:\n  {classes}\n"
    with pytest.raises(ConfigError) as raised:
        parse_scenario(text, ROOT)
    assert error in str(raised.value)


def test_dispatch_section_is_read(scenario: Scenario) -> None:
    text = POOL.replace(
        "  backends: 1",
        "  backends: 1\n  slots: auto\n  capacity: 8\n  dispatch: {mode: engine, allowance: 3,"
        " kv_ceiling: null, scrape_delay_s: 0.2}",
    ).replace("decode_tokens_per_s: 40", "decode_tokens_per_s: 40, max_num_seqs: 8")
    pool = parse_scenario(text + "classes:\n  batch: {engine_ceiling: 0.5}\n", ROOT).pool
    policy = pool.gate_policy()
    assert (policy.slots, policy.capacity, policy.allowance, policy.kv_ceiling) == (
        None, 8, 3, None,
    )  # fmt: skip
    assert pool.dispatch.scrape_delay_s == 0.2
    assert scenario.pool.dispatch.mode == "static"
    assert {t.cls: t.engine_ceiling for t in scenario.teams} == {"batch": 1.0, "interactive": 1.0}


def test_simulate_compares_static_slots_with_engine_dispatch_in_one_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sfq_proxy.cli", "simulate", str(ENGINE_SLOTS), "--policy",
         "sfq", "--dispatch", "static", "--dispatch", "engine", "--slots", "32", "--slots",
         "auto", "--duration", "60", "--no-plots"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "queue max" in line)
    head = re.split(r"\s{2,}", lines[at].strip())
    rows = [dict(zip(head, re.split(r"\s{2,}", line.strip()), strict=False))
            for line in lines[at + 2:] if line.startswith("sfq")]  # fmt: skip
    assert [(r["policy"], r["queue max"]) for r in rows] == [
        ("sfq static 32", "28"), ("sfq engine 32", "1"), ("sfq engine auto", "1"),
    ]  # fmt: skip
    refused = subprocess.run(
        [sys.executable, "-m", "sfq_proxy.cli", "simulate", str(ENGINE_SLOTS), "--slots", "auto"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "slots auto only with engine dispatch" in refused.stderr
