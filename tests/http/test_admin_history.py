"""``/admin/history``, what the admin page's charts draw (docs/admin-page.md, Over time):
from a live proxy under a backlogged two-org load, each flow's served share against its
entitled share (by weight among the flows backlogged), the queue, its waits, and the
backends' load, sampled once a second by the proxy itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from proxy_lab import KEYS, Lab, eventually, keep_asking, proxy_config

ADMIN = "sk-admin-history-test"
SLOTS = 2


def share(points: list[dict[str, Any]], field: str, flow: str) -> float:
    """``flow``'s part of ``field`` (served or entitled) summed over ``points``."""
    whole = sum(sum(p[field].values()) for p in points)
    return sum(p[field].get(flow, 0.0) for p in points) / whole


async def test_the_history_shows_served_against_entitled_shares_queue_waits_and_slots(
    lab: Lab,
) -> None:
    """A (weight 3) and B (weight 1) both backlogged: A is served about 3/4 and entitled to
    3/4; once B stops, A alone is backlogged and entitled to everything."""
    sim = await lab.backend()
    config = proxy_config(
        [sim.url], slots=SLOTS, admin_key_env="ADMIN", environ={"ADMIN": ADMIN},
        orgs={"A": {"weight": 3}},
    )  # fmt: skip
    served = await lab.proxy(config)
    http = await lab.http()

    async def history() -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with http.get(f"{served.url}/admin/history", headers=headers) as r:
            assert r.status == 200
            pool: dict[str, Any] = (await r.json())["pools"]["sim"]
            return pool

    async with http.get(f"{served.url}/admin/history") as r:
        assert r.status == 401  # the admin key, as every admin call
    a_stop, b_stop = asyncio.Event(), asyncio.Event()
    ask = {"max_tokens": 40}
    a_load = asyncio.create_task(keep_asking(lab, served, "A", 4, a_stop, **ask))
    b_load = asyncio.create_task(keep_asking(lab, served, "B", 4, b_stop, **ask))
    started = time.time()
    await asyncio.sleep(4)
    b_stop.set()
    assert await b_load > 0
    b_gone = time.time()  # B waits for nothing any more

    async def three_samples_of_a_alone() -> bool:
        return sum(p["end"] - p["span_s"] > b_gone + 1 for p in (await history())["recent"]) >= 3

    await eventually(three_samples_of_a_alone, within=15)
    a_stop.set()
    assert await a_load > 0
    pool = await history()
    recent = pool["recent"]
    assert pool["sample_s"] == 1
    both = [p for p in recent if p["end"] - p["span_s"] >= started and p["end"] <= b_gone]
    alone = [p for p in recent if p["end"] - p["span_s"] > b_gone + 1]
    assert len(both) >= 2
    print(f"A's share with B backlogged: served {share(both, 'served', 'A/batch'):.3f}, "
          f"entitled {share(both, 'entitled', 'A/batch'):.3f}")  # fmt: skip
    assert share(both, "entitled", "A/batch") == pytest.approx(0.75, abs=0.02)
    assert share(both, "served", "A/batch") == pytest.approx(0.75, abs=0.1)
    for p in alone:
        assert set(p["served"]) == set(p["entitled"]) == {"A/batch"}
        assert p["entitled"]["A/batch"] == pytest.approx(p["served"]["A/batch"])
    for p in both:
        assert p["queued"] >= 1  # eight clients, two slots
        assert 0 < p["wait_p50_s"] <= p["wait_p99_s"]
        assert p["dispatches"] >= 1
        (backend,) = p["backends"].values()
        assert backend["slots"] == SLOTS
        assert 0 < backend["in_flight"] <= SLOTS
        assert backend["healthy"] == 1
    # since start: the same seconds, in points as wide (the proxy ran less than 240 s)
    served_since = sum(sum(p["served"].values()) for p in pool["since_start"])
    served_recent = sum(sum(p["served"].values()) for p in recent)
    assert served_since == pytest.approx(served_recent, rel=0.01)
    assert KEYS["A"] not in str(pool)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with http.get(f"{served.url}/admin/history?series=recent", headers=headers) as r:
        assert set((await r.json())["pools"]["sim"]) == {"sample_s", "recent"}  # that one alone
    async with http.get(f"{served.url}/admin/history?series=<b>", headers=headers) as r:
        assert (r.status, (await r.json())["error"]["type"]) == (400, "invalid_request_error")
