"""Discrete-event simulation of a pool in virtual time, through the proxy's own scheduling code.

What decides is exactly what decides in the proxy: a ``Scheduler`` (strict band, in-flight
caps, rate pacing) with the policy under test as its queue (``core/queues.py``; SFQ is the
proxy's ``FairQueue``), ``Placement`` over the scenario's backends (least loaded healthy
backend with a free slot), and a ``CostModel`` built from the scenario's cost section with
``Calibration`` at the proxy's default settings, so a request is charged what the proxy
would charge it (the floor of 1, ``output_ratio``, and what calibration has learned from the
usage of the requests completed before it arrived). When a request ends, the scheduler is
told what it really cost (``CostModel.actual`` of the tokens the engine read and generated,
hidden prompt tokens included), as the proxy's handler tells it from the backend's usage, and
the fair queue trues its charge up (docs/design.md §3); ``true_up=False`` tells it nothing
(``actual=None``: the estimate stands), as for a backend that reports no usage.

Only time is simulated: arrivals and completions are events in a heap, and the time is
passed to the scheduler. A request's service time comes from the one engine model
(``sim/engine.py``), fixed when it starts from the batch it joins on its backend. Requests
arriving at the same instant are submitted interleaved across teams
(``Scenario.arrival_order``). A team whose class has size buckets gets tickets with its
bucket and ``max_overtaken``, as the proxy's handler makes them (docs/design.md §3); a
policy may ignore them (``sfq-fifo``, the baselines). Same scenario and policy in, same
records out: there is no randomness here.

With the pool's ``dispatch.mode: engine`` placement also asks each backend's engine gate,
the core's ``EngineGate`` (``gates.py``): every ``dispatch.interval_s`` a reading of each
engine is taken and arrives ``scrape_delay_s`` later (the first arrives at 0: the proxy
reads its engines from its start, before any request), then the scheduler dispatches what
the gates now admit, as the proxy tries again at a reading.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from ..config import BackendSpec, CalibrationSpec, CostSpec, size_bucket
from ..core.calibration import Calibration
from ..core.cost import CostModel, Estimate
from ..core.engine_metrics import EngineReading
from ..core.inference_request import InferenceRequest, Kind
from ..core.placement import Placement
from ..core.queues import DispatchQueue
from ..core.scheduler import Scheduler, Ticket
from ..sim.engine import Changes, EngineRequest
from .gates import equip, observe, reading_of
from .scenario import PoolModel, Request, Scenario, Served

__all__ = [
    "POOL",
    "EngineSample",
    "actual_cost",
    "cost_model",
    "cost_of",
    "inference_request",
    "service_time",
    "simulate",
]

POOL = "lab"  # the pool's name, in the simulator as in the proxy config of a real run
# at one instant: completions, then tokens taking cache, then a scrape asked (it sees
# them), then a reading's answer, then pacing, then arrivals
_FINISH, _TOKEN, _SCRAPE, _REREAD, _READING, _PUMP, _ARRIVE = 0, 1, 2, 3, 4, 5, 6


def cost_spec(pool: PoolModel) -> CostSpec:
    """The scenario's cost section as the proxy's pool ``cost`` section."""
    return CostSpec(
        input_weight=pool.input_weight,
        output_weight=pool.output_weight,
        output_ratio=pool.output_ratio,
    )


def cost_model(spec: CostSpec, *, calibrate: bool = True) -> CostModel:
    """The proxy's cost model for a pool's ``spec``, with calibration at the proxy's default
    settings (as ``http/proxy.py`` builds it from an unset ``calibration`` section)."""
    calibration = None
    if calibrate:
        settings = CalibrationSpec()
        calibration = Calibration(
            half_life_requests=settings.half_life_requests,
            min_org_samples=settings.min_org_samples,
            min_pool_samples=settings.min_org_samples,
        )
    return CostModel(spec, pool=POOL, calibration=calibration)


def inference_request(request: Request) -> InferenceRequest:
    """What the proxy parses from the request a real run sends: the prompt counts exactly
    ``input_tokens`` (as token ids here, without building the text) and asks ``max_tokens``."""
    return InferenceRequest(
        kind=Kind.COMPLETION,
        model=POOL,
        stream=False,
        text=None,
        token_ids=request.input_tokens,
        max_tokens=request.max_tokens,
        raw=b"",
    )


def cost_of(request: Request, pool: PoolModel) -> float:
    """The proxy's estimate before any calibration: ``max(1, input_weight·input +
    output_weight·max_tokens·output_ratio)``. (A run charges calibrated estimates: see the
    ``cost`` of its ``Served`` records.)"""
    return cost_model(cost_spec(pool), calibrate=False).estimate(inference_request(request)).cost


def actual_cost(request: Request, costs: CostModel) -> float:
    """What ``request`` really cost: the pool's formula on the tokens the engine reports, its
    whole prompt (what the estimate did not see included) and its output."""
    cost = costs.actual(request.prompt_tokens, request.output_tokens)
    assert cost is not None  # None only without a prompt count
    return cost


def service_time(request: Request, pool: PoolModel, running: int) -> float:
    """Seconds in its slot for ``request`` starting with ``running`` sequences on its backend:
    its whole prompt is prefilled, what the estimate did not see included."""
    return pool.engine.service_seconds(request.prompt_tokens, request.output_tokens, running)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """A backend's engine just after an event that changed it: sequences in its batch and in
    its queue, tokens of KV cache in use (None with an unlimited cache, whose tokens the
    simulator does not count), preemptions so far."""

    time_s: float
    backend: str
    running: int
    waiting: int
    kv_used: int | None
    preemptions: int


@dataclass(slots=True, eq=False)
class _Job:
    """A request of the run: once dispatched, its place in the records (dispatch order), its
    backend, its ``EngineRequest``, and its current run in the engine's batch (``run``
    counts the admissions and preemptions: an event of an older run is void)."""

    request: Request
    estimate: Estimate
    actual: float
    index: int = -1
    start_s: float = 0.0
    cost: float = 0.0  # charged at dispatch
    ticket: Ticket | None = None
    backend: str = ""
    engine: EngineRequest | None = None
    priority: int = 0  # its class's engine_priority
    admitted_s: float | None = None  # first into the batch
    first_token_s: float | None = None  # its first output token, once generated
    run: int = 0
    first_token: float = 0.0  # the current run's: its prefill done, its time per token,
    interval: float = 0.0  # its tokens so far, how many it generates, its end
    tokens: int = 0
    left: int = 0
    end: float = 0.0


@dataclass(frozen=True, slots=True)
class _Readings:
    """Each backend's reading of a scrape asked at ``requested_at``: the payload of its
    answer's event."""

    requested_at: float
    readings: dict[str, EngineReading]


Push = Callable[[float, int, _Job], None]


class _Engines:
    """Each backend's ``EngineScheduler`` and the timing of the requests in its batch.

    A run starts when the engine admits a request and lasts ``service_time`` from the batch
    it joins, fixed then (as the simulator always did): its prompt and what it had generated
    before a preemption are prefilled, then it generates the rest. When the engine can
    preempt (a finite KV cache, or the priority policy), each token of a run is an event
    that takes cache (``EngineScheduler.grow``) and a preemption ends the run early: its
    pending event is void, and it is admitted again later. Otherwise its end is its one
    event, and the figures are the ones the simulator gave before it had an engine queue.
    """

    def __init__(self, pool: PoolModel, names: list[str]) -> None:
        self.model = pool.engine
        self.engines = {name: pool.engine.scheduler(pool.max_num_seqs) for name in names}
        self.stepwise = pool.engine.kv_cache_tokens is not None or (
            pool.engine.scheduling_policy == "priority"
        )
        self.changed: dict[str, None] = {}  # backends changed by the event in hand, in order
        self.admitted: list[_Job] = []  # admitted by it: their runs start after it

    def add(self, job: _Job, now: float) -> None:
        request = job.request
        job.engine = EngineRequest(
            job, request.prompt_tokens, request.output_tokens, priority=job.priority
        )
        self._apply(job.backend, self.engines[job.backend].add(job.engine), now)

    def token(self, job: _Job, now: float, push: Push) -> None:
        """A token of ``job``'s run: it takes cache; then the next token, or the end."""
        assert job.engine is not None
        self._apply(job.backend, self.engines[job.backend].grow(job.engine), now)
        if job.engine.running:  # not preempted, itself
            job.tokens += 1
            if job.tokens + 1 < job.left:
                push(job.first_token + (job.tokens + 1) * job.interval, _TOKEN, job)
            else:
                push(job.end, _FINISH, job)

    def remove(self, job: _Job, now: float) -> None:
        assert job.engine is not None
        if job.first_token_s is None:  # its run ends with its last token: the first came
            job.first_token_s = job.first_token
        self._apply(job.backend, self.engines[job.backend].remove(job.engine), now)

    def _apply(self, backend: str, changes: Changes, now: float) -> None:
        self.changed[backend] = None
        for request in changes.preempted:
            job: _Job = request.key  # type: ignore[assignment]
            job.run += 1  # its pending event is void
            if job.first_token_s is None and job.first_token <= now:  # prefilled before
                job.first_token_s = job.first_token
        self.admitted += [request.key for request in changes.admitted]  # type: ignore[misc]

    def start_runs(self, now: float, push: Push) -> None:
        """Start the runs of the requests the event admitted, each at the batch size of its
        backend after the whole event (every request starting at one instant sees the
        others, as in the simulator before the engine had a queue). A request admitted and
        then preempted by the same event (by a smaller priority value) has no run yet."""
        for job in dict.fromkeys(self.admitted):
            assert job.engine is not None
            if not job.engine.running:
                continue
            running = self.engines[job.backend].running_places
            if job.admitted_s is None:
                job.admitted_s = now
            job.run += 1
            prompt = job.request.prompt_tokens + job.engine.generated
            job.left = job.request.output_tokens - job.engine.generated
            job.tokens = 0
            job.first_token = now + self.model.prefill_seconds(prompt)
            job.interval = self.model.decode_interval(running)
            job.end = now + self.model.service_seconds(prompt, job.left, running)
            if self.stepwise and job.left > 1:
                push(job.first_token + job.interval, _TOKEN, job)
            else:
                push(job.end, _FINISH, job)
        self.admitted.clear()

    def sample(self, now: float, into: list[EngineSample] | None) -> None:
        """The engines the event changed, into ``into``."""
        if into is not None:
            for name in self.changed:
                e = self.engines[name]
                kv = e.kv_used if e.kv_cache_tokens is not None else None
                into.append(EngineSample(
                    now, name, e.running_places, e.waiting_places, kv, e.preemptions
                ))  # fmt: skip
        self.changed.clear()


def simulate(
    scenario: Scenario,
    policy: DispatchQueue[Ticket],
    *,
    events: list[tuple[str, int]] | None = None,
    true_up: bool = True,
    engine_log: list[EngineSample] | None = None,
) -> list[Served]:
    """Run every request of ``scenario`` through a ``Scheduler`` ordering with ``policy`` (a
    fresh, empty queue); the records in dispatch order, each with the cost charged and the
    actual cost.

    ``events``, when given, receives ``("arrive" | "start", request id)`` in the exact order
    the scheduler saw them, so a checker can tell who was backlogged at each dispatch.
    ``true_up``: each request's actual cost is passed to ``Scheduler.finish`` (the proxy's
    behaviour); False passes None, so the estimates stand (to compare what the true-up buys).
    ``engine_log``, when given, receives an ``EngineSample`` of each backend's engine after
    every event that changed it.
    """
    pool = scenario.pool
    specs = [
        BackendSpec(
            url=f"http://backend-{i}.sim",
            slots=pool.slots,
            capacity=pool.capacity,
            name=f"backend-{i}",
        )
        for i in range(pool.backends)
    ]
    placement = Placement(specs)
    scheduler = Scheduler(placement, queue=policy)
    gated = pool.dispatch.engine
    if gated:
        equip(placement, pool.gate_policy())
        scheduler.ceilings = {team.cls: team.engine_ceiling for team in scenario.teams}
    engines = _Engines(pool, [spec.name or spec.url for spec in specs])
    costs = cost_model(cost_spec(pool))
    teams = {team.name: team for team in scenario.teams}
    heap: list[tuple[float, int, int, _Job | _Readings | None, int]] = []
    seq = 0
    for request in scenario.arrival_order():
        heap.append((request.time_s, _ARRIVE, seq, None, 0))
        seq += 1
    arrivals = iter(scenario.arrival_order())
    unarrived = len(heap)
    interval, delay = pool.dispatch.interval_s, pool.dispatch.scrape_delay_s
    scrapes = 0  # asked so far: the k-th is asked at k × interval − delay, answered at k × interval
    if gated:
        heap.append((-delay, _SCRAPE, seq, None, 0))
        seq += 1
    heapq.heapify(heap)
    records: list[Served | None] = []
    pump_at: float | None = None

    def push(at: float, kind: int, job: _Job) -> None:
        nonlocal seq
        heapq.heappush(heap, (at, kind, seq, job, job.run))
        seq += 1

    def started(now: float, dispatched: list[Ticket]) -> None:
        nonlocal seq, pump_at
        for ticket in dispatched:
            job: _Job = ticket.payload
            assert ticket.backend is not None
            job.index, job.start_s, job.ticket = len(records), now, ticket
            job.backend = ticket.backend.name
            job.cost = 0.0 if ticket.priority else ticket.cost
            records.append(None)
            engines.add(job, now)
            if events is not None:
                events.append(("start", job.request.id))
        engines.start_runs(now, push)
        engines.sample(now, engine_log)
        wake = scheduler.wake_at
        if wake is not None and (pump_at is None or wake < pump_at):
            pump_at = wake
            heapq.heappush(heap, (wake, _PUMP, seq, None, 0))
            seq += 1

    def read(now: float) -> None:
        """Ask each engine for a reading, answered ``delay`` later."""
        nonlocal seq
        readings = {name: reading_of(engine) for name, engine in engines.engines.items()}
        heapq.heappush(heap, (now + delay, _READING, seq, _Readings(now, readings), 0))
        seq += 1

    def scrape(now: float) -> None:
        """A reading, and while there is work to come, the next scrape."""
        nonlocal seq, scrapes
        read(now)
        scrapes += 1
        if unarrived or scheduler.running or scheduler.queued():
            heapq.heappush(heap, (scrapes * interval - delay, _SCRAPE, seq, None, 0))
            seq += 1

    reread_at: float | None = None  # a reading asked settle_s after a request ended

    def reread_after_end(now: float) -> None:
        """As the proxy's scrape loop does (state/engine_scrape.py): the engine is read
        again ``settle_s`` after a request ends, one such reading pending at a time."""
        nonlocal seq, reread_at
        if gated and reread_at is None:
            reread_at = now + pool.dispatch.settle_s
            heapq.heappush(heap, (reread_at, _REREAD, seq, None, 0))
            seq += 1

    while heap:
        now, kind, _, job, run = heapq.heappop(heap)
        if isinstance(job, _Job) and run != job.run:
            continue  # an event of a run a preemption ended
        if kind == _SCRAPE:
            scrape(now)
            continue
        if kind == _REREAD:
            reread_at = None
            read(now)
            continue
        if kind == _READING:
            assert isinstance(job, _Readings)
            observe(placement, job.readings, job.requested_at, now)
            dispatched = scheduler.pump(now)
        elif kind == _TOKEN:
            assert isinstance(job, _Job)
            engines.token(job, now, push)
            dispatched = []
        elif kind == _FINISH:
            assert isinstance(job, _Job)
            assert job.ticket is not None
            dispatched = scheduler.finish(job.ticket, now, job.actual if true_up else None)
            reread_after_end(now)
            costs.observe(
                job.estimate, job.ticket.org, job.request.prompt_tokens, job.request.output_tokens
            )
            engines.remove(job, now)
            assert job.engine is not None
            records[job.index] = Served(
                job.request, job.start_s, now, job.cost, job.actual, true_up,
                job.admitted_s, job.engine.preemptions, job.first_token_s,
            )  # fmt: skip
        elif kind == _PUMP:
            pump_at = None
            dispatched = scheduler.pump(now)
        else:
            request = next(arrivals)
            unarrived -= 1
            estimate = costs.estimate(inference_request(request), request.org)
            team = teams[request.team]
            bounds = team.size_buckets
            new = Ticket(
                org=request.org,
                cls=request.cls,
                cost=estimate.cost,
                weight=team.weight,
                tokens=float(estimate.input_tokens + estimate.max_tokens),
                bucket=0 if bounds is None else size_bucket(estimate.cost, bounds),
                max_overtaken=None if bounds is None else team.max_overtaken,
                payload=_Job(
                    request, estimate, actual_cost(request, costs), priority=team.engine_priority
                ),
            )
            if events is not None:
                events.append(("arrive", request.id))
            dispatched = scheduler.submit(new, now)
        started(now, dispatched)
    assert all(record is not None for record in records)
    return records  # type: ignore[return-value]
