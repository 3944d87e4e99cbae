"""Discrete-event simulation of a pool under an ordering policy, in virtual time.

The model is the one the proxy lives in: ``backends × slots`` concurrency slots, dispatch
one request at a time whenever a slot is free (to the least loaded backend, as placement
does), and a request's service time fixed when it starts — prefill at
``prefill_tokens_per_s``, then ``output_tokens`` decoded at ``decode_tokens_per_s``
slowed by ``1 + batch_slowdown·(n−1)`` for the ``n`` sequences then running on its
backend. (The simulated server recomputes that slowdown token by token; fixing it at the
start keeps the simulator exact and fast, and the real-proxy run measures the difference.)
Same scenario and policy in, same records out: there is no randomness here.
"""

from __future__ import annotations

import heapq

from .policies import Policy
from .scenario import PoolModel, Request, Scenario, Served


def cost_of(request: Request, pool: PoolModel) -> float:
    """The proxy's estimate: input tokens and the ``max_tokens`` asked for, weighted."""
    return pool.input_weight * request.input_tokens + pool.output_weight * request.max_tokens


def service_time(request: Request, pool: PoolModel, running: int) -> float:
    engine = pool.engine
    prefill = request.input_tokens / engine.prefill_tokens_per_s
    slowdown = 1.0 + engine.batch_slowdown * (running - 1)
    return prefill + request.output_tokens * slowdown / engine.decode_tokens_per_s


def simulate(
    scenario: Scenario, policy: Policy, *, events: list[tuple[str, int]] | None = None
) -> list[Served]:
    """Run every request of ``scenario`` through ``policy``; the records in dispatch order.

    ``events``, when given, receives ``("arrive" | "start", request id)`` in the exact order
    the simulator saw them, so a checker can tell who was backlogged at each dispatch.
    """
    pool = scenario.pool
    weights = {team.name: team.weight for team in scenario.teams}
    running = [0] * pool.backends
    finishing: list[tuple[float, int, int]] = []  # (end, request id, backend)
    served: list[Served] = []

    def dispatch(now: float) -> None:
        while True:
            backend = min(range(pool.backends), key=running.__getitem__)
            if running[backend] >= pool.slots:
                return
            request = policy.pop()
            if request is None:
                return
            running[backend] += 1
            end = now + service_time(request, pool, running[backend])
            heapq.heappush(finishing, (end, request.id, backend))
            served.append(Served(request, now, end, cost_of(request, pool)))
            if events is not None:
                events.append(("start", request.id))

    def finish_until(now: float) -> None:
        """Complete what ends at or before ``now``, each freeing a slot as it ends."""
        while finishing and finishing[0][0] <= now:
            end, _, backend = heapq.heappop(finishing)
            running[backend] -= 1
            dispatch(end)

    for request in scenario.requests:
        finish_until(request.time_s)
        flow = f"{request.org}/{request.cls}"
        policy.push(flow, request, cost_of(request, pool), weights[request.team])
        if events is not None:
            events.append(("arrive", request.id))
        dispatch(request.time_s)
    finish_until(float("inf"))
    return served
