"""Engine-gated dispatch on real vLLM: ``bench/engine_dispatch.py``'s three cases, asserted.

One vLLM CPU server for the module (``--max-num-seqs 4``, ``--scheduling-policy
priority``), and the bench's runs on it, once: each configuration against static slots
(or against the client straight to vLLM) of the same run, so that the assertions are
ratios and counts of one run, never a timing of its own (a shared 2-core machine stalls).
The figures the margins leave room for are in docs/performance.md ("Engine dispatch on
real vLLM"). About 2 minutes, the server's start included.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import benches
import pytest
from server_process import running
from vllm_backend import VllmServer, need_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_of_4() -> Iterator[VllmServer]:
    need_vllm()
    with running([VllmServer(max_num_seqs=4, scheduling_policy="priority")]) as (server,):
        yield server


@pytest.fixture(scope="module")
def measured(engine_of_4: VllmServer) -> tuple[ModuleType, dict[str, Any]]:
    """Every configuration of the bench, once, on the module's server."""
    module = benches.load("engine_dispatch")
    workload = module.Workload()
    with tempfile.TemporaryDirectory() as tmp, module.Processes(Path(tmp)) as procs:
        runs = asyncio.run(module.measure(engine_of_4.url, workload, procs))
    print(module.report(runs, workload))
    return module, runs


def test_slots_too_high_queue_in_the_proxy_not_in_vllm(
    measured: tuple[ModuleType, dict[str, Any]],
) -> None:
    """slots 32 on an engine of 4: static hands vLLM nearly all of them, engine dispatch
    holds it at capacity + allowance; SFQ, not vLLM's FCFS, orders the two orgs."""
    module, runs = measured
    static, engine = runs["1 static"], runs["1 engine"]
    assert max(static.samples.waiting) >= 10
    assert engine.samples.load_max() <= 4 + module.ALLOWANCE + 1  # one for a sample's race
    assert engine.samples.mean("waiting") < static.samples.mean("waiting") / 5
    # SFQ alternates the equal orgs (A's burst came 50 ms first). Static's share is not
    # asserted: vLLM serves in the order the bursts reached the proxy, 55 % to 96 % for A.
    assert 0.3 < engine.share("A") < 0.7


def test_slots_auto_runs_the_engine_full(measured: tuple[ModuleType, dict[str, Any]]) -> None:
    """slots 1 on an engine of 4 idles three quarters of it; slots auto ramps to what vLLM
    runs and keeps it full: as fast as static slots set to the engine's own 4 (0.99 of it
    measured, the engine read again when a request ends; 0.79 when read at the interval
    alone). Against direct the proxy's own CPU counts too, on cores it shares with vLLM's
    CPU engine here, and the direct run is the noisiest (0.68–1.41 of static 4's)."""
    _, runs = measured
    modes = ("direct", "static", "right", "engine")
    throughput = {m: runs[f"2 {m}"].bench["output_throughput"] for m in modes}
    for m in modes:
        assert runs[f"2 {m}"].bench["failed"] == 0
    assert throughput["engine"] >= 0.8 * throughput["right"], throughput
    assert throughput["engine"] > 1.5 * throughput["static"], throughput
    assert runs["2 engine"].samples.mean("running", True) >= 3.0
    assert runs["2 static"].samples.mean("running", True) <= 1.0


def test_a_batch_ceiling_leaves_interactive_its_place(
    measured: tuple[ModuleType, dict[str, Any]],
) -> None:
    """Batch floods at engine_ceiling 0.75: the 4th sequence is free for the interactive
    probes, which start without waiting for a batch request to end (static slots 4)."""
    _, runs = measured
    static, ceiling, priority = (runs[f"3 {m}"] for m in ("static", "ceiling", "priority"))
    assert min(len(r.ttft) for r in (static, ceiling, priority)) >= 5
    # the mechanism: static fills the engine's 4 with batch, the ceiling holds batch at 3
    assert statistics.median(static.samples.running) == 4
    assert statistics.median(ceiling.samples.running) == 3
    assert ceiling.quantile(0.99) < static.quantile(0.99)
    # the probes' p50 below static's; not held to half of it, since a static probe's wait
    # (a batch request's turnover) is only a few times the prefill on a fast run (p50 33 ms
    # against 16.8 with the ceiling and priority, in one CI run)
    assert ceiling.quantile(0.5) < static.quantile(0.5)
    assert priority.quantile(0.5) < static.quantile(0.5)
