"""The pool's dispatch rules, in memory and in Redis, make the same decisions.

The in-memory ``Scheduler`` (``core/scheduler.py`` over ``FairQueue`` and ``Placement``) is
the reference; ``dispatch.lua`` through ``RedisDispatch`` must agree with it. Both are fed
the same operation sequences (submit, finish, cancel), drawn by hypothesis, and after every
operation they must have dispatched the same tickets to the same backends in the same order
and answered every cancel alike; at the end they hold the same number of queued tickets and
the same virtual time. What is proven that way:

1. SFQ over random flows, weights and costs (charges at dispatch, the true-up at each finish
   to an actual cost the estimate knows nothing of, or none, joins at max(S, v), ties by flow
   id, the reset once nothing waits and nothing runs), with least-loaded placement over 1–3
   backends whose slots Redis never exceeds;
2. the same with org and class in-flight caps (no class ever runs over its cap);
3. the same with strict-band priority tickets mixed in, their class capped;
4. two holders on one pool form one fairness domain: the grants of both (returned by the
   call, or found in the other holder's inbox) come in the order of one in-memory scheduler;
5. fencing: a holder whose heartbeat stopped loses its leases and queued tickets to the next
   heartbeat of another, its late finish frees nothing, and its next call raises Fenced;
6. equal meters are broken by flow id, and a drained pool starts its next period level;
7. a lease is handed back by its holder only, and never numbered twice, even by a Redis that
   lost its data; ``adopt`` (back after Redis was lost) makes a holder's leases exactly what
   it names;
8. a provider pool's pacing, on Redis's own clock: its buckets (a second's burst, a take
   larger than the bucket leaves it in debt, a refund gives back), and the provider's
   feedback that a holder pushes (a pause that is never shortened, a factor that only goes
   down, and spacing below a factor of 1) hold every holder's dispatch;
9. size buckets inside a flow (docs/design.md §3): the same request of a flow overtakes the
   same older ones, at most K times each, with retries due at once, cancels, caps, the band
   and two holders mixed in, and flows whose buckets a reload turned on or off.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis_server import fcalls

from sfq_proxy.config import BackendSpec, size_bucket
from sfq_proxy.core.affinity import digest
from sfq_proxy.core.limits import Rate
from sfq_proxy.core.placement import Placement
from sfq_proxy.core.scheduler import Scheduler, Ticket
from sfq_proxy.state.redis_dispatch import (
    Fenced,
    Grant,
    Grants,
    RedisDispatch,
    SharedTicket,
    pool_prefix,
)
from sfq_proxy.state.redis_resp import Pipe

pytestmark = pytest.mark.redis

EXAMPLES = 60
LONG_TTL_S = 60.0

Dispatch = tuple[str, str]  # (ticket id, backend name)


# -- scenarios --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flow:
    org: str
    cls: str
    weight: float
    max_overtaken: int | None = None  # size buckets (of BOUNDS) inside the flow; None: a FIFO


@dataclass(frozen=True)
class Submit:
    flow: int  # index into Scenario.flows
    cost: float
    front: bool = False
    priority: bool = False
    holder: int = 0
    key: str | None = None  # its affinity key
    plain: bool = False  # without its flow's size buckets, as after a reload that dropped them

    def sizes(self, flow: Flow) -> dict[str, int | None]:
        """The ticket's ``bucket`` and ``max_overtaken``."""
        if self.plain or self.priority or flow.max_overtaken is None:
            return {}
        return {"bucket": size_bucket(self.cost, BOUNDS), "max_overtaken": flow.max_overtaken}


@dataclass(frozen=True)
class Finish:
    pick: int  # which running ticket (modulo how many run)
    actual: float | None = None  # what it cost, for its flow's true-up; None: unknown


@dataclass(frozen=True)
class Cancel:
    pick: int  # which queued ticket (modulo how many wait); any known one if none waits


@dataclass(frozen=True)
class Toggle:
    pick: int  # which backend (modulo how many) goes down, or comes back up


Op = Submit | Finish | Cancel | Toggle


@dataclass(frozen=True)
class Scenario:
    backends: list[tuple[str, int]]
    flows: list[Flow]
    ops: list[Op]
    org_caps: dict[str, int] = field(default_factory=dict)
    class_caps: dict[str, int] = field(default_factory=dict)
    holders: int = 1
    load_factor: float | None = None  # affinity's, None: off
    slack: int = 0  # affinity's: requests a backend may run above the bound


COSTS = st.one_of(
    st.sampled_from([1.0, 2.5, 7.0, 100.0]),
    st.floats(min_value=0.001, max_value=1e4, allow_nan=False, allow_infinity=False),
)
# what a request really cost, unknown to its estimate: nothing, anything, or no report
ACTUALS = st.none() | st.just(0.0) | COSTS
WEIGHTS = st.sampled_from([0.5, 1.0, 2.0, 4.0])
BOUNDS = [2.0, 50.0]  # size buckets: cost ≤ 2, ≤ 50, above
KS = st.sampled_from([None, 0, 1, 2, 8])
SIZED_COSTS = st.one_of(st.sampled_from([1.0, 2.0, 7.0, 50.0, 100.0]), COSTS)
ORGS = ["a", "b", "c", "d", "e"]
CLASSES = ["x", "y"]
PRIORITY_CLASS = "p"
AFFINITY_KEYS = [digest("p", f"conversation {i}") for i in range(5)]
# factors whose products with (R + 1) round in binary: both sides must round them alike
LOAD_FACTORS = st.one_of(
    st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    st.floats(min_value=1.0, max_value=4.0, allow_nan=False, allow_infinity=False),
)


@st.composite
def scenarios(
    draw: st.DrawFn,
    *,
    caps: bool = False,
    priority: bool = False,
    holders: int = 1,
    affinity: bool = False,
    sized: bool = False,
) -> Scenario:
    """``affinity``: the pool's load factor and slack set, submits with keys (a few, or
    none), and backends going down and up (the caller's ``down``)."""
    slots = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4 if affinity else 3))
    if sized:  # few slots and flows, costs of every bucket: lines form and overtake
        slots = draw(st.lists(st.integers(1, 2), min_size=1, max_size=2))
    backends = [(f"b{i}", n) for i, n in enumerate(slots)]
    pairs = draw(
        st.lists(
            st.tuples(st.sampled_from(ORGS), st.sampled_from(CLASSES)),
            min_size=2,
            max_size=3 if sized else 5,
            unique=True,
        )
    )
    flows = [Flow(org, cls, draw(WEIGHTS), draw(KS) if sized else None) for org, cls in pairs]
    if priority:  # the band's own class, one priority "flow" per org that has any flow
        flows += [Flow(org, PRIORITY_CLASS, 1.0) for org in sorted({o for o, _ in pairs})]
    org_caps: dict[str, int] = {}
    class_caps: dict[str, int] = {}
    if caps:
        orgs = sorted({f.org for f in flows})
        org_caps = draw(st.dictionaries(st.sampled_from(orgs), st.integers(1, 3), max_size=3))
        class_caps = draw(st.dictionaries(st.sampled_from(CLASSES), st.integers(1, 3)))
    if priority:
        class_caps[PRIORITY_CLASS] = draw(st.integers(1, 2))

    def submit(
        index: int, cost: float, front: bool, holder: int, key: str | None, plain: bool
    ) -> Submit:
        priority = flows[index].cls == PRIORITY_CLASS
        return Submit(index, cost, front, priority, holder, key, plain)

    submits = st.builds(
        submit,
        # with size buckets, mostly one flow: its line grows, and overtakes in it
        st.sampled_from([0, 0, 0, *range(len(flows))]) if sized else st.integers(0, len(flows) - 1),
        SIZED_COSTS if sized else COSTS,
        st.sampled_from([False] * (7 if sized else 3) + [True]),  # front now and then
        st.integers(0, holders - 1),
        st.sampled_from([*AFFINITY_KEYS, None]) if affinity else st.none(),
        st.sampled_from([False] * 9 + [True]) if sized else st.just(False),  # a reload's
    )
    ops = st.one_of(
        submits,
        submits,
        st.builds(Finish, st.integers(0, 1000), ACTUALS),
        st.builds(Cancel, st.integers(0, 1000)),
        *([st.builds(Toggle, st.integers(0, 1000))] if affinity else []),
    )
    if sized:  # four submits to two finishes and a cancel, so that lines grow
        kinds = {"s": submits, "f": st.builds(Finish, st.integers(0, 1000), ACTUALS),
                 "c": st.builds(Cancel, st.integers(0, 1000))}  # fmt: skip
        ops = st.sampled_from("ssssffc").flatmap(kinds.__getitem__)
    return Scenario(
        backends=backends,
        flows=flows,
        ops=draw(st.lists(ops, min_size=10 if affinity or sized else 1, max_size=40)),
        org_caps=org_caps,
        class_caps=class_caps,
        holders=holders,
        load_factor=draw(LOAD_FACTORS) if affinity else None,
        slack=draw(st.integers(0, 3)) if affinity else 0,
    )


# -- the two sides, behind the same methods -----------------------------------------------------


class MemorySide:
    """The reference: one in-memory ``Scheduler`` (holders mean nothing to it)."""

    def __init__(self, scenario: Scenario) -> None:
        specs = [BackendSpec(url=f"http://{n}:8000", slots=s, name=n) for n, s in scenario.backends]
        self.scheduler = Scheduler(
            Placement(specs, load_factor=scenario.load_factor, slack=scenario.slack),
            org_caps=scenario.org_caps,
            class_caps=scenario.class_caps,
        )
        self.tickets: dict[str, Ticket] = {}
        self.ids: dict[int, str] = {}  # id(Ticket) → ticket id
        self.reasons: dict[str, str] = {}  # ticket id → why its last dispatch went where it did

    async def submit(self, tid: str, flow: Flow, op: Submit) -> list[Dispatch]:
        ticket = Ticket(
            flow.org, flow.cls, op.cost, flow.weight, priority=op.priority, affinity=op.key,
            **op.sizes(flow),
        )  # fmt: skip
        self.tickets[tid] = ticket
        self.ids[id(ticket)] = tid
        return self._named(self.scheduler.submit(ticket, 0.0, front=op.front))

    async def finish(self, tid: str, actual: float | None = None) -> list[Dispatch]:
        return self._named(self.scheduler.finish(self.tickets[tid], 0.0, actual))

    async def cancel(self, tid: str) -> bool:
        return self.scheduler.cancel(self.tickets[tid])

    async def toggle(self, index: int) -> list[Dispatch]:
        """Backend ``index`` goes down, or comes back up; then what capacity allows."""
        placement = self.scheduler.placement
        backend = placement.backends[index]
        if backend.healthy:
            placement.mark_down(backend, until=0.0)
        else:
            placement.mark_up(backend, now=0.0)
        return self._named(self.scheduler.pump(0.0))

    async def queued(self) -> int:
        return self.scheduler.queued()

    async def virtual_time(self) -> float:
        return self.scheduler.queue.virtual_time  # type: ignore[attr-defined]

    def _named(self, dispatched: list[Ticket]) -> list[Dispatch]:
        out = []
        for ticket in dispatched:
            assert ticket.backend is not None
            out.append((self.ids[id(ticket)], ticket.backend.name))
            self.reasons[self.ids[id(ticket)]] = ticket.placed
        return out


class RedisSide:
    """``dispatch.lua`` through one ``RedisDispatch`` per holder, all on one fresh pool.

    A call's grants are its own holder's; the other holders' grants of the same call are
    read from their inboxes, and the lease numbers (one counter per pool) put them back in
    the order the script made them.
    """

    def __init__(self, client: Redis, scenario: Scenario, pipe: Pipe) -> None:
        self.client = client
        self.scenario = scenario
        self.pool = f"conf-{uuid.uuid4().hex}"
        self.prefix = pool_prefix(self.pool)
        self.holders = [
            RedisDispatch(client, self.pool, f"h{i}", pipe) for i in range(scenario.holders)
        ]  # the function calls go through the proxy's own hot path
        self.owner: dict[str, int] = {}  # ticket id → holder index
        self.leases: dict[str, str] = {}  # running ticket id → lease
        self.running: Counter[str] = Counter()  # backend → leases held, from the grants
        self.class_running: Counter[str] = Counter()
        self.classes: dict[str, str] = {}  # ticket id → class
        self.backend_of: dict[str, str] = {}  # granted ticket id → backend
        self.reasons: dict[str, str] = {}  # ticket id → why its last grant went where it did
        self.down: set[str] = set()  # the backends every caller holds down

    async def start(self) -> None:
        for holder in self.holders:
            assert await holder.heartbeat(LONG_TTL_S, new=True) == []
        s = self.scenario
        grants = await self.holders[0].configure(
            s.backends, s.org_caps, s.class_caps, load_factor=s.load_factor, slack=s.slack
        )
        assert grants == []

    async def submit(self, tid: str, flow: Flow, op: Submit) -> list[Dispatch]:
        self.owner[tid] = op.holder
        self.classes[tid] = flow.cls
        shared = SharedTicket(
            flow.org, flow.cls, op.cost, flow.weight, priority=op.priority, affinity=op.key,
            **op.sizes(flow),
        )  # fmt: skip
        submit = self.holders[op.holder].submit
        return await self._granted(
            op.holder, await submit(tid, shared, front=op.front, down=sorted(self.down))
        )

    async def toggle(self, index: int) -> list[Dispatch]:
        name = self.scenario.backends[index][0]
        self.down ^= {name}
        return await self._granted(0, await self.holders[0].pump(sorted(self.down)))

    async def finish(self, tid: str, actual: float | None = None) -> list[Dispatch]:
        holder = self.owner[tid]
        lease = self.leases.pop(tid)
        # the backend and class it ran on are freed before the call's own grants count
        self.running[self.backend_of[tid]] -= 1
        self.class_running[self.classes[tid]] -= 1
        finish = self.holders[holder].finish
        return await self._granted(holder, await finish(lease, sorted(self.down), actual=actual))

    async def cancel(self, tid: str) -> bool:
        return await self.holders[self.owner[tid]].cancel(tid)

    async def queued(self) -> int:
        return int(await self.client.hlen(self.prefix + "ticket"))

    async def virtual_time(self) -> float:
        v, offset = await self.client.hmget(self.prefix + "meta", ["v", "offset"])
        return (int(float(v or 0)) + int(float(offset or 0))) / (1 << 20)

    async def inflight(self) -> dict[str, int]:
        raw = await self.client.hgetall(self.prefix + "inflight")
        return {k.decode(): int(n) for k, n in raw.items() if int(n)}

    async def _granted(self, caller: int, grants: list[Grant]) -> list[Dispatch]:
        """The call's grants and every other holder's new inbox entries, in lease order."""
        assert all(self.owner[g.ticket] == caller for g in grants)
        for index, holder in enumerate(self.holders):
            key = f"{self.prefix}inbox:{holder.holder}"
            if await self.client.llen(key):
                mail = await holder.inbox(0.01)
                assert all(self.owner[g.ticket] == index for g in mail)
                grants = grants + mail
        grants.sort(key=lambda g: int(g.lease))
        for grant in grants:
            self.leases[grant.ticket] = grant.lease
            self.backend_of[grant.ticket] = grant.backend
            self.reasons[grant.ticket] = grant.reason
            self.running[grant.backend] += 1
            self.class_running[self.classes[grant.ticket]] += 1
        slots = dict(self.scenario.backends)
        assert all(self.running[b] <= slots[b] for b in self.running), self.running
        caps = self.scenario.class_caps
        assert all(n <= caps[c] for c, n in self.class_running.items() if c in caps)
        return [(g.ticket, g.backend) for g in grants]


# -- the driver ---------------------------------------------------------------------------------


@dataclass
class Trace:
    """What the reference did so far: which tickets run (in dispatch order) and which wait."""

    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def dispatched(self, dispatches: list[Dispatch]) -> None:
        for tid, _ in dispatches:
            self.waiting.remove(tid)
            self.running.append(tid)


@dataclass
class Planned:
    """An operation done by the reference, and the same one for Redis, not yet sent."""

    expected: list[Dispatch] | bool  # its dispatches, or for a cancel whether it cancelled
    redis: Coroutine[Any, Any, list[Dispatch] | bool]
    log: str


async def plan(
    step: int, op: Op, scenario: Scenario, memory: MemorySide, shared: RedisSide, trace: Trace,
    finishable: list[str],
) -> Planned | None:  # fmt: skip
    """``op`` done by the reference (``finishable``: the running tickets it may finish);
    None when there is nothing to do it to."""
    if isinstance(op, Submit):
        tid = f"t{step}"
        trace.known.append(tid)
        trace.waiting.append(tid)
        flow = scenario.flows[op.flow]
        expected = await memory.submit(tid, flow, op)
        done = Planned(expected, shared.submit(tid, flow, op), f"submit {tid} {flow} {op}")
    elif isinstance(op, Finish):
        if not finishable:
            return None
        tid = finishable.pop(op.pick % len(finishable))
        trace.running.remove(tid)
        done = Planned(
            await memory.finish(tid, op.actual),
            shared.finish(tid, op.actual),
            f"finish {tid} at {op.actual}",
        )
    elif isinstance(op, Toggle):
        index = op.pick % len(scenario.backends)
        name = scenario.backends[index][0]
        done = Planned(await memory.toggle(index), shared.toggle(index), f"toggle {name}")
    else:
        pool = trace.waiting or trace.known
        if not pool:
            return None
        tid = pool[op.pick % len(pool)]
        cancelled = await memory.cancel(tid)
        if cancelled:
            trace.waiting.remove(tid)
        return Planned(cancelled, shared.cancel(tid), f"cancel {tid} -> {cancelled}")
    assert isinstance(done.expected, list)
    trace.dispatched(done.expected)
    done.log += f" -> {done.expected}"
    return done


async def conform(redis_url: str, scenario: Scenario, wave: int = 1) -> list[Dispatch]:
    """Apply the scenario's operations to both sides, comparing them after each one;
    returns every dispatch, in order. ``wave`` > 1: Redis is sent that many operations at
    once, which its holder's ``Batcher`` sends as one call after the first (the reference
    does them one by one); they may finish only what ran before them."""
    client, pipe = Redis.from_url(redis_url), Pipe.from_url(redis_url)
    assert pipe is not None
    try:
        memory, shared = MemorySide(scenario), RedisSide(client, scenario, pipe)
        await shared.start()
        trace = Trace()
        everything: list[Dispatch] = []
        for first in range(0, len(scenario.ops), wave):
            finishable = list(trace.running)
            planned = []
            for step in range(first, min(first + wave, len(scenario.ops))):
                op = scenario.ops[step]
                done = await plan(step, op, scenario, memory, shared, trace, finishable)
                if done is not None:
                    planned.append(done)
                    trace.log.append(done.log)
            got = await asyncio.gather(*(done.redis for done in planned))
            for done, reply in zip(planned, got, strict=True):
                assert reply == done.expected, (*trace.log, f"redis: {done.log} gave {reply}")
                if isinstance(reply, list):
                    everything += reply
            assert shared.reasons == memory.reasons, trace.log  # affinity, overflow, fallback
            assert await shared.inflight() == {b: n for b, n in shared.running.items() if n}
        assert await shared.queued() == await memory.queued() == len(trace.waiting)
        assert await shared.virtual_time() == await memory.virtual_time(), trace.log
        return everything
    finally:
        await client.aclose()
        await pipe.aclose()


def run(redis_url: str, scenario: Scenario, wave: int = 1) -> None:
    asyncio.run(conform(redis_url, scenario, wave))


PROPERTY = settings(
    max_examples=EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(scenario=scenarios())
def test_sfq_and_placement_conform(redis_url: str, scenario: Scenario) -> None:
    run(redis_url, scenario)


@PROPERTY
@given(scenario=scenarios(caps=True))
def test_in_flight_caps_conform(redis_url: str, scenario: Scenario) -> None:
    run(redis_url, scenario)


@PROPERTY
@given(scenario=scenarios(caps=True, priority=True))
def test_priority_band_conforms(redis_url: str, scenario: Scenario) -> None:
    run(redis_url, scenario)


@PROPERTY
@given(scenario=scenarios(caps=True, holders=2))
def test_two_holders_are_one_fairness_domain(redis_url: str, scenario: Scenario) -> None:
    run(redis_url, scenario)


@PROPERTY
@given(scenario=scenarios(affinity=True))
def test_affinity_places_alike(redis_url: str, scenario: Scenario) -> None:
    """Keys, load factors (odd floats too), slacks, backends going down and up: the same backend,
    for the same reason, on both sides."""
    run(redis_url, scenario)


@pytest.mark.parametrize("slack", [0, 1])
def test_the_slack_keeps_a_key_on_its_first_choice_alike(redis_url: str, slack: int) -> None:
    """Two backends of 3 slots, one key three times at a load factor of 1: without slack its
    second request is over ⌈1 · 2 · 3 / 6⌉ = 1 and goes down its order; a slack of 1 keeps
    all three on its first choice, on both sides (random scenarios rarely pile one key up)."""
    key = AFFINITY_KEYS[0]
    scenario = Scenario(
        backends=[("b0", 3), ("b1", 3)],
        flows=[Flow("a", "x", 1.0)],
        ops=[Submit(0, 1.0, key=key) for _ in range(3)],
        load_factor=1.0,
        slack=slack,
    )
    placed = asyncio.run(conform(redis_url, scenario))
    assert len({backend for _, backend in placed}) == (1 if slack else 2)


@PROPERTY
@given(scenario=scenarios(caps=True, priority=True, holders=2, affinity=True))
def test_affinity_with_caps_band_and_two_holders_places_alike(
    redis_url: str, scenario: Scenario
) -> None:
    run(redis_url, scenario)


SIZED = settings(
    max_examples=3 * EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # overtakes need lines that grow: more examples find the cases at the edge of K


@SIZED
@given(scenario=scenarios(sized=True))
def test_size_buckets_conform(redis_url: str, scenario: Scenario) -> None:
    run(redis_url, scenario)


@SIZED
@given(scenario=scenarios(sized=True, caps=True, priority=True, holders=2))
def test_size_buckets_with_caps_band_and_two_holders_conform(
    redis_url: str, scenario: Scenario
) -> None:
    run(redis_url, scenario)


@PROPERTY
@given(scenario=scenarios(caps=True, priority=True, affinity=True), wave=st.integers(2, 8))
def test_calls_sent_together_conform(redis_url: str, scenario: Scenario, wave: int) -> None:
    """Under load a holder's calls leave as one (``state/redis_batcher.py``, dispatch.lua's
    ``batch``): each decides as it would have on its own, in the order they were made."""
    run(redis_url, scenario, wave)


@SIZED
@given(scenario=scenarios(sized=True, caps=True, priority=True), wave=st.integers(2, 8))
def test_size_buckets_sent_together_conform(redis_url: str, scenario: Scenario, wave: int) -> None:
    run(redis_url, scenario, wave)


# -- targeted examples ------------------------------------------------------------------------


async def test_calls_made_while_one_is_on_its_way_leave_as_one(redis_url: str) -> None:
    """Twenty submits at once: the first leaves on its own, the other nineteen in one call
    when it lands, each granted or queued as it would have been on its own."""
    client, pipe = Redis.from_url(redis_url), Pipe.from_url(redis_url)
    assert pipe is not None
    try:
        pool = f"batch-{uuid.uuid4().hex}"
        holder = RedisDispatch(client, pool, "h0", pipe)
        await holder.heartbeat(LONG_TTL_S, new=True)
        await holder.configure([("b0", 5)], {}, {})
        calls_before = await fcalls(client)
        ticket = SharedTicket("a", "x", 1.0, 1.0)
        submits = [holder.submit(f"t{i}", ticket) for i in range(20)]
        grants = await asyncio.gather(*submits)
        assert await fcalls(client) - calls_before == 2
        assert [[g.ticket for g in granted] for granted in grants] == [
            [f"t{i}"] if i < 5 else [] for i in range(20)
        ]  # five slots: the first five in order, the rest queued behind them
        assert await client.hlen(pool_prefix(pool) + "ticket") == 15
    finally:
        await client.aclose()
        await pipe.aclose()


async def test_tie_by_flow_id_and_global_idle_reset(redis_url: str) -> None:
    """One slot. ``b/x`` queues before ``a/x`` at the same meter: ``a/x`` goes first. Once
    nothing waits and nothing runs, the next busy period starts level; but a request that
    runs keeps its busy period open: ``a/x``, charged 100 by one that went straight into the
    free slot, waits behind ``b/x`` for it (docs/design.md §3 rule 4)."""
    flows = [Flow("a", "x", 1.0), Flow("b", "x", 1.0), Flow("c", "x", 1.0)]
    a, b, c = 0, 1, 2
    ops: list[Op] = [
        Submit(c, 1.0),  # t0 takes the slot
        Submit(b, 1.0),  # t1 waits at meter v
        Submit(a, 1.0),  # t2 waits at meter v too: a/x < b/x
        Finish(0),  # t0 done: t2 (a/x) goes, not t1
        Finish(0),  # t2 done: t1
        Finish(0),  # t1 done: nothing waits, nothing runs: v = 2 (the reset)
        Submit(a, 100.0),  # t6 runs at once: a charged 100 (a at 102), the queue empty
        Submit(b, 1.0),  # t7 waits at v = 2, not at b's old meter
        Submit(a, 1.0),  # t8 waits at a's 102: t6 still runs, its charge is remembered
        Finish(0),  # t6 done: t7
        Finish(0),  # t7 done: t8
    ]
    scenario = Scenario(backends=[("b0", 1)], flows=flows, ops=ops)
    dispatches = await conform(redis_url, scenario)
    assert [tid for tid, _ in dispatches] == ["t0", "t2", "t1", "t6", "t7", "t8"]


async def test_short_requests_overtake_long_ones_of_their_flow_at_most_k_times(
    redis_url: str,
) -> None:
    """One slot, flow a with size buckets and K = 2: two long requests queue behind the
    blocker, then three short ones. The first two short ones go before both long ones,
    which are then due; a retry put back at the head goes before everything of its flow.
    Both sides agree, dispatch by dispatch."""
    flows = [Flow("a", "x", 1.0, max_overtaken=2), Flow("b", "x", 1.0)]
    a, b = 0, 1
    ops: list[Op] = [
        Submit(b, 1.0),  # t0 takes the slot
        Submit(a, 100.0),  # t1 long
        Submit(a, 100.0),  # t2 long
        Submit(a, 1.0),  # t3 short
        Submit(a, 1.0),  # t4 short
        Submit(a, 1.0),  # t5 short
        Finish(0),  # t0 done: t3 overtakes t1 and t2
        Finish(0),  # t3 done: t4 overtakes them again (twice each now)
        Submit(a, 100.0, front=True),  # t8: a retry, due at once
        Finish(0),  # t4 done: t8
        Finish(0),  # t8 done: t1 (overtaken twice: due)
        Finish(0),  # t1 done: t2 (due too)
        Finish(0),  # t2 done: t5
    ]
    scenario = Scenario(backends=[("b0", 1)], flows=flows, ops=ops)
    dispatches = await conform(redis_url, scenario)
    assert [tid for tid, _ in dispatches] == ["t0", "t3", "t4", "t8", "t1", "t2", "t5"]


async def test_a_cost_keeps_every_digit(redis_url: str) -> None:
    """A cost is charged to the unit as Python rounds the float it was given. Here b/x's
    charge lands on a half unit (1048576.5, rounded to even: 1048576), one unit under a/x's
    (1048577), so b/x's next request goes before a/x's; charged one unit more (the cost cut
    to 1.0000004768372) b/x would tie with a/x and lose the tie by flow id."""
    flows = [Flow("a", "x", 1.0), Flow("b", "x", 1.0), Flow("c", "x", 1.0)]
    a, b, c = 0, 1, 2
    ops: list[Op] = [
        Submit(c, 1.0),  # t0 takes the one slot
        Submit(a, 1 + 2**-20),  # t1: charged 1048577 units
        Submit(b, 1 + 2**-21),  # t2: charged round(1048576.5) = 1048576 units
        Submit(a, 1.0),  # t3
        Submit(b, 1.0),  # t4
        Finish(0),  # t0 done: t1 (a/x and b/x tie at v, a/x first)
        Finish(0),  # t1 done: t2
        Finish(0),  # t2 done: b/x is a unit behind a/x, so t4
    ]
    scenario = Scenario(backends=[("b0", 1)], flows=flows, ops=ops)
    dispatches = await conform(redis_url, scenario)
    assert [tid for tid, _ in dispatches] == ["t0", "t1", "t2", "t4"]


async def test_a_stale_holder_is_fenced(redis_url: str) -> None:
    """A holder whose heartbeat stopped is reaped by another's heartbeat: its slot goes to
    the next in line, its queued tickets are gone, its old lease frees nothing, and every
    call it makes from then on raises Fenced."""
    client = Redis.from_url(redis_url)
    try:
        pool = f"fence-{uuid.uuid4().hex}"
        inflight = pool_prefix(pool) + "inflight"
        stale, live, late = (RedisDispatch(client, pool, h) for h in ("stale", "live", "late"))
        assert await stale.heartbeat(0.3, new=True) == []
        assert await live.heartbeat(LONG_TTL_S, new=True) == []
        assert await live.configure([("b0", 1)], {}, {}) == []

        (held,) = await stale.submit("s1", SharedTicket("a", "x", 1.0, 1.0))
        assert held.backend == "b0"
        assert await stale.submit("s2", SharedTicket("a", "x", 1.0, 1.0)) == []
        assert await live.submit("l1", SharedTicket("b", "x", 1.0, 1.0)) == []
        assert await live.inbox(0.01) == []

        await asyncio.sleep(0.45)
        (granted,) = await live.heartbeat(LONG_TTL_S)  # reaps stale: its slot comes back
        assert (granted.ticket, granted.backend) == ("l1", "b0")  # s2 was dropped, not granted
        assert int(await client.hget(inflight, "b0")) == 1

        assert await live.finish(held.lease) == []  # a reclaimed lease frees nothing
        assert int(await client.hget(inflight, "b0")) == 1
        assert await live.cancel("s2") is False  # the stale holder's queue is gone

        with pytest.raises(Fenced):
            await stale.finish(held.lease)
        with pytest.raises(Fenced):
            await stale.heartbeat(0.3)
        with pytest.raises(Fenced):
            await stale.submit("s3", SharedTicket("a", "x", 1.0, 1.0))
        assert int(await client.hget(inflight, "b0")) == 1

        # the slot is l1's alone: a newcomer waits until l1's lease is handed back
        assert await late.heartbeat(LONG_TTL_S, new=True) == []
        assert await late.submit("n1", SharedTicket("c", "x", 1.0, 1.0)) == []
        assert await live.finish(granted.lease) == []  # n1 is late's: it goes to late's inbox
        (mail,) = await late.inbox(0.5)
        assert (mail.ticket, mail.backend) == ("n1", "b0")
        assert int(await client.hget(inflight, "b0")) == 1
        assert await late.finish(mail.lease) == []
        assert int(await client.hget(inflight, "b0")) == 0
    finally:
        await client.aclose()


async def joined(
    client: Redis, pool: str, *holders: str, slots: int = 8, rate: Rate | None = None
) -> list[RedisDispatch]:
    """``holders`` registered on ``pool``, whose one backend has ``slots`` (at ``rate``)."""
    dispatches = [RedisDispatch(client, pool, h) for h in holders]
    for holder in dispatches:
        await holder.heartbeat(LONG_TTL_S, new=True)
    assert await dispatches[0].configure([("b0", slots)], {}, {}, rate=rate) == []
    return dispatches


async def test_a_lease_is_freed_by_its_holder_only_and_never_numbered_twice(
    redis_url: str,
) -> None:
    """Fencing names the exact lease: another holder's finish of it frees nothing, and a
    Redis that lost its data (FLUSHALL, as a restart without persistence does) numbers its
    new leases past every old one, so that a late finish of an old lease frees no new one."""
    client = Redis.from_url(redis_url)
    try:
        pool = f"numbers-{uuid.uuid4().hex}"
        inflight = pool_prefix(pool) + "inflight"
        a, b = await joined(client, pool, "a", "b", slots=2)
        (old,) = await a.submit("a1", SharedTicket("a", "x", 1.0, 1.0))
        assert await b.finish(old.lease) == []  # not b's to hand back
        assert int(await client.hget(inflight, "b0")) == 1

        await client.flushall()
        a, b = await joined(client, pool, "a", "b", slots=2)
        (new,) = await b.submit("b1", SharedTicket("b", "x", 1.0, 1.0))
        assert int(new.lease) > int(old.lease)
        assert await a.finish(old.lease) == []
        assert int(await client.hget(inflight, "b0")) == 1
    finally:
        await client.aclose()


async def test_adopt_makes_a_holders_leases_what_it_runs(redis_url: str) -> None:
    """Back after Redis was lost, a holder names what it runs: those become its leases,
    counted against the slots even beyond them, its old leases and queued tickets go, and
    the reply says for how long the pool has been calm (no holder reaped, no state lost)."""
    client = Redis.from_url(redis_url)
    try:
        pool = f"adopt-{uuid.uuid4().hex}"
        inflight = pool_prefix(pool) + "inflight"
        a, b = await joined(client, pool, "a", "b", slots=2)
        await a.heartbeat(LONG_TTL_S)
        assert a.holders == ["a", "b"]  # the live ones, as the last heartbeat saw them
        granted = [
            g for i in range(2) for g in await a.submit(f"a{i}", SharedTicket("a", "x", 1.0, 1.0))
        ]
        assert len(granted) == 2
        assert await a.submit("a2", SharedTicket("a", "x", 1.0, 1.0)) == []
        assert await b.submit("b1", SharedTicket("b", "x", 1.0, 1.0)) == []

        leases, calm_s = await a.adopt(LONG_TTL_S, [("b0", "a", "x")] * 3)  # 3 on 2 slots
        assert len(leases) == 3
        assert 0 <= calm_s < 5
        assert int(await client.hget(inflight, "b0")) == 3
        assert await a.cancel("a2") is False  # its queued ticket went
        for old in granted:
            assert await a.finish(old.lease) == []  # freed by the adopt already
        assert await a.finish(leases[0]) == []  # 2 run: b1 still waits
        assert await a.finish(leases[1]) == []  # 1 runs: b1 goes, to b's inbox
        (mail,) = await b.inbox(0.5)
        assert (mail.ticket, mail.backend) == ("b1", "b0")
        assert int(await client.hget(inflight, "b0")) == 2
    finally:
        await client.aclose()


# -- pacing: a provider pool's rate and its provider's feedback ---------------------------------

TICK_S = 0.05  # what Redis's clock may have moved between two calls here


def held_for(grants: Grants, expected_s: float) -> bool:
    """A reply that granted nothing because pacing held its ticket back ``expected_s`` (as of
    Redis's now, a little after ours)."""
    wake_s = grants.wake_s
    return grants == [] and wake_s is not None and expected_s - TICK_S <= wake_s <= expected_s


async def paced_pool(client: Redis, rate: Rate | None, *holders: str) -> list[RedisDispatch]:
    """A fresh pool of 8 slots at ``rate``, with ``holders`` registered."""
    return await joined(client, f"paced-{uuid.uuid4().hex}", *holders, rate=rate)


def tokens(amount: float) -> SharedTicket:
    """A request of flow a/x estimated at ``amount`` tokens."""
    return SharedTicket("a", "x", 1.0, 1.0, tokens=amount)


async def test_the_rate_paces_every_holder_on_redis_clock(redis_url: str) -> None:
    """120 requests a minute, a second's burst: 2 go at once, the third waits half a second
    whoever submits it. 600 tokens a minute (10 at once): a take of 25, more than the
    bucket, waits for a full one and leaves it 15 in debt, so the next token waits 1.6 s.
    60 requests a minute: a refund gives back what a refused request took."""
    client = Redis.from_url(redis_url)
    try:
        a, b = await paced_pool(client, Rate.of(120, 600, burst_s=1.0), "a", "b")
        first = await a.submit("a1", tokens(1))
        second = await b.submit("b1", tokens(1))
        assert len(first) == len(second) == 1
        assert first.wake_s is second.wake_s is None
        held = await b.submit("b2", tokens(1))
        assert held_for(held, 0.5)
        beat = await a.heartbeat(LONG_TTL_S)  # dispatches too: the same wait
        assert held_for(beat, 0.5)
        await asyncio.sleep(0.5)
        assert await a.pump() == []  # b2 is b's: it goes to b's inbox
        assert (await b.inbox(0.5))[0].ticket == "b2"

        c, d = await paced_pool(client, Rate.of(None, 600, burst_s=1.0), "c", "d")
        assert len(await c.submit("c1", tokens(5))) == 1  # 5 of 10 left
        big = await d.submit("d1", tokens(25))  # more than the bucket: waits for a full one
        assert held_for(big, 0.5)
        await asyncio.sleep(0.5)
        assert len(await d.pump()) == 1  # it goes, and leaves the bucket 15 in debt
        small = await c.submit("c2", tokens(1))
        assert held_for(small, 1.6)

        e, f = await paced_pool(client, Rate.of(60, None, burst_s=1.0), "e", "f")
        (ran,) = await e.submit("e1", tokens(1))
        waits = await f.submit("f1", tokens(1))
        assert held_for(waits, 1.0)
        refunded = await e.finish(ran.lease, refund=1.0)  # its request goes back: f1 goes
        assert refunded == []
        assert refunded.wake_s is None
        assert (await f.inbox(0.5))[0].ticket == "f1"
    finally:
        await client.aclose()


async def test_a_holders_throttle_holds_every_holder(redis_url: str) -> None:
    """Holder a's provider said 429 (retry in 0.4 s): a pushes the pause and its halved
    factor. Holder b's ticket waits for the pause; a shorter pause or a higher factor pushed
    later changes nothing. After the pause, at 60 requests a minute and a factor of 0.5,
    dispatches are spaced 2 s apart although the bucket would allow one a second."""
    client = Redis.from_url(redis_url)
    try:
        a, b = await paced_pool(client, Rate.of(60, None, burst_s=1.0), "a", "b")
        await a.throttle(0.4, 0.5, 0.05)
        await a.throttle(0.1, 0.8, 0.05)  # neither shortens the pause nor raises the factor
        held = await b.submit("b1", tokens(1))
        assert held_for(held, 0.4)
        await asyncio.sleep(0.4)
        (granted,) = await b.pump()
        assert granted.ticket == "b1"
        spaced = await a.submit("a1", tokens(1))
        assert held_for(spaced, 2.0)  # 1 s at half the rate

        unpaced = await paced_pool(client, None, "c")  # a pool without a rate: paused only
        await unpaced[0].throttle(0.3, 0.5, 0.05)
        paused = await unpaced[0].submit("c1", tokens(1))
        assert held_for(paused, 0.3)
    finally:
        await client.aclose()
