"""Push+pop throughput of the SFQ core against the naive linear-scan reference.

Every flow stays backlogged: each pop is followed by a push to the flow just served, so
the queue always holds T flows and each pair is one full scheduling decision.

    python bench/sfq_core.py [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from sfq_harness import ReferenceSFQ

from sfq_proxy.core.fair_queue import FairQueue

FLOW_COUNTS = (10, 1_000, 100_000)


def pairs_per_second(make: type, flows: int, seconds: float) -> float:
    """Run push+pop pairs for about ``seconds`` and return the rate."""
    rng = random.Random(0)
    costs = [rng.randint(1, 1000) for _ in range(4096)]
    q = make()
    names = [f"org-{i:06d}" for i in range(flows)]
    for n, name in enumerate(names):
        q.push(name, n, costs[n % 4096])
        q.push(name, n, costs[(n * 7) % 4096])
    pairs, batch = 0, 16
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(batch):
            flow, item = q.pop()
            q.push(flow, item, costs[pairs & 4095])
            pairs += 1
        batch = min(batch * 2, 4096)
    return pairs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    args = parser.parse_args()
    print(f"{'flows':>8} {'FairQueue pairs/s':>18} {'reference pairs/s':>18} {'ratio':>8}")
    rates = {}
    for flows in FLOW_COUNTS:
        fast = rates[flows] = pairs_per_second(FairQueue, flows, args.seconds)
        slow = pairs_per_second(ReferenceSFQ, flows, args.seconds)
        print(f"{flows:>8} {fast:>18,.0f} {slow:>18,.0f} {fast / slow:>7.1f}x")
    slowdown = rates[1_000] / rates[100_000]
    print(f"FairQueue at 100,000 flows is {slowdown:.2f}x slower than at 1,000 (O(log T)).")


if __name__ == "__main__":
    main()
