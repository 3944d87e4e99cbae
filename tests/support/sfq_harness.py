"""An oracle for the SFQ core and the checkers that pin its guarantees.

``ReferenceSFQ`` is the article's algorithm written as plainly as possible: a linear argmin
over exact fractions. Its flags produce the broken variants that the checkers must catch,
which is how the tests show that the checkers can fail at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, Protocol

# ("push", flow, cost) | ("front", flow, cost) | ("pop",) | ("remove", flow, k) | ("elig", flow, ok)
# | ("settle", flow, k, actual): the k-th (mod) running request of flow ends, having cost
# actual (None: unknown, the estimate stands)
Op = tuple[Any, ...]


class QueueLike(Protocol):
    virtual_time: Any

    def push(
        self, flow: str, item: Any, cost: float, weight: float = 1.0, *, front: bool = False
    ) -> None: ...
    def pop(self) -> tuple[str, Any] | None: ...
    def remove(self, flow: str, item: Any) -> bool: ...
    def settle(self, flow: str, cost: float, actual: float | None = None) -> None: ...
    def set_eligible(self, flow: str, ok: bool) -> None: ...
    def meter(self, flow: str) -> Any: ...
    def backlog(self, flow: str) -> int: ...
    def __len__(self) -> int: ...


class ReferenceSFQ:
    """Linear-scan SFQ from the article, §2.6, with switches that break it on purpose."""

    def __init__(
        self,
        *,
        join: Literal["max", "reset"] = "max",
        idle_reset: bool = True,
        charge_at: Literal["pop", "push"] = "pop",
        true_up: bool = True,
        busy_while_running: bool = True,
    ) -> None:
        self.join, self.idle_reset, self.charge_at = join, idle_reset, charge_at
        self.true_up, self.busy_while_running = true_up, busy_while_running
        self.S: dict[str, Fraction] = {}
        # the highest meter of the busy period: a refund after it does not lower where the
        # next period starts (every flow is idle then, and rejoins at v: only the level moves)
        self.high = Fraction(0)
        self.w: dict[str, Fraction] = {}  # each flow's weight, as of its latest push
        self.running: dict[str, int] = {}
        self.q: dict[str, deque[tuple[Any, Fraction]]] = {}
        self.v = Fraction(0)
        self.ineligible: set[str] = set()

    @property
    def virtual_time(self) -> Fraction:
        return self.v

    def push(
        self, flow: str, item: Any, cost: float, weight: float = 1.0, *, front: bool = False
    ) -> None:
        charge = Fraction(cost) / Fraction(weight)
        self.w[flow] = Fraction(weight)
        queue = self.q.setdefault(flow, deque())
        if not queue:
            old = self.S.get(flow, self.v)
            self.S[flow] = self.v if self.join == "reset" else max(old, self.v)
        if self.charge_at == "push":
            self.S[flow] += charge
        self.high = max(self.high, self.S[flow])
        (queue.appendleft if front else queue.append)((item, charge))

    def pop(self) -> tuple[str, Any] | None:
        ready = [f for f, q in self.q.items() if q and f not in self.ineligible]
        if not ready:
            return None
        flow = min(ready, key=lambda f: (self.S[f], f))
        self.v = max(self.v, self.S[flow])
        item, charge = self.q[flow].popleft()
        if self.charge_at == "pop":
            self.S[flow] += charge
        self.high = max(self.high, self.S[flow])
        self.running[flow] = self.running.get(flow, 0) + 1
        self._maybe_idle()
        return flow, item

    def settle(self, flow: str, cost: float, actual: float | None = None) -> None:
        """True-up: a debt and a refund alike; an idle flow's is lifted to v as it rejoins."""
        assert self.running.get(flow), f"settle of {flow} with nothing running"
        self.running[flow] -= 1
        if actual is not None and self.true_up:
            owed = (Fraction(actual) - Fraction(cost)) / self.w[flow]
            self.S[flow] += owed
            self.high = max(self.high, self.S[flow])
        self._maybe_idle()

    def remove(self, flow: str, item: Any) -> bool:
        queue = self.q.get(flow, deque())
        for entry in queue:
            if entry[0] == item:
                queue.remove(entry)
                self._maybe_idle()
                return True
        return False

    def set_eligible(self, flow: str, ok: bool) -> None:
        if ok and flow in self.ineligible:
            self.ineligible.discard(flow)
            if self.q.get(flow):
                self.S[flow] = max(self.S[flow], self.v)
        elif not ok:
            self.ineligible.add(flow)

    def meter(self, flow: str) -> Fraction:
        return self.S.get(flow, self.v)

    def backlog(self, flow: str) -> int:
        return len(self.q.get(flow, ()))

    def __len__(self) -> int:
        return sum(len(q) for q in self.q.values())

    def _maybe_idle(self) -> None:
        running = self.busy_while_running and any(self.running.values())
        if self.idle_reset and not len(self) and not running and self.S:
            self.v = max(self.v, self.high, *self.S.values())


@dataclass
class Trace:
    """What a run of operations produced, step by step, for the checkers to judge."""

    dispatches: list[tuple[str, Any]] = field(default_factory=list)
    # after every op: v, and per flow (backlog, eligible, meter)
    states: list[tuple[Fraction, dict[str, tuple[int, bool, Fraction]]]] = field(
        default_factory=list
    )
    # the charge (cost / weight) each dispatch made, and the op index it happened at
    charges: list[tuple[int, str, Fraction]] = field(default_factory=list)
    max_charge: dict[str, Fraction] = field(default_factory=dict)
    # what a flow's requests in flight may owe at most: the most it had running at once times
    # its largest debt ((actual − cost) / weight) of one request
    max_running: dict[str, int] = field(default_factory=dict)
    max_debt: dict[str, Fraction] = field(default_factory=dict)
    # and what they may be owed back: its largest refund ((cost − actual) / weight) of one
    max_refund: dict[str, Fraction] = field(default_factory=dict)

    def owed(self, flow: str) -> Fraction:
        return self.max_running.get(flow, 0) * self.max_debt.get(flow, Fraction(0))

    def owed_back(self, flow: str) -> Fraction:
        return self.max_running.get(flow, 0) * self.max_refund.get(flow, Fraction(0))


def run(queue: QueueLike, ops: list[Op], weights: dict[str, float]) -> Trace:
    """Apply ``ops`` to ``queue``, checking FIFO-within-flow and no loss as it goes."""
    trace = Trace()
    mirror: dict[str, deque[tuple[int, Fraction]]] = {f: deque() for f in weights}
    costs: dict[int, float] = {}
    running: dict[str, list[int]] = {f: [] for f in weights}
    ineligible: set[str] = set()
    for index, op in enumerate(ops):
        kind = op[0]
        if kind in ("push", "front"):
            _, flow, cost = op
            charge = Fraction(cost) / Fraction(weights[flow])
            front = kind == "front"
            queue.push(flow, index, cost, weights[flow], front=front)
            costs[index] = cost
            (mirror[flow].appendleft if front else mirror[flow].append)((index, charge))
            trace.max_charge[flow] = max(trace.max_charge.get(flow, Fraction(0)), charge)
        elif kind == "pop":
            got = queue.pop()
            ready = [f for f, q in mirror.items() if q and f not in ineligible]
            assert (got is None) == (not ready), f"pop returned {got} with ready={ready}"
            if got is not None:
                flow, item = got
                expected, charge = mirror[flow].popleft()
                assert item == expected, f"flow {flow} not FIFO: got {item}, head {expected}"
                trace.dispatches.append(got)
                trace.charges.append((index, flow, charge))
                running[flow].append(item)
                trace.max_running[flow] = max(trace.max_running.get(flow, 0), len(running[flow]))
        elif kind == "settle":
            _, flow, k, actual = op
            if running[flow]:
                item = running[flow].pop(k % len(running[flow]))
                queue.settle(flow, costs[item], actual)
                if actual is not None:
                    debt = (Fraction(actual) - Fraction(costs[item])) / Fraction(weights[flow])
                    trace.max_debt[flow] = max(trace.max_debt.get(flow, Fraction(0)), debt)
                    refund = -debt
                    trace.max_refund[flow] = max(trace.max_refund.get(flow, Fraction(0)), refund)
        elif kind == "remove":
            _, flow, k = op
            if mirror[flow]:
                item, _ = mirror[flow][k % len(mirror[flow])]
                assert queue.remove(flow, item)
                mirror[flow].remove(next(e for e in mirror[flow] if e[0] == item))
            else:
                assert not queue.remove(flow, -1)
        else:
            _, flow, ok = op
            queue.set_eligible(flow, ok)
            (ineligible.discard if ok else ineligible.add)(flow)
        assert len(queue) == sum(len(q) for q in mirror.values())
        trace.states.append(
            (
                Fraction(queue.virtual_time),
                {
                    f: (len(q), f not in ineligible, Fraction(queue.meter(f)))
                    for f, q in mirror.items()
                },
            )
        )
    return trace


def check_band(trace: Trace) -> None:
    """Every eligible backlogged meter lies in [v − what its requests in flight may be owed
    back, v + its largest charge + what they may owe]; v never falls."""
    previous_v = Fraction(0)
    for step, (v, flows) in enumerate(trace.states):
        assert v >= previous_v, f"step {step}: v went back from {previous_v} to {v}"
        previous_v = v
        for flow, (backlog, eligible, meter) in flows.items():
            if backlog and eligible:
                hi = v + trace.max_charge[flow] + trace.owed(flow)
                lo = v - trace.owed_back(flow)
                assert lo <= meter <= hi, f"step {step}: {flow} meter {meter} outside [{lo}, {hi}]"


def check_pairwise(trace: Trace) -> None:
    """Two flows eligible and backlogged over an interval: served/weight within the bound.

    For every maximal run of steps where both are, the largest swing of the difference of
    what their meters were charged (dispatches and true-ups) over any sub-interval must stay
    within ``cmax + owed + owed back`` of each (docs/design.md §3, The fairness guarantee).
    While a flow stays backlogged and eligible its meter moves by its charges alone, so the
    difference of the meters is the difference of the charges plus a constant.
    """
    flows = sorted(trace.max_charge)
    for a_pos, a in enumerate(flows):
        for b in flows[a_pos + 1 :]:
            bound = sum(trace.max_charge[f] + trace.owed(f) + trace.owed_back(f) for f in (a, b))
            lo = hi = Fraction(0)
            base: Fraction | None = None
            for step, (_, state) in enumerate(trace.states):
                if not all(state[f][0] and state[f][1] for f in (a, b)):
                    base = None
                    continue
                gap = state[a][2] - state[b][2]
                if base is None:  # a new interval opens after this step
                    base, lo, hi = gap, Fraction(0), Fraction(0)
                lo, hi = min(lo, gap - base), max(hi, gap - base)
                assert hi - lo <= bound, f"{a} vs {b}: swing {hi - lo} > {bound} by step {step}"
