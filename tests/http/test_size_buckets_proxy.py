"""Size buckets inside a flow through the real proxy (docs/design.md §3, Size buckets inside a
flow): the HTTP shell queues each request with its class's bucket, so the proxy dispatches
what the core and the lab decide, in memory and with its pools' state in Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from proxy_lab import MODEL, Lab, eventually, proxy_config
from redis_server import queued_is

CHAT = [{"role": "user", "content": "Say something fair."}]
CLASSES: dict[str, Any] = {
    "system": {"priority": True, "max_in_flight": 1, "max_queue_age_s": 5, "max_queue_len": 9},
    "interactive": {"weight": 6},
}


async def order_behind_a_blocker(
    lab: Lab, batch: dict[str, Any], redis_url: str | None = None
) -> list[str]:
    """One slot, held by org C's stream. Org A queues two long requests then a short one, all
    in class batch (``batch``'s settings): one flow. The blocker ends; returns A's requests
    in the order the backend received them. ``redis_url``: the pool's state in Redis."""
    sim = await lab.backend(max_num_seqs=1)
    state = {"redis": redis_url, "lease_ttl_s": 5} if redis_url else "memory"
    classes = {**CLASSES, "batch": batch}
    served = await lab.proxy(proxy_config([sim.url], slots=1, classes=classes, state=state))
    blocker = await lab.client(served, "C").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True, user="C"
    )
    client = lab.client(served, "A")
    requests = []
    for user, max_tokens in [("long-1", 2000), ("long-2", 2000), ("short", 5)]:
        requests.append(
            asyncio.create_task(
                client.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=max_tokens, user=user
                )
            )
        )
        queued = len(requests)
        if redis_url is None:
            await eventually(lambda queued=queued: served.queue().backlog("A/batch") == queued)
        else:
            await eventually(lambda queued=queued: queued_is(redis_url, queued), within=5)
    await blocker.close()
    replies = await asyncio.gather(*requests)
    assert [r.usage.completion_tokens for r in replies] == [2000, 2000, 5]
    return [r.user for r in sim.stats.log if r.user != "C"]


async def test_a_short_request_overtakes_the_long_ones_of_its_flow(lab: Lab) -> None:
    """With size buckets (cost <= 500 is bucket 0) the short request, queued last, is sent
    first; without them the flow is served in arrival order."""
    sized = await order_behind_a_blocker(lab, {"weight": 1, "size_buckets": [500]})
    assert sized == ["short", "long-1", "long-2"]
    fifo = await order_behind_a_blocker(lab, {"weight": 1})
    assert fifo == ["long-1", "long-2", "short"]


async def test_a_long_request_overtaken_max_overtaken_times_goes_first(lab: Lab) -> None:
    """K = 0 is arrival order, buckets or not."""
    order = await order_behind_a_blocker(
        lab, {"weight": 1, "size_buckets": [500], "max_overtaken": 0}
    )
    assert order == ["long-1", "long-2", "short"]


@pytest.mark.redis
async def test_with_the_state_in_redis_the_short_request_goes_first_too(
    lab: Lab, redis_url: str
) -> None:
    """The ticket carries its bucket to dispatch.lua, which orders the flow alike."""
    sized = await order_behind_a_blocker(lab, {"weight": 1, "size_buckets": [500]}, redis_url)
    assert sized == ["short", "long-1", "long-2"]
