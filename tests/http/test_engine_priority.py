"""vLLM's engine priority through the real proxy (docs/design.md §5, Engine priority), in
front of the simulated vLLM started with ``--scheduling-policy priority`` (its queue ordered
by the body's ``priority``, lower first; a head may preempt a running request of a larger
value): a client's own ``priority`` never reaches the engine, whatever it sends; the one the
engine is given is the ``engine_priority`` of the class the proxy put the request in.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy_lab import MODEL, Lab, eventually, proxy_config

from sfq_proxy.config import default_classes
from sfq_proxy.sim.server import RequestRecord, SimBackend

# one sequence at a time: what the proxy sends beyond it waits in the engine's own queue
ENGINE = {"max_num_seqs": 1, "scheduling_policy": "priority", "time_scale": 5.0}


def records(sim: SimBackend, user: str) -> list[RequestRecord]:
    return [r for r in sim.stats.log if r.user == user]


def started(record: RequestRecord) -> float:
    assert record.started_at is not None  # it was served
    return record.started_at


async def ask(client: Any, user: str, **extra: Any) -> None:
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"work of {user}"}],
        max_tokens=60,
        user=user,
        **extra,
    )


async def fill_the_engine(sim: SimBackend, client: Any, user: str, n: int) -> asyncio.Future[Any]:
    """``n`` requests of ``user`` in the engine: one runs, the rest wait in its queue."""
    work = asyncio.gather(*(ask(client, user) for _ in range(n)))
    await eventually(lambda: sim.stats.requests_seen == n and sim.stats.waiting == n - 1, 10)
    return work


async def test_a_client_cannot_jump_the_engines_queue_with_its_own_priority(lab: Lab) -> None:
    """The attack: org B's three requests are in the engine (one runs, two wait in its
    queue, first come first served among equal priorities); org A then sends ``priority:
    -1000000``. Passed through, as it was before, the engine served it next, preempting B's
    running request; the proxy takes the field out, so it waits its turn like anyone."""
    sim = await lab.backend(**ENGINE)
    served = await lab.proxy(proxy_config([sim.url], slots=4))
    work = await fill_the_engine(sim, lab.client(served, "B"), "b", 3)
    await ask(lab.client(served, "A"), "mallory", extra_body={"priority": -1_000_000})
    await work

    (jumper,) = records(sim, "mallory")
    assert jumper.priority == 0  # the engine never saw the client's value
    victims = records(sim, "b")
    assert [r.preemptions for r in [jumper, *victims]] == [0, 0, 0, 0]
    assert all(started(r) < started(jumper) for r in victims)  # behind B's work


def engine_classes() -> dict[str, Any]:
    classes = {name: spec.model_dump() for name, spec in default_classes().items()}
    classes["interactive"]["engine_priority"] = 0
    classes["batch"]["engine_priority"] = 10
    return classes


async def test_an_interactive_request_is_served_before_the_batch_work_in_the_engine(
    lab: Lab,
) -> None:
    """``engine_priority`` 0 for interactive, 10 for batch: org B's batch work fills the
    engine (one runs, three wait); org C's interactive request, arriving last, is served
    before the batch requests waiting in the engine, each sent with its class's value."""
    sim = await lab.backend(**ENGINE)
    served = await lab.proxy(proxy_config([sim.url], slots=5, classes=engine_classes()))
    work = await fill_the_engine(sim, lab.client(served, "B"), "batch", 4)
    await ask(lab.client(served, "C"), "interactive")
    await work

    (urgent,) = records(sim, "interactive")
    batch = records(sim, "batch")
    assert urgent.priority == 0
    assert [r.priority for r in batch] == [10] * 4
    running, *waiting = sorted(batch, key=started)
    assert started(running) < started(urgent)
    assert all(started(urgent) < started(r) for r in waiting)  # the engine's queue jumped


async def test_a_clients_priority_never_reaches_the_engine(lab: Lab) -> None:
    """Whatever a client sends as ``priority`` (a number, its own class's value, an escaped
    name, a streamed request, a class without ``engine_priority``), the engine gets its
    class's value, or none (0, vLLM's default)."""
    sim = await lab.backend(**ENGINE)
    classes = engine_classes()
    classes["interactive"]["engine_priority"] = 3  # not the engine's default
    classes["batch"].pop("engine_priority")  # unset: no priority is sent for batch
    served = await lab.proxy(proxy_config([sim.url], slots=4, classes=classes))
    interactive, batch = lab.client(served, "C"), lab.client(served, "B")
    await ask(interactive, "i-number", extra_body={"priority": -5})
    await ask(batch, "b-number", extra_body={"priority": -5})
    await ask(batch, "b-string", extra_body={"priority": "-5"})
    stream = await batch.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        user="b-stream", stream=True, extra_body={"priority": -7},
    )  # fmt: skip
    async for _ in stream:
        pass
    http = await lab.http()
    escaped = (
        b'{"model":"%s","messages":[{"role":"user","content":"x"}],"max_tokens":5,'
        b'"user":"b-escaped","priorit\\u0079":-9}' % MODEL.encode()
    )
    headers = {"Authorization": "Bearer sk-test-org-b", "Content-Type": "application/json"}
    async with http.post(f"{served.url}/v1/chat/completions", data=escaped, headers=headers) as r:
        assert r.status == 200, await r.text()
    got = {r.user: r.priority for r in sim.stats.log}
    assert got == {"i-number": 3, "b-number": 0, "b-string": 0, "b-stream": 0, "b-escaped": 0}
    assert all(r.outcome == "completed" for r in sim.stats.log)
