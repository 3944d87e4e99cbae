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
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..config import BackendSpec, CalibrationSpec, CostSpec, size_bucket
from ..core.calibration import Calibration
from ..core.cost import CostModel, Estimate
from ..core.inference_request import InferenceRequest, Kind
from ..core.placement import Placement
from ..core.queues import DispatchQueue
from ..core.scheduler import Scheduler, Ticket
from .scenario import PoolModel, Request, Scenario, Served

__all__ = [
    "POOL",
    "actual_cost",
    "cost_model",
    "cost_of",
    "inference_request",
    "service_time",
    "simulate",
]

POOL = "lab"  # the pool's name, in the simulator as in the proxy config of a real run
_FINISH, _PUMP, _ARRIVE = 0, 1, 2  # at one instant: completions, then pacing, then arrivals


def cost_spec(pool: PoolModel) -> CostSpec:
    """The scenario's cost section as the proxy's pool ``cost`` section."""
    return CostSpec(
        input_weight=pool.input_weight,
        output_weight=pool.output_weight,
        output_ratio=pool.output_ratio,
    )


def cost_model(spec: CostSpec, *, calibrate: bool = True) -> CostModel:
    """The proxy's cost model for a pool's ``spec``, with calibration at the proxy's default
    settings (as ``http/runtime.py`` builds it from an unset ``calibration`` section)."""
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


@dataclass(slots=True)
class _Job:
    request: Request
    estimate: Estimate
    actual: float


def simulate(
    scenario: Scenario,
    policy: DispatchQueue[Ticket],
    *,
    events: list[tuple[str, int]] | None = None,
    true_up: bool = True,
) -> list[Served]:
    """Run every request of ``scenario`` through a ``Scheduler`` ordering with ``policy`` (a
    fresh, empty queue); the records in dispatch order, each with the cost charged and the
    actual cost.

    ``events``, when given, receives ``("arrive" | "start", request id)`` in the exact order
    the scheduler saw them, so a checker can tell who was backlogged at each dispatch.
    ``true_up``: each request's actual cost is passed to ``Scheduler.finish`` (the proxy's
    behaviour); False passes None, so the estimates stand (to compare what the true-up buys).
    """
    pool = scenario.pool
    specs = [
        BackendSpec(url=f"http://backend-{i}.sim", slots=pool.slots, name=f"backend-{i}")
        for i in range(pool.backends)
    ]
    scheduler = Scheduler(Placement(specs), queue=policy)
    costs = cost_model(cost_spec(pool))
    teams = {team.name: team for team in scenario.teams}
    heap: list[tuple[float, int, int, Ticket | None]] = []
    seq = 0
    for request in scenario.arrival_order():
        heap.append((request.time_s, _ARRIVE, seq, None))
        seq += 1
    arrivals = iter(scenario.arrival_order())
    heapq.heapify(heap)
    served: list[Served] = []
    pump_at: float | None = None

    def started(now: float, dispatched: list[Ticket]) -> None:
        nonlocal seq, pump_at
        for ticket in dispatched:
            job: _Job = ticket.payload
            assert ticket.backend is not None
            end = now + service_time(job.request, pool, ticket.backend.in_flight)
            heapq.heappush(heap, (end, _FINISH, seq, ticket))
            seq += 1
            cost = 0.0 if ticket.priority else ticket.cost
            served.append(Served(job.request, now, end, cost, job.actual, true_up))
            if events is not None:
                events.append(("start", job.request.id))
        wake = scheduler.wake_at
        if wake is not None and (pump_at is None or wake < pump_at):
            pump_at = wake
            heapq.heappush(heap, (wake, _PUMP, seq, None))
            seq += 1

    while heap:
        now, kind, _, ticket = heapq.heappop(heap)
        if kind == _FINISH:
            assert ticket is not None
            job = ticket.payload
            dispatched = scheduler.finish(ticket, now, job.actual if true_up else None)
            costs.observe(
                job.estimate, ticket.org, job.request.prompt_tokens, job.request.output_tokens
            )
        elif kind == _PUMP:
            pump_at = None
            dispatched = scheduler.pump(now)
        else:
            request = next(arrivals)
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
                payload=_Job(request, estimate, actual_cost(request, costs)),
            )
            if events is not None:
                events.append(("arrive", request.id))
            dispatched = scheduler.submit(new, now)
        started(now, dispatched)
    return served
