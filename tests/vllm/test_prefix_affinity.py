"""Affinity keeps a conversation's KV cache: vLLM's own prefix-cache counters say so.

The workload of ``bench/prefix_affinity.py`` (per-org system prompts, conversations of
several turns, all at once, streamed) runs through the proxy in front of the session's two
real vLLM servers twice: least-loaded, then with ``affinity``. The hit ratio is vLLM's
``prefix_cache_hits`` over ``prefix_cache_queries`` (tokens) over each run: a ratio of
vLLM's counters, never a timing. Each run's prompts carry their own nonce, so nothing one
run (or another test) left in the cache is a hit for the other.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from vllm_backend import VllmServer

pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prefix_affinity.py"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prefix_affinity", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def test_affinity_hits_vllms_prefix_cache_more_than_least_loaded(
    vllm_servers: list[VllmServer],
) -> None:
    module = bench()
    workload = {"orgs": 3, "conversations": 2, "turns": 5, "max_tokens": 4, "slots": 4}
    results = await module.compare([s.url for s in vllm_servers], **workload)
    print(module.report(results, workload, len(vllm_servers)))
    least, affinity = results["least-loaded"], results["affinity"]
    for result in (least, affinity):  # every request reached vLLM, and was placed
        assert sum(result.queries.values()) > 0
        assert sum(result.placements.values()) == 3 * 2 * 5
    assert least.placements["fallback"] == 3 * 2 * 5  # no key: the least loaded
    assert affinity.placements["fallback"] == 0  # every chat has a key
    assert affinity.ratio() > least.ratio()
