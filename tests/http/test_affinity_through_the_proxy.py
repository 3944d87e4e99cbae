"""Prefix-cache-aware placement through the real proxy (docs/design.md §5, Affinity), with
the in-memory state and with Redis: a conversation's turns stay on one backend, a named
session too, also at light load with conversations overlapping (the slack), one session
sent on every request cannot fill one backend, and ``sfq_placement_total`` says why each
request went where it did, with no prompt text in it.
"""

from __future__ import annotations

import asyncio
import math
import random
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


USERS, CONVERSATIONS, TURNS = 20, 3, 5


@pytest.mark.parametrize("kind", STATES)
async def test_at_light_load_a_conversations_later_turns_stay_on_its_first_backend(
    lab: Lab, request: pytest.FixtureRequest, kind: str
) -> None:
    """20 users at once on 4 × 8 slots, each holding 3 conversations of 5 turns one after
    the other, each turn followed by a pause of about its length (seeded): 5–7 slots busy.
    There the bound without slack, ⌈1.25 · (R + 1) · 8 / 32⌉, is 1 or 2, and a quarter of
    the later turns left their first backend (0.73–0.77 measured with slack 0, as before
    the slack); with the default slack of 2, at least 95 % stay (0.975–0.996 measured;
    bench/affinity_slack.py: 0.98). The backends are named, so that the keys' first choices
    (60 keys: 13, 17, 16, 14 over the four) are the same at every run."""
    sims = [await lab.backend() for _ in range(4)]
    backends = [{"url": s.url, "slots": 8, "name": f"b{i}"} for i, s in enumerate(sims)]
    config = proxy_config(
        [s.url for s in sims],
        pool={"affinity": {}, "backends": backends},
        state=state_of(kind, request),
    )
    served = await lab.proxy(config)
    client = lab.client(served)
    rng = random.Random(41)

    async def user(u: int) -> None:
        await asyncio.sleep(rng.uniform(0, 1))  # no burst of first turns: they start apart
        for c in range(u, USERS * CONVERSATIONS, USERS):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {c}"},
            ]
            for turn in range(TURNS):
                await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=200, user=f"c{c}"
                )
                messages += [
                    {"role": "assistant", "content": f"answer {turn}"},
                    {"role": "user", "content": f"and then {turn}?"},
                ]
                await asyncio.sleep(rng.expovariate(1 / 0.1))  # read, then ask again

    await asyncio.gather(*(user(u) for u in range(USERS)))
    served_by: defaultdict[str, list[tuple[float, int]]] = defaultdict(list)
    for index, sim in enumerate(sims):
        for record in sim.stats.log:
            assert record.user is not None
            served_by[record.user].append((record.arrived_at, index))
    later = stayed = 0
    for turns in served_by.values():
        assert len(turns) == TURNS
        (_, first), *rest = sorted(turns)
        later += len(rest)
        stayed += sum(index == first for _, index in rest)
    assert later == USERS * CONVERSATIONS * (TURNS - 1)
    assert stayed / later >= 0.95, (stayed, later)


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
    """Twelve requests at once with the same session header on 3 × 4 slots, with no slack:
    each placement keeps its backend within ⌈1.25 · (R + 1) · 4 / 12⌉ ≤ 5, so the session's
    first choice takes a few and the rest go down its order."""
    sims = [await lab.backend(time_scale=5.0) for _ in range(3)]
    affinity = {"session_header": "X-Session-Id", "prefix_chars": 0, "slack": 0}
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
