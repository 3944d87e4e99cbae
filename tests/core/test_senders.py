"""What a client may hold before its request is read (core/senders.py; docs/design.md §6,
Slow senders): connections within their caps, the idle ones giving way, and a body's pace."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.core.senders import Connections, body_due, connection_caps


def test_within_the_caps_every_connection_is_admitted_and_counted() -> None:
    conns: Connections[str] = Connections(total=4, per_peer=2)
    assert conns.open("a1", "A") == []
    assert conns.open("b1", "B") == []
    assert (len(conns), conns.of("A"), conns.idle_count()) == (2, 1, 2)
    conns.close("a1")
    conns.close("a1")  # once
    assert (len(conns), conns.of("A"), conns.idle_count()) == (1, 0, 1)


def test_at_a_peers_cap_its_own_oldest_idle_connection_gives_way() -> None:
    conns: Connections[str] = Connections(total=10, per_peer=2)
    conns.open("a1", "A")
    conns.open("a2", "A")
    conns.open("b1", "B")  # older than a newcomer of A's, but not A's
    assert conns.open("a3", "A") == ["a1"]
    assert (len(conns), conns.of("A")) == (3, 2)
    conns.busy("a2")
    conns.busy("a3")
    assert conns.open("a4", "A") is None  # A's connections all serve a request: refused
    assert (len(conns), conns.of("A")) == (3, 2)  # nothing counted, nothing closed
    assert conns.open("b2", "B") == []  # another peer is not held by A's cap


def test_at_the_total_the_connection_idle_the_longest_gives_way() -> None:
    conns: Connections[str] = Connections(total=3, per_peer=3)
    for name in ("x1", "x2", "h1"):
        conns.open(name, name[0])
    conns.busy("x1")  # serving a request: nothing closes it
    conns.busy("h1")
    conns.idle("h1")  # its answer is out: the newest idle
    assert conns.open("y1", "y") == ["x2"]
    assert conns.open("y2", "y") == ["h1"]
    conns.busy("y1")
    conns.busy("y2")
    assert conns.open("z1", "z") is None
    assert len(conns) == 3


def test_caps_lowered_on_a_live_set_close_nothing_until_a_newcomer_comes() -> None:
    conns: Connections[str] = Connections(total=10, per_peer=10)
    for i in range(6):
        conns.open(f"a{i}", "A")
    conns.total, conns.per_peer = 4, 3
    assert len(conns) == 6
    assert conns.open("a6", "A") == ["a0", "a1", "a2", "a3"]  # back within both caps
    assert (len(conns), conns.of("A")) == (3, 3)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 40)), max_size=200))
def test_the_caps_always_hold_and_only_idle_connections_give_way(
    ops: list[tuple[int, int, int]],
) -> None:
    conns: Connections[int] = Connections(total=8, per_peer=4)
    peer_of: dict[int, str] = {}
    busy: set[int] = set()
    for n, (op, peer, pick) in enumerate(ops):
        live = sorted(peer_of)
        if op == 0 or not live:
            victims = conns.open(n, f"p{peer}")
            if victims is not None:
                assert not busy & set(victims)
                for victim in victims:
                    del peer_of[victim]
                peer_of[n] = f"p{peer}"
        else:
            conn = live[pick % len(live)]
            if op == 1:
                conns.busy(conn)
                busy.add(conn)
            elif op == 2:
                conns.idle(conn)
                busy.discard(conn)
            else:
                conns.close(conn)
                busy.discard(conn)
                del peer_of[conn]
        busy &= set(peer_of)
        assert len(conns) == len(peer_of) <= 8
        for p in {f"p{i}" for i in range(5)}:
            assert conns.of(p) == sum(v == p for v in peer_of.values()) <= 4
        assert conns.idle_count() == len(peer_of) - len(busy)


def test_open_twice_is_a_bug() -> None:
    conns: Connections[str] = Connections(total=2, per_peer=2)
    conns.open("a", "A")
    with pytest.raises(ValueError, match="counted already"):
        conns.open("a", "A")
    with pytest.raises(ValueError, match="positive"):
        Connections(total=0, per_peer=1)


def test_a_body_has_its_grace_and_a_second_more_for_every_min_rate_of_bytes() -> None:
    assert body_due(0, 30, 5, 1000) == 5
    assert body_due(2000, 30, 5, 1000) == 7
    assert body_due(10**9, 30, 5, 1000) == 30  # never beyond the timeout
    assert body_due(0, 30, 5, 0) == 30  # no rate: the timeout alone


def test_the_caps_in_force_keep_the_file_descriptors_for_the_rest() -> None:
    # the default: what the open files leave, at most the ceiling; half of it per peer
    assert connection_caps(None, None, 1024, 200, 16_384) == (824, 412, None)
    assert connection_caps(None, None, 1 << 20, 200, 16_384) == (16_384, 8192, None)
    # set: taken as set, within the files; a peer's cap within the total
    assert connection_caps(500, 600, 1024, 200, 16_384) == (500, 500, None)
    total, peer, warning = connection_caps(5000, None, 1024, 200, 16_384)
    assert (total, peer) == (824, 412)
    assert warning is not None
    assert "limits.max_connections 5000" in warning
    # the reserve would leave almost nothing: a quarter of the files, and a warning
    total, peer, warning = connection_caps(None, None, 256, 250, 16_384)
    assert (total, peer) == (64, 32)
    assert warning is not None
    assert "ulimit -n" in warning
