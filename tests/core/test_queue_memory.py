"""The process's queue memory (core/queue_memory.py): a hard bound, largest flows first
(docs/design.md §6, Queue memory)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfq_proxy.config import MIB, REQUEST_OVERHEAD_BYTES, ConfigError, parse_config
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.queue_memory import QueueMemory

K = REQUEST_OVERHEAD_BYTES


def test_under_the_limit_every_request_waits_and_leaving_frees_its_memory() -> None:
    memory: QueueMemory[str, str] = QueueMemory(10 * K)
    assert memory.enter("a", "a1", 0) == []
    assert memory.enter("b", "b1", K) == []
    assert (memory.used, len(memory), memory.held("b")) == (3 * K, 2, 2 * K)
    assert memory.leave("b", "b1")
    assert not memory.leave("b", "b1")  # once
    assert (memory.used, len(memory), memory.held("b")) == (K, 1, 0)


def test_the_largest_flow_at_the_bound_is_refused_and_nothing_changes() -> None:
    memory: QueueMemory[str, str] = QueueMemory(4 * K)
    for i in range(4):
        memory.enter("flood", f"f{i}", 0)
    with pytest.raises(ApiError) as refused:
        memory.enter("flood", "f4", 0)
    assert (refused.value.status, refused.value.code) == (429, "queue_full")
    assert refused.value.headers()["Retry-After"] == "1"
    assert (memory.used, len(memory), memory.held("flood")) == (4 * K, 4, 4 * K)


def test_a_smaller_flow_at_the_bound_takes_the_place_of_the_largest_flows_newest() -> None:
    memory: QueueMemory[str, str] = QueueMemory(4 * K)
    for i in range(4):
        memory.enter("flood", f"f{i}", 0)
    assert memory.enter("small", "s0", 0) == [("flood", "f3")]  # the newest of the flood
    assert memory.enter("small", "s1", 0) == [("flood", "f2")]
    with pytest.raises(ApiError):  # equal now: neither pushes the other out
        memory.enter("small", "s2", 0)
    with pytest.raises(ApiError):
        memory.enter("flood", "f4", 0)
    assert (memory.held("flood"), memory.held("small")) == (2 * K, 2 * K)


def test_a_large_body_takes_the_place_of_several_but_never_makes_its_flow_the_largest() -> None:
    memory: QueueMemory[str, str] = QueueMemory(10 * K)
    for i in range(10):
        memory.enter("flood", f"f{i}", 0)
    assert memory.enter("big", "b0", 2 * K) == [("flood", f"f{i}") for i in (9, 8, 7)]
    # 6 K more would leave the flood (7 K) smaller than big's 9 K: refused, nothing moved
    with pytest.raises(ApiError):
        memory.enter("big", "b1", 5 * K)
    assert (memory.used, memory.held("flood"), memory.held("big")) == (10 * K, 7 * K, 3 * K)


def test_every_flow_keeps_an_equal_part_of_the_bound_whatever_floods() -> None:
    memory: QueueMemory[str, tuple[str, int]] = QueueMemory(30 * K)
    for i in range(100):  # one flow floods
        with contextlib.suppress(ApiError):
            memory.enter("flood", ("flood", i), 0)
    for i in range(100):  # two more, interleaved, as long as they are admitted
        for flow in ("b", "c"):
            with contextlib.suppress(ApiError):
                memory.enter(flow, (flow, i), 0)
    assert [memory.held(f) // K for f in ("flood", "b", "c")] == [10, 10, 10]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("enter"), st.sampled_from("abcd"), st.integers(0, 3 * K)),
            st.tuples(st.just("leave"), st.integers(0, 10_000)),
        ),
        max_size=200,
    )
)
def test_the_bound_holds_and_only_larger_flows_give_their_newest(ops: list[tuple]) -> None:
    """Random enters and leaves: the bound holds, only flows at least as large give their
    newest, and ``fits`` says beforehand whether a request waits without taking a place."""
    limit = 12 * K
    memory: QueueMemory[str, int] = QueueMemory(limit)
    mirror: dict[str, list[tuple[int, int]]] = {f: [] for f in "abcd"}  # flow → (item, charge)
    n = 0
    for op in ops:
        held = {f: sum(c for _, c in items) for f, items in mirror.items()}
        if op[0] == "enter":
            _, flow, size = op
            charge = K + size
            fits = memory.fits(size)  # without taking anyone's place
            try:
                victims = memory.enter(flow, n, size)
            except ApiError:
                assert sum(held.values()) + charge > limit  # refused only at the bound
                assert not fits
            else:
                assert fits == (victims == [])
                mine = held[flow] + charge
                for giver, victim in victims:
                    assert victim in dict(mirror[giver])
                    assert giver != flow
                    assert mirror[giver][-1][0] == victim  # its newest
                    cost = mirror[giver].pop()[1]
                    assert held[giver] - cost >= mine  # still at least as large
                    held[giver] -= cost
                mirror[flow].append((n, charge))
            n += 1
        else:
            everything = [(f, item) for f, items in mirror.items() for item, _ in items]
            if everything:
                owner, item = everything[op[1] % len(everything)]
                assert memory.leave(owner, item)
                for items in mirror.values():
                    items[:] = [e for e in items if e[0] != item]
        total = sum(c for items in mirror.values() for _, c in items)
        assert memory.used == total <= limit
        assert len(memory) == sum(len(items) for items in mirror.values())
        largest = memory.largest()
        if total:
            assert largest is not None
            assert largest[1] == max(sum(c for _, c in items) for items in mirror.values())


def _config(limits: str) -> str:
    return (
        "keys: [{key: k, org: a, classes: [batch]}]\n"
        "pools: {p: {models: [m], backends: [{url: 'http://h:1', slots: 1}]}}\n"
        f"limits: {limits}\n"
    )


def test_the_budget_defaults_to_512_mib_and_must_hold_one_request_of_the_largest_body() -> None:
    assert parse_config(_config("{}")).limits.queue_memory_bytes == 512 * MIB
    assert parse_config(_config("{queue_memory_mb: 21}")).limits.queue_memory_mb == 21
    with pytest.raises(ConfigError) as small:  # 2 × 10 MiB + 16 KiB do not fit in 20 MiB
        parse_config(_config("{queue_memory_mb: 20}"))
    assert "limits" in str(small.value)
    assert "at least 21" in str(small.value)
    assert parse_config(_config("{queue_memory_mb: 1, max_body_bytes: 262144}"))


def test_a_body_being_read_grows_as_it_comes_and_at_the_bound_as_a_newcomer_would() -> None:
    """``grow``: a body being read counts its bytes as they arrive (its first ones with the
    overhead); at the bound it takes the newest of larger flows, or is refused whole."""
    memory: QueueMemory[str, str] = QueueMemory(12 * K)
    assert memory.grow("reading", "r1", K) == []  # counted: the overhead and its first bytes
    assert memory.grow("reading", "r1", K) == []
    assert (memory.used, len(memory), memory.held("reading")) == (3 * K, 1, 3 * K)
    for i in range(4):
        memory.enter("flood", f"f{i}", K)  # 2 K each
    assert memory.used == 11 * K
    # the flood (8 K) stays larger than the body's flow would be (5 K): its newest goes
    assert memory.grow("reading", "r1", 2 * K) == [("flood", "f3")]
    assert (memory.used, memory.held("reading"), memory.held("flood")) == (11 * K, 5 * K, 6 * K)
    with pytest.raises(ApiError) as refused:  # it would be the largest: refused
        memory.grow("reading", "r1", 2 * K)
    assert (refused.value.status, refused.value.code) == (429, "queue_full")
    assert (memory.used, memory.held("reading")) == (11 * K, 5 * K)  # nothing changed
    assert memory.leave("reading", "r1")  # whole, or cut: it leaves as a whole
    assert (memory.used, len(memory)) == (6 * K, 3)
