"""The engine's scheduler (sfq_proxy/sim/engine.py), pure: its batch, its queue, its KV cache
and its preemptions, as the simulated server and the lab's simulator both use it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from sfq_proxy.sim.engine import Changes, EngineModel, EngineRequest, EngineScheduler


def req(
    key: str, prompt: int = 10, output: int = 10, places: int = 1, priority: int = 0
) -> EngineRequest:
    return EngineRequest(key, prompt, output, places=places, priority=priority)


def keys(requests: tuple[EngineRequest, ...]) -> list[object]:
    return [r.key for r in requests]


# --------------------------------------------------------------------------- by example


def test_requests_beyond_max_num_seqs_wait_in_arrival_order() -> None:
    engine = EngineScheduler(max_num_seqs=2)
    a, b, c, d = req("a"), req("b"), req("c"), req("d")
    assert keys(engine.add(a).admitted) == ["a"]
    assert keys(engine.add(b).admitted) == ["b"]
    assert not engine.add(c)
    assert not engine.add(d)
    assert (engine.running_places, engine.waiting_places) == (2, 2)
    assert keys(engine.waiting) == ["c", "d"]
    assert keys(engine.remove(b).admitted) == ["c"]
    assert keys(engine.remove(d).admitted) == []  # d left the queue while waiting
    assert (engine.running_places, engine.waiting_places) == (2, 0)


def test_a_request_of_several_sequences_is_admitted_whole_and_blocks_the_queue() -> None:
    """Head-of-line, as vLLM's scheduler: a 1-sequence request behind a 3-sequence one waits
    even with a place free, so the big one is never starved by small ones."""
    engine = EngineScheduler(max_num_seqs=4)
    engine.add(req("a", places=2))
    assert not engine.add(req("big", places=3))
    assert not engine.add(req("small"))
    assert engine.running_places == 2
    assert keys(engine.remove(engine.running[0]).admitted) == ["big", "small"]


def test_prompts_and_generated_tokens_take_kv_and_a_full_cache_preempts_the_newest() -> None:
    engine = EngineScheduler(max_num_seqs=8, kv_cache_tokens=100)
    a, b, c = req("a", 30, 40), req("b", 30, 40), req("c", 30, 40)
    for r in (a, b, c):
        engine.add(r)
    assert engine.kv_used == 90
    assert not engine.grow(a, 5)
    assert engine.kv_used == 95
    assert a.generated == 5
    assert engine.kv_usage == pytest.approx(0.95)
    changes = engine.grow(b, 10)  # 105 > 100: c, the newest, goes back to the queue
    assert keys(changes.preempted) == ["c"]
    assert not changes.admitted
    assert (engine.kv_used, engine.preemptions, c.preemptions) == (75, 1, 1)
    assert keys(engine.waiting) == ["c"]
    assert not c.running
    # when a finishes, c is admitted again: its prompt (it had generated nothing) fits
    assert keys(engine.remove(a).admitted) == ["c"]
    assert c.admissions == 2


def test_a_preempted_request_prefills_what_it_generated_and_goes_back_to_the_front() -> None:
    engine = EngineScheduler(max_num_seqs=2, kv_cache_tokens=60)
    a, b, c = req("a", 20, 30), req("b", 20, 30), req("c", 5, 5)
    engine.add(a)
    engine.add(b)
    engine.add(c)  # waits: the batch is full
    engine.grow(b, 15)
    changes = engine.grow(a, 10)  # 20+20+15+10 = 65 > 60: b, the newest, is preempted
    assert keys(changes.preempted) == ["b"]
    assert keys(changes.admitted) == []
    assert keys(engine.waiting) == ["b", "c"]  # it arrived before c: in front of it
    assert b.kv_tokens == 35  # its prompt and the 15 tokens it had: prefilled again
    assert keys(engine.remove(a).admitted) == ["b", "c"]


def test_a_request_preempts_itself_when_it_is_the_newest() -> None:
    engine = EngineScheduler(max_num_seqs=2, kv_cache_tokens=50)
    a, b = req("a", 20, 30), req("b", 20, 30)
    engine.add(a)
    engine.add(b)
    changes = engine.grow(b, 11)
    assert keys(changes.preempted) == ["b"]
    assert b.generated == 0  # the tokens it could not store are generated again
    assert engine.kv_used == 20


def test_a_request_that_cannot_fit_alone_is_refused() -> None:
    engine = EngineScheduler(max_num_seqs=2, kv_cache_tokens=50)
    with pytest.raises(ValueError, match="more than the 50"):
        engine.add(req("a", 30, 21))
    assert engine.fits_alone(30, 20)
    assert not engine.fits_alone(30, 21)
    assert EngineScheduler(2).fits_alone(10**9, 10**9)


def test_priority_orders_the_queue_lower_first_then_by_arrival() -> None:
    engine = EngineScheduler(max_num_seqs=1, policy="priority")
    blocker = req("blocker", priority=0)
    engine.add(blocker)
    for key, priority in (("p5", 5), ("p3", 3), ("p4", 4), ("p3b", 3)):
        engine.add(req(key, priority=priority))
    assert keys(engine.waiting) == ["p3", "p3b", "p4", "p5"]
    order = []
    while engine.running:
        order += keys(engine.remove(engine.running[0]).admitted)
    assert order == ["p3", "p3b", "p4", "p5"]


def test_fcfs_ignores_priority() -> None:
    engine = EngineScheduler(max_num_seqs=1)
    engine.add(req("blocker"))
    engine.add(req("late", priority=9))
    engine.add(req("urgent", priority=-9))
    assert keys(engine.waiting) == ["late", "urgent"]


def test_with_priority_a_smaller_value_preempts_a_larger_one_it_needs_the_room_of() -> None:
    engine = EngineScheduler(max_num_seqs=2, policy="priority")
    low, mid = req("low", priority=9), req("mid", priority=5)
    engine.add(low)
    engine.add(mid)
    changes = engine.add(req("high", priority=1))
    assert keys(changes.preempted) == ["low"]
    assert keys(changes.admitted) == ["high"]
    assert keys(engine.running) == ["mid", "high"]
    assert keys(engine.waiting) == ["low"]
    changes = engine.add(req("high-too", priority=1))  # then mid
    assert keys(changes.preempted) == ["mid"]
    assert keys(changes.admitted) == ["high-too"]
    # an equal priority preempts nothing: it waits
    assert not engine.add(req("high-3", priority=1))
    assert keys(engine.waiting) == ["high-3", "mid", "low"]
    assert engine.preemptions == 2


def test_with_priority_nothing_is_preempted_when_it_would_not_make_room() -> None:
    engine = EngineScheduler(max_num_seqs=4, kv_cache_tokens=100, policy="priority")
    engine.add(req("important", 60, 10, priority=0))
    engine.add(req("low", 20, 10, priority=9))
    changes = engine.add(req("big", 40, 10, priority=1))  # 60+20+40 > 100; without low, 100
    assert keys(changes.preempted) == ["low"]
    assert keys(changes.admitted) == ["big"]
    # a request that would need the important one's cache too preempts nobody
    engine2 = EngineScheduler(max_num_seqs=4, kv_cache_tokens=100, policy="priority")
    engine2.add(req("important", 60, 10, priority=0))
    engine2.add(req("low", 20, 10, priority=9))
    assert not engine2.add(req("huge", 50, 10, priority=1))
    assert engine2.preemptions == 0


def test_with_priority_a_full_cache_preempts_the_largest_priority_value() -> None:
    engine = EngineScheduler(max_num_seqs=4, kv_cache_tokens=100, policy="priority")
    a, b, c = req("a", 30, 40, priority=1), req("b", 30, 40, priority=7), req("c", 30, 40)
    for r in (a, b, c):
        engine.add(r)
    changes = engine.grow(c, 20)  # b, the largest value, not c, the newest
    assert keys(changes.preempted) == ["b"]
    assert c.generated == 20


def test_hold_admits_nothing_until_release() -> None:
    engine = EngineScheduler(max_num_seqs=2)
    engine.hold()
    assert not engine.add(req("a"))
    assert not engine.add(req("b"))
    assert engine.waiting_places == 2
    assert keys(engine.release().admitted) == ["a", "b"]


def test_the_limits_are_checked() -> None:
    for bad in ({"max_num_seqs": 0}, {"max_num_seqs": 1, "kv_cache_tokens": 0},
                {"max_num_seqs": 1, "policy": "sjf"}):  # fmt: skip
        with pytest.raises(ValueError, match="must be"):
            EngineScheduler(**bad)  # type: ignore[arg-type]
    engine = EngineScheduler(2)
    a = req("a")
    engine.add(a)
    with pytest.raises(ValueError, match="already"):
        engine.add(a)
    engine.remove(a)
    with pytest.raises(ValueError, match="not running"):
        engine.grow(a)
    assert not engine.remove(a)  # gone: ignored


def test_an_engine_model_makes_a_scheduler_with_its_limits() -> None:
    model = EngineModel(8000, 40, max_num_seqs=3, kv_cache_tokens=500, scheduling_policy="priority")
    engine = model.scheduler(default_max_num_seqs=16)
    assert (engine.max_num_seqs, engine.kv_cache_tokens, engine.policy) == (3, 500, "priority")
    assert EngineModel(8000, 40).scheduler(16).max_num_seqs == 16


# --------------------------------------------------------------------------- properties


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineScheduler, list[EngineRequest]]:
    """An engine and the requests that will arrive at it, each fitting in its cache alone."""
    max_num_seqs = draw(st.integers(1, 4))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    sizes = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1,
                          max_size=12))  # fmt: skip
    need = max(p + o for p, o in sizes)
    kv = draw(st.one_of(st.none(), st.integers(need, need * 4)))
    requests = [
        EngineRequest(
            i,
            prompt,
            output,
            places=draw(st.integers(1, max_num_seqs)),
            priority=draw(st.integers(-2, 2)),
        )
        for i, (prompt, output) in enumerate(sizes)
    ]
    return EngineScheduler(max_num_seqs, kv, policy), requests  # type: ignore[arg-type]


def check(engine: EngineScheduler) -> None:
    """What must hold after every call."""
    running, waiting = engine.running, engine.waiting
    assert engine.running_places == sum(r.places for r in running) <= engine.max_num_seqs
    assert engine.waiting_places == sum(r.places for r in waiting)
    assert engine.kv_used == sum(r.kv_tokens for r in running)
    if engine.kv_cache_tokens is not None:
        assert engine.kv_used <= engine.kv_cache_tokens
    assert all(r.running for r in running)
    assert not any(r.running for r in waiting)
    assert all(r.generated < r.output_tokens + 1 for r in (*running, *waiting))
    # the queue is in service order: arrival, or (priority, arrival)
    order = [(r.priority if engine.policy == "priority" else 0, r.order) for r in waiting]
    assert order == sorted(order)
    if waiting and not engine.held:  # nothing waits on an idle engine
        assert running


@settings(max_examples=200, deadline=None)
@given(workload=workloads(), data=st.data())
def test_any_interleaving_keeps_the_limits_and_finishes_every_request_once(
    workload: tuple[EngineScheduler, list[EngineRequest]], data: st.DataObject
) -> None:
    """Requests arrive, the running ones generate token by token (in any interleaving), some
    are aborted: the batch never holds more than max_num_seqs sequences nor the cache more
    than its tokens, every request ends exactly once, and each admission takes the head of
    the queue: without priority, requests first enter the batch in arrival order."""
    engine, pending = workload
    ended: Counter[object] = Counter()
    first_admitted: list[EngineRequest] = []
    preemptions = 0

    def apply(changes: Changes) -> None:
        nonlocal preemptions
        preemptions += len(changes.preempted)
        remaining = [r.order for r in engine.waiting]
        for r in changes.admitted:
            assert r.running  # never admitted, then preempted, by one call
            if r.admissions == 1:
                first_admitted.append(r)
        # what was admitted came before anything still waiting (head first)
        if engine.policy == "fcfs" and changes.admitted and remaining:
            assert max(r.order for r in changes.admitted if r.running) < min(remaining)
        check(engine)

    for _ in range(5000):
        if not pending and not engine.running and not engine.waiting:
            break
        moves = (["add"] if pending else []) + (["grow"] if engine.running else [])
        moves += ["abort"] if (engine.running or engine.waiting) else []
        move = data.draw(st.sampled_from(moves))
        if move == "add":
            apply(engine.add(pending.pop(0)))
        elif move == "abort" and data.draw(st.integers(0, 9)) == 0:  # now and then
            victim = data.draw(st.sampled_from([*engine.running, *engine.waiting]))
            apply(engine.remove(victim))
            ended[victim.key] += 1
        elif engine.running:
            r = data.draw(st.sampled_from(engine.running))
            if r.generated == r.output_tokens:
                apply(engine.remove(r))
                ended[r.key] += 1
            else:
                apply(engine.grow(r, 1))
    assert not pending
    assert not engine.running
    assert not engine.waiting
    assert set(ended.values()) == {1}  # every request ended, once
    assert engine.preemptions == preemptions
    assert engine.kv_used == 0
    if engine.policy == "fcfs":
        orders = [r.order for r in first_admitted]
        assert orders == sorted(orders)
    if engine.kv_cache_tokens is None and engine.policy == "fcfs":
        assert preemptions == 0
    event("preempted" if preemptions else "no preemption")


@settings(max_examples=100, deadline=None)
@given(workload=workloads(), data=st.data())
def test_with_priority_each_admission_takes_the_smallest_value_waiting(
    workload: tuple[EngineScheduler, list[EngineRequest]], data: st.DataObject
) -> None:
    engine, pending = workload
    engine.policy = "priority"
    for _ in range(5000):
        if not pending and not engine.running and not engine.waiting:
            break
        before = sorted((r.priority, r.order) for r in engine.waiting)
        if pending and (not engine.running or data.draw(st.booleans())):
            new = pending.pop(0)
            changes = engine.add(new)
            before = sorted([*before, (new.priority, new.order)])
        else:
            r = data.draw(st.sampled_from(engine.running))
            changes = engine.remove(r) if r.generated == r.output_tokens else engine.grow(r)
        fresh = [(r.priority, r.order) for r in changes.admitted if r not in changes.preempted]
        assert fresh == before[: len(fresh)]  # the smallest (priority, arrival) first
        check(engine)
    assert not engine.running
    assert not engine.waiting
