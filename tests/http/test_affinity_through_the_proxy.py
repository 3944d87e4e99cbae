"""Prefix-cache-aware placement through the real proxy (docs/design.md §5, Affinity), with
the in-memory state and with Redis: a conversation's turns stay on one backend, a named
session too, one session sent on every request cannot fill one backend, and
``sfq_placement_total`` says why each request went where it did, with no prompt text in it.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, defaultdict
from typing import Any

import pytest
from proxy_lab import MODEL, AccessLines, Lab, Samples, proxy_config, sample, scrape

SYSTEM = "You are the support assistant of ACME. Answer briefly. " * 4

STATES = [
    pytest.param("memory", id="memory"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]


def placements(got: Samples) -> Counter[str]:
    """``sfq_placement_total`` summed per reason."""
    out: Counter[str] = Counter()
    for (name, labels), value in got.items():
        if name == "sfq_placement_total":
            out[dict(labels)["reason"]] += int(value)
    return out


def state_of(kind: str, request: pytest.FixtureRequest) -> Any:
    return "memory" if kind == "memory" else {"redis": request.getfixturevalue("redis_url")}


@pytest.mark.parametrize("kind", STATES)
async def test_a_conversations_turns_stay_on_one_backend(
    lab: Lab, access_log: AccessLines, request: pytest.FixtureRequest, kind: str
) -> None:
    sims = [await lab.backend() for _ in range(3)]
    config = proxy_config(
        [s.url for s in sims], slots=4, pool={"affinity": {}}, state=state_of(kind, request)
    )
    served = await lab.proxy(config)
    client = lab.client(served)
    for turn in range(3):
        for conversation in range(8):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"secret-question-{conversation}"},
            ]
            for earlier in range(turn):  # the answers and questions of the earlier turns
                messages += [
                    {"role": "assistant", "content": f"answer {earlier}"},
                    {"role": "user", "content": f"and then {earlier}?"},
                ]
            await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, user=f"c{conversation}"
            )
    lines = [line for line in await access_log() if line["outcome"] == "completed"]
    assert len(lines) == 24
    where: defaultdict[int, set[str]] = defaultdict(set)
    for index, line in enumerate(lines):
        where[index % 8].add(line["backend"])
    assert all(len(backends) == 1 for backends in where.values()), where
    assert len(set.union(*where.values())) >= 2  # the conversations spread over the pool

    got = await scrape(lab, served)
    assert placements(got) == {"affinity": 24}  # one at a time: always the first choice
    assert all("secret-question" not in str(k) for k in got)


async def test_without_affinity_an_idle_pool_sends_everything_to_the_first_backend(
    lab: Lab, access_log: AccessLines
) -> None:
    sims = [await lab.backend() for _ in range(2)]
    served = await lab.proxy(proxy_config([s.url for s in sims], slots=4))
    client = lab.client(served)
    for conversation in range(4):
        messages = [{"role": "user", "content": f"question {conversation}"}]
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert {line["backend"] for line in await access_log()} == {sims[0].url[len("http://") :]}
    got = await scrape(lab, served)
    backend = sims[0].url[len("http://") :]
    assert sample(got, "sfq_placement_total", pool="sim", backend=backend, reason="fallback") == 4


@pytest.mark.parametrize("kind", STATES)
async def test_one_session_on_every_request_cannot_fill_one_backend(
    lab: Lab, request: pytest.FixtureRequest, kind: str
) -> None:
    """Twelve requests at once with the same session header on 3 × 4 slots: each placement
    keeps its backend within ⌈1.25 · (R + 1) · 4 / 12⌉ ≤ 5, so the session's first choice
    takes a few and the rest go down its order."""
    sims = [await lab.backend(time_scale=5.0) for _ in range(3)]
    affinity = {"session_header": "X-Session-Id", "prefix_chars": 0}
    config = proxy_config(
        [s.url for s in sims], slots=4, pool={"affinity": affinity}, state=state_of(kind, request)
    )
    served = await lab.proxy(config)
    client = lab.client(served)
    same = {"X-Session-Id": "pin-everything-here"}

    async def one(i: int) -> None:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"q{i}"}],
            max_tokens=200,
            extra_headers=same,
        )

    await asyncio.gather(*(one(i) for i in range(12)))
    cap = math.ceil(1.25 * 12 * 4 / 12)
    assert all(s.stats.max_concurrent <= cap for s in sims), [s.stats.max_concurrent for s in sims]
    assert all(s.stats.completed >= 1 for s in sims)
    got = await scrape(lab, served)
    reasons = placements(got)
    assert reasons["overflow"] >= 12 - cap
    assert reasons["fallback"] == 0
