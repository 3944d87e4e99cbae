"""Drive a scenario against a running proxy with real HTTP clients, one API key per team.

Requests leave on the scenario's schedule, ``time_scale`` times faster (the simulated
backends run ``time_scale`` times faster too), in ``Scenario.arrival_order`` (requests of the
same instant interleaved across teams, as the simulator submits them), as completions whose
prompt is sized so that both the proxy's estimate and the server's count give the scenario's
input tokens, asking ``max_tokens`` and sending ``min_tokens`` = the scenario's output, so
that a simulated server in ``output_mode: min_tokens`` generates what the scenario says.
The proxy's ``X-Queue-Wait`` header tells when each request was dispatched and its
``X-Cost-Charged`` header what its flow was charged, and the answer's usage what it really
cost (the pool's formula, ``CostModel.actual``: the proxy trued the charge up to it); results
come back as the same ``Served`` records the simulator produces, in scenario seconds, with
the cost the proxy actually charged. A scenario with hidden input tokens cannot be replayed:
the prompt sent is the one the proxy prices, and the simulated server counts it alike.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping

import aiohttp

from ..core.cost import CostModel
from ..http.relay import COST_HEADER, QUEUE_WAIT_HEADER
from .scenario import Request, Scenario, Served
from .simulator import cost_model, cost_spec

CHARS_PER_TOKEN = 4  # what the proxy's estimate and the simulated server both assume


async def run_load(
    scenario: Scenario,
    url: str,
    keys: Mapping[str, str],
    *,
    time_scale: float = 1.0,
    on_served: Callable[[Served], None] | None = None,
) -> tuple[list[Served], list[tuple[Request, int]]]:
    """Replay ``scenario`` against ``url``; returns what was served and what was refused.

    Raises ValueError for a scenario it cannot replay (``check_replayable``)."""
    check_replayable(scenario)
    costs = cost_model(cost_spec(scenario.pool), calibrate=False)  # only its formula is used
    served: list[Served] = []
    refused: list[tuple[Request, int]] = []
    teams = {team.name: team for team in scenario.teams}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.monotonic()

        async def send(request: Request) -> None:
            team = teams[request.team]
            headers = {"Authorization": f"Bearer {keys[team.name]}", "X-Workload-Class": team.cls}
            body = {
                "model": model,
                "prompt": "x" * (request.input_tokens * CHARS_PER_TOKEN),
                "max_tokens": request.max_tokens,
                "min_tokens": request.output_tokens,
            }
            sent = time.monotonic()
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                answer = await r.read()
                done = time.monotonic()
                if r.status != 200:
                    refused.append((request, r.status))
                    return
                wait = float(r.headers[QUEUE_WAIT_HEADER])
                charged = float(r.headers[COST_HEADER])
            actual = _actual(answer, costs)
            record = Served(
                request=request,
                start_s=(sent - start + wait) * time_scale,
                end_s=(done - start) * time_scale,
                cost=charged,
                actual=actual,
                trued_up=actual is not None,  # the proxy read the same usage
            )
            served.append(record)
            if on_served is not None:
                on_served(record)

        model = await _model(session, url, next(iter(keys.values())))
        tasks = []
        for request in scenario.arrival_order():
            delay = start + request.time_s / time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(request)))
        await asyncio.gather(*tasks)
    served.sort(key=lambda s: (s.start_s, s.request.id))
    return served, refused


def check_replayable(scenario: Scenario) -> None:
    """Raise ValueError if ``scenario`` has requests a real run cannot send as they are: with
    hidden input tokens, which the proxy would see (it prices the prompt the simulated
    server counts), so a real run would measure another workload."""
    hidden = sorted({r.team for r in scenario.requests if r.hidden_input_tokens})
    if hidden:
        fields = ", ".join(f"teams.{team}.hidden_input_tokens" for team in hidden)
        raise ValueError(
            f"{fields}: a real run cannot send tokens the proxy does not see (it prices the "
            "prompt the simulated server counts); simulate the scenario instead"
        )


def _actual(answer: bytes, costs: CostModel) -> float | None:
    """What an answer really cost, by its usage; None without one."""
    try:
        usage = json.loads(answer)["usage"]
        return costs.actual(usage["prompt_tokens"], usage.get("completion_tokens"))
    except (ValueError, KeyError, TypeError):
        return None


async def _model(session: aiohttp.ClientSession, url: str, key: str) -> str:
    """The first model the proxy serves: the scenario's pool is the proxy's first pool."""
    headers = {"Authorization": f"Bearer {key}"}
    async with session.get(f"{url}/v1/models", headers=headers) as r:
        r.raise_for_status()
        model: str = (await r.json())["data"][0]["id"]
        return model
