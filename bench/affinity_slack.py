"""How often a conversation's later turns stay on its first backend, by affinity's slack
(docs/design.md §5, Affinity: why ``slack`` is 2 by default).

    python bench/affinity_slack.py [--backends 4] [--slots 8] [--load-factor 1.25]
                                   [--conversations 20 48 80] [--turns 8]
                                   [--slack 0 1 2 3 4] [--seconds 20000] [--seed 1]

No server: the core's own ``Placement`` in a discrete-event simulation, so that the figure
is the rule's, not a network's. ``--conversations`` run at once, each a chain of
``--turns`` requests with one affinity key (a new conversation, a new key, takes the place of
one that ends); a turn runs an exponential time of mean 1 and the next starts after an
exponential pause of mean 1.86, so that about 35 % of the conversations have a turn running
(20 conversations: ~7 of 32 slots busy, the light load at which the ceiling of
``load_factor · (R + 1) · slots / S`` is 1 or 2). A turn that finds no free slot waits for
the next one to free (FIFO), as the fair queue would hold it.

For each slack it prints the share of later turns (the 2nd and after) placed on the backend
that served the conversation's first turn, the share of all turns that went to their key's
first choice (``affinity``) or down its order (``overflow``), the mean busy slots, and the
most requests any backend ran against the pool's mean at that moment (the imbalance the
slack buys its stickiness with).
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from sys import path

path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfq_proxy.config import BackendSpec
from sfq_proxy.core.affinity import digest
from sfq_proxy.core.placement import Backend, Placement

THINK_OVER_SERVICE = 1.86  # 20 conversations: ~7 of them with a turn running


@dataclass
class Result:
    stayed: float  # later turns on their conversation's first backend
    affinity: float  # turns that went to their key's first choice
    overflow: float
    busy: float  # mean slots in use over the run
    worst_excess: int  # the most a backend ran above the pool's mean load, in requests


def simulate(
    backends: int, slots: int, load_factor: float, slack: int, conversations: int,
    turns: int, seconds: float, seed: int,
) -> Result:  # fmt: skip
    """One run of the workload, placing with ``slack``; the same ``seed``, the same draws."""
    rng = random.Random(seed)
    specs = [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=slots) for i in range(backends)]
    placement = Placement(specs, load_factor=load_factor, slack=slack)
    events: list[tuple[float, int, str, int]] = []  # (time, seq, what, conversation)
    seq = 0
    keys = [0] * conversations  # each conversation's key number
    turn = [0] * conversations
    first: list[Backend | None] = [None] * conversations
    on: list[Backend | None] = [None] * conversations
    waiting: deque[int] = deque()
    next_key = conversations
    later = stayed = placed = affinity = overflow = 0
    busy_time = last = 0.0  # slot-seconds in use, and when the count last changed
    worst = 0

    def at(time: float, what: str, c: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time, seq, what, c))

    def start(now: float, c: int) -> bool:
        nonlocal later, stayed, placed, affinity, overflow, worst
        where = placement.place(digest("p", f"conversation {keys[c]}"))
        if where is None:
            return False
        backend, reason = where
        running = sum(b.in_flight for b in placement.backends)
        placement.acquire(backend)
        mean = (running + 1) / len(placement.backends)
        worst = max(worst, max(b.in_flight for b in placement.backends) - round(mean))
        placed += 1
        affinity += reason == "affinity"
        overflow += reason == "overflow"
        if turn[c] == 0:
            first[c] = backend
        else:
            later += 1
            stayed += backend is first[c]
        on[c] = backend
        at(now + rng.expovariate(1.0), "end", c)
        return True

    for c in range(conversations):
        keys[c] = c
        at(rng.expovariate(1.0 / THINK_OVER_SERVICE), "turn", c)
    while events:
        now, _, what, c = heapq.heappop(events)
        if now > seconds:
            break
        busy_time += (now - last) * sum(b.in_flight for b in placement.backends)
        last = now
        if what == "turn":
            if not start(now, c):
                waiting.append(c)
            continue
        backend = on[c]
        assert backend is not None
        placement.release(backend)
        while waiting and start(now, waiting[0]):
            waiting.popleft()
        turn[c] += 1
        if turn[c] == turns:  # the conversation ends; a new one takes its place
            turn[c], first[c], keys[c] = 0, None, next_key
            next_key += 1
        at(now + rng.expovariate(1.0 / THINK_OVER_SERVICE), "turn", c)
    return Result(
        stayed / max(later, 1), affinity / max(placed, 1), overflow / max(placed, 1),
        busy_time / max(last, 1e-9), worst,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--load-factor", type=float, default=1.25)
    parser.add_argument("--conversations", type=int, nargs="+", default=[20, 48, 80])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--slack", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--seconds", type=float, default=5_000.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(
        f"{args.backends} backends × {args.slots} slots, load_factor {args.load_factor}, "
        f"{args.turns} turns a conversation"
    )
    print("| conversations | slack | later turns stayed | affinity | overflow | busy slots "
          "| worst backend above the mean |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for conversations in args.conversations:
        for slack in args.slack:
            r = simulate(
                args.backends, args.slots, args.load_factor, slack, conversations,
                args.turns, args.seconds, args.seed,
            )  # fmt: skip
            print(
                f"| {conversations} | {slack} | {r.stayed:.3f} | {r.affinity:.3f} | "
                f"{r.overflow:.3f} | {r.busy:.1f} | +{r.worst_excess} |"
            )


if __name__ == "__main__":
    main()
