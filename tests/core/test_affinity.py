"""Prefix-cache-aware placement (docs/design.md §5, Affinity): the rule, its keys, its config.

Placement only decides *where*: a request with a key goes to the first backend of its key's
rendezvous order that has a free slot and stays within the bounded load (Mirrokni, Thorup,
Zadimoghaddam), else to the least loaded. Pinned here, with hypothesis where it is a
property: deterministic; no slot ever exceeded; the bound holds at every keyed placement;
the reasons (affinity, overflow, fallback) say what happened; a backend that leaves (reload
or health) moves only the keys it came first for, one that joins takes only the keys it now
comes first for; the fair queue's order is the same with affinity on or off; one key sent on
every request cannot fill one backend; only the first ``prefix_chars`` of a prompt count;
a chat's key stays the same from turn to turn; keys are digests, never text.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec, ConfigError, parse_config
from sfq_proxy.config.summary import summary
from sfq_proxy.core import affinity
from sfq_proxy.core.inference_request import Kind, parse
from sfq_proxy.core.placement import Backend, Placement, key_order, rank
from sfq_proxy.core.scheduler import Scheduler, Ticket

KEYS = [affinity.digest("p", f"conversation {i}") for i in range(400)]


def placement(*slots: int, load_factor: float | None = 1.25, slack: int = 0) -> Placement:
    specs = [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=n) for i, n in enumerate(slots, 1)]
    return Placement(specs, load_factor=load_factor, slack=slack)


def firsts(p: Placement, keys: list[str]) -> dict[str, str]:
    """Where each key goes on an idle pool: its first choice among the healthy backends."""
    out = {}
    for key in keys:
        placed = p.place(key)
        assert placed is not None
        backend, reason = placed
        assert reason == "affinity"
        out[key] = backend.name
    return out


# -- the rule -----------------------------------------------------------------------------------


def test_rank_is_52_bits_of_sha1_of_key_newline_name() -> None:
    """The score dispatch.lua computes with redis.sha1hex: exact in a double."""
    import hashlib

    key = KEYS[0]
    expected = int(hashlib.sha1(f"{key}\n10.0.0.1:8000".encode()).hexdigest()[:13], 16)
    assert rank(key, "10.0.0.1:8000") == expected < 2**52


def test_an_idle_pool_sends_a_key_to_its_first_choice_and_spreads_keys() -> None:
    p = placement(4, 4, 4)
    where = firsts(p, KEYS)
    for key, name in where.items():
        assert name == key_order(key, p.backends)[0].name
    counts = {b.name: list(where.values()).count(b.name) for b in p.backends}
    assert all(100 < n < 170 for n in counts.values()), counts  # about a third each


def test_no_key_or_affinity_off_is_least_loaded_first_listed_on_ties() -> None:
    p = placement(4, 2)
    a, b = p.backends
    assert p.place(None) == (a, "fallback")
    a.in_flight = 1
    assert p.place(None) == (b, "fallback")
    off = placement(4, 2, load_factor=None)
    key = next(k for k in KEYS if key_order(k, off.backends)[0] is off.backends[1])
    assert off.place(key) == (off.backends[0], "fallback")  # the key means nothing


def test_a_full_or_overloaded_first_choice_overflows_down_the_keys_order() -> None:
    p = placement(2, 2, 2)
    key = KEYS[1]
    first, second, _ = key_order(key, p.backends)
    first.in_flight = 2  # full
    assert p.place(key) == (second, "overflow")
    first.in_flight, second.in_flight = 1, 0
    # R = 1, S = 6: the first may hold ⌈1.25 · 2 · 2 / 6⌉ = 1 after placing: it has 1 already
    assert p.place(key) == (second, "overflow")
    second.in_flight = 1  # R = 2: ⌈1.25 · 3 · 2 / 6⌉ = 2: room on the first again
    assert p.place(key) == (first, "affinity")


def test_health_down_moves_the_key_to_the_next_of_its_order_as_its_first_choice() -> None:
    p = placement(2, 2, 2)
    key = KEYS[2]
    first, second, _ = key_order(key, p.backends)
    p.mark_down(first, until=10.0)
    assert p.place(key) == (second, "affinity")  # the first healthy one of its order
    assert p.mark_up(first, now=10.0)
    assert p.place(key) == (first, "affinity")


@given(
    pool=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 8), st.none() | st.integers(0, 6)),
        min_size=1,
        max_size=4,
    ),
    key=st.sampled_from(KEYS[:20]),
    factor=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    slack=st.integers(0, 3),
)
def test_a_key_always_finds_its_place_while_a_slot_is_free(
    pool: list[tuple[int, int, int | None]], key: str, factor: float, slack: int
) -> None:
    """Some backend of a key's order is within the bound whenever one has a free slot, even
    when a replica runs more than its share (Redis lost): the least-loaded fallback is only
    for requests without a key, and no request waits for affinity's sake."""
    p = placement(*(slots for slots, _, _ in pool), load_factor=factor, slack=slack)
    for backend, (_, running, part) in zip(p.backends, pool, strict=True):
        backend.in_flight, backend.share = running, part
    placed = p.place(key)
    free = [b for b in p.backends if b.in_flight < b.limit]
    assert (placed is None) == (not free)
    if placed is not None:
        assert placed[1] != "fallback"
        assert placed[0] in free


@dataclass
class Step:
    place: bool  # place a request (else finish one)
    key: int  # index into KEYS, -1: no key
    pick: int  # which running request finishes


STEPS = st.lists(
    st.builds(Step, st.booleans(), st.integers(-1, 7), st.integers(0, 1000)),
    min_size=1,
    max_size=80,
)


def play(
    slots: list[int], factor: float, steps: list[Step], slack: int = 0
) -> list[tuple[str, str] | None]:
    """Place and finish as ``steps`` say, checking every placement; returns them."""
    p = placement(*slots, load_factor=factor, slack=slack)
    running: list[Backend] = []
    out: list[tuple[str, str] | None] = []
    for step in steps:
        if not step.place:
            if running:
                p.release(running.pop(step.pick % len(running)))
            continue
        key = KEYS[step.key] if step.key >= 0 else None
        before = {b.name: b.in_flight for b in p.backends}
        total_running, total_slots = sum(before.values()), sum(slots)
        placed = p.place(key)
        if placed is None:
            assert all(b.in_flight >= b.slots for b in p.backends)  # only a full pool waits
            out.append(None)
            continue
        backend, reason = placed
        bound = math.ceil(factor * (total_running + 1) * backend.slots / total_slots) + slack
        order = key_order(key, p.backends) if key is not None else []
        if reason == "affinity":
            assert backend is order[0]
        if reason in ("affinity", "overflow"):
            assert backend.in_flight + 1 <= bound  # the bounded load
            for earlier in order[: order.index(backend)]:  # each skipped one: full or over
                cap = math.ceil(factor * (total_running + 1) * earlier.slots / total_slots) + slack
                assert earlier.in_flight >= earlier.slots or earlier.in_flight + 1 > cap
        else:
            assert key is None  # with every backend healthy and whole, never a fallback
            assert backend.load == min(b.load for b in p.backends if b.in_flight < b.slots)
        p.acquire(backend)  # raises if a slot were exceeded
        assert all(b.in_flight <= b.slots for b in p.backends)
        running.append(backend)
        out.append((backend.name, reason))
    return out


@given(
    slots=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    factor=st.sampled_from([1.0, 1.1, 1.25, 2.0, 3.7]),
    steps=STEPS,
    slack=st.integers(0, 3),
)
def test_placement_is_deterministic_bounded_and_never_over_a_slot(
    slots: list[int], factor: float, steps: list[Step], slack: int
) -> None:
    assert play(slots, factor, steps, slack) == play(slots, factor, steps, slack)


@given(slots=st.lists(st.integers(1, 8), min_size=2, max_size=5), data=st.data())
def test_a_backend_removed_by_reload_moves_only_its_own_keys(
    slots: list[int], data: st.DataObject
) -> None:
    specs = [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=n) for i, n in enumerate(slots)]
    p = Placement(specs, load_factor=1.25)
    before = firsts(p, KEYS[:100])
    gone = data.draw(st.integers(0, len(specs) - 1))
    p.update([s for i, s in enumerate(specs) if i != gone])
    after = firsts(p, KEYS[:100])
    moved = {k for k in before if before[k] != after[k]}
    assert {k for k in before if before[k] == specs[gone].name} == moved


@given(slots=st.lists(st.integers(1, 8), min_size=1, max_size=4), extra=st.integers(1, 8))
def test_a_backend_added_by_reload_takes_only_the_keys_it_now_comes_first_for(
    slots: list[int], extra: int
) -> None:
    specs = [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=n) for i, n in enumerate(slots)]
    p = Placement(specs, load_factor=1.25)
    before = firsts(p, KEYS[:100])
    new = BackendSpec(url="http://10.0.0.99:8000", slots=extra)
    p.update([*specs, new])
    assert firsts(p, KEYS[:100]) == before  # a new backend waits for its first good probe
    p.mark_up(p.backends[-1], now=0.0)
    after = firsts(p, KEYS[:100])
    moved = {k for k in before if before[k] != after[k]}
    assert all(after[k] == new.name for k in moved)
    assert moved == {k for k in after if after[k] == new.name}


@given(slots=st.lists(st.integers(1, 8), min_size=2, max_size=5), data=st.data())
def test_health_down_and_up_moves_only_that_backends_keys_and_back(
    slots: list[int], data: st.DataObject
) -> None:
    p = placement(*slots)
    before = firsts(p, KEYS[:100])
    down = p.backends[data.draw(st.integers(0, len(slots) - 1))]
    p.mark_down(down, until=1.0)
    during = firsts(p, KEYS[:100])
    assert {k for k in before if before[k] != during[k]} == {
        k for k in before if before[k] == down.name
    }
    p.mark_up(down, now=1.0)
    assert firsts(p, KEYS[:100]) == before


def test_one_key_on_every_request_cannot_fill_one_backend() -> None:
    """The adversary: every request with the same session key. The bounded load caps its
    first choice at ⌈1.25 · R · slots / S⌉ at each placement, so the pool fills evenly
    instead of one backend taking everything."""
    p = placement(8, 8, 8, 8)
    key = affinity.request_key("mallory", "same-session", None, None)
    assert key is not None
    where = []
    for n in range(1, 33):
        backend, _ = p.place(key) or (None, None)
        assert backend is not None
        cap = math.ceil(1.25 * n * 8 / 32)
        p.acquire(backend)
        assert backend.in_flight <= cap
        where.append(backend.name)
    first = key_order(key, p.backends)[0]
    assert all(b.in_flight == 8 for b in p.backends)
    assert where[0] == first.name  # then its next ones go down its order, within the bound
    assert max(where[:16].count(b.name) for b in p.backends) <= 5  # ⌈1.25 · 16 · 8 / 32⌉


@given(
    slots=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    factor=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    slack=st.integers(0, 4),
    keys=st.lists(st.sampled_from(KEYS[:4]), min_size=1, max_size=3),
)
def test_a_flood_of_few_keys_puts_no_backend_over_the_bound_plus_the_slack(
    slots: list[int], factor: float, slack: int, keys: list[str]
) -> None:
    """The slack loosens the bound by a constant, never more: a client sending one key (or a
    few) on every request until the pool is full places at most ⌈load_factor · n · slots /
    S⌉ + slack of them on any backend at each placement (n the requests placed), and still
    fills the pool."""
    p = placement(*slots, load_factor=factor, slack=slack)
    total = sum(slots)
    for n in range(1, total + 1):
        placed = p.place(keys[n % len(keys)])
        assert placed is not None
        backend, reason = placed
        assert reason != "fallback"
        p.acquire(backend)
        for b in p.backends:
            assert b.in_flight <= math.ceil(factor * n * b.slots / total) + slack
    assert p.place(keys[0]) is None  # full: every slot was given


def test_the_slack_keeps_a_light_load_on_the_keys_first_choice() -> None:
    """At light load the bound alone is 1 or 2: a key's second request at once leaves its
    first choice (2 on it is over ⌈1.25 · 2 · 8 / 32⌉ = 1), its fourth comes back (⌈1.25 ·
    4 · 8 / 32⌉ = 2). With the default slack of 2 it stays, up to the bound plus two: the
    fifth is over ⌈1.25 · 5 · 8 / 32⌉ + 2 = 4."""
    key = KEYS[3]
    for slack, expected in ((0, "abba"), (2, "aaaab")):
        p = placement(8, 8, 8, 8, slack=slack)
        first = key_order(key, p.backends)[0]
        runs = ""
        for _ in expected:
            backend, _ = p.place(key) or (None, None)
            assert backend is not None
            p.acquire(backend)
            runs += "a" if backend is first else "b"
        assert runs == expected


# -- the scheduler: placement decides where, never which ----------------------------------------


@given(
    slots=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.integers(-1, 5), st.integers(0, 99)),
        min_size=1,
        max_size=60,
    ),
)
def test_the_fair_queue_dispatches_the_same_tickets_in_the_same_order_with_affinity(
    slots: list[int], ops: list[tuple[bool, int, int, int]]
) -> None:
    """Affinity changes backends, never which ticket goes next nor when: a ticket waits only
    when every healthy backend is full, with affinity or without."""

    def run(load_factor: float | None) -> list[int]:
        specs = [BackendSpec(url=f"http://b{i}:8000", slots=n) for i, n in enumerate(slots)]
        sched = Scheduler(Placement(specs, load_factor=load_factor))
        order: list[int] = []
        running: list[Ticket] = []
        tickets: dict[int, int] = {}
        for i, (submit, org, key, pick) in enumerate(ops):
            if submit:
                ticket = Ticket(
                    f"o{org}", "x", 1.0 + key % 3, affinity=KEYS[key] if key >= 0 else None
                )
                tickets[id(ticket)] = i
                dispatched = sched.submit(ticket, 0.0)
            elif running:
                dispatched = sched.finish(running.pop(pick % len(running)), 0.0)
            else:
                continue
            running += dispatched
            order += [tickets[id(t)] for t in dispatched]
        return order

    assert run(1.25) == run(None) == run(1.0)


def test_a_dispatched_ticket_says_why_it_went_where_it_did() -> None:
    specs = [BackendSpec(url=f"http://b{i}:8000", slots=1) for i in range(2)]
    sched = Scheduler(Placement(specs, load_factor=1.25))
    key = KEYS[3]
    keyed = [Ticket("a", "x", 1.0, affinity=key) for _ in range(2)]
    (first,) = sched.submit(keyed[0], 0.0)
    (second,) = sched.submit(keyed[1], 0.0)
    assert (first.placed, second.placed) == ("affinity", "overflow")
    assert first.backend is key_order(key, sched.placement.backends)[0]
    sched.finish(first, 0.0)
    (plain,) = sched.submit(Ticket("b", "x", 1.0), 0.0)
    assert plain.placed == "fallback"


# -- keys -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Aff:
    prefix_chars: int = 64
    use_user_field: bool = False


def chat(*messages: tuple[str, str], **extra: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}
    return json.dumps(body).encode()


ON = Aff()


def keys_of(
    raw: bytes, settings: Aff | None = ON, kind: Kind = Kind.CHAT
) -> tuple[str | None, str | None]:
    request = parse(kind, raw, affinity_of=lambda _model: settings)
    return request.affinity_prefix, request.affinity_user


SYSTEM = ("system", "You are the support assistant of ACME. " * 2)


def test_a_chats_key_stays_the_same_from_turn_to_turn() -> None:
    turn1 = chat(SYSTEM, ("user", "my order is late"))
    turn2 = chat(SYSTEM, ("user", "my order is late"), ("assistant", "Sorry!"), ("user", "and?"))
    other = chat(SYSTEM, ("user", "my invoice is wrong"))
    wide = Aff(prefix_chars=4096)
    assert keys_of(turn1, wide)[0] == keys_of(turn2, wide)[0] != keys_of(other, wide)[0]
    # with a prefix shorter than the system prompt, every conversation of it shares a key
    narrow = Aff(prefix_chars=20)
    assert keys_of(turn1, narrow)[0] == keys_of(other, narrow)[0]


def test_only_the_first_prefix_chars_of_a_huge_prompt_count() -> None:
    head = "x" * 64
    a = json.dumps({"model": "m", "prompt": head + "A" * 1_000_000}).encode()
    b = json.dumps({"model": "m", "prompt": head + "B" * 10}).encode()
    c = json.dumps({"model": "m", "prompt": "y" + head}).encode()
    prefix = [keys_of(raw, kind=Kind.COMPLETION)[0] for raw in (a, b, c)]
    assert prefix[0] == prefix[1] != prefix[2]
    assert affinity.chat_prefix([("user", "z" * 10_000)], 64) == ("user\n" + "z" * 59)
    assert affinity.prompt_prefix([[1, 2, 3], [4]], 4) == "1,2,"
    assert affinity.prompt_prefix([5, 6, 7], 3) == "5,6"
    assert affinity.prompt_prefix(["first", "second"], 64) == "first"


def test_keys_are_digests_never_text_and_none_without_affinity_or_input() -> None:
    secret = "sk-live-SECRET and the user's very private prompt"
    raw = chat(("system", secret), ("user", secret), user=secret)
    prefix, user = keys_of(raw, Aff(prefix_chars=4096, use_user_field=True))
    for key in (prefix, user, affinity.request_key("org", secret, None, None)):
        assert key is not None
        assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert keys_of(raw, None) == (None, None)  # the pool has no affinity
    assert keys_of(raw, Aff(prefix_chars=0)) == (None, None)  # prefix 0; user not read
    embedding = json.dumps({"model": "m", "input": "hello"}).encode()
    assert keys_of(embedding, kind=Kind.EMBEDDING) == (None, None)  # no KV cache to reuse


def test_a_named_session_wins_and_every_key_is_scoped_to_its_org() -> None:
    prefix = affinity.prefix_key("some prompt")
    by_header = affinity.request_key("a", "s-1", "u-digest", prefix)
    assert by_header == affinity.request_key("a", "s-1", None, None)  # the header first
    assert by_header != affinity.request_key("b", "s-1", None, None)  # another org's
    by_user = affinity.request_key("a", None, "u-digest", prefix)
    by_prefix = affinity.request_key("a", None, None, prefix)
    assert len({by_header, by_user, by_prefix}) == 3
    assert affinity.request_key("a", "", None, prefix) == by_prefix  # an empty header: none
    # two orgs' identical prompts go their own ways: no placement-made cache side channel
    assert affinity.request_key("b", None, None, prefix) != by_prefix
    assert affinity.request_key("a", None, None, None) is None


# -- config ---------------------------------------------------------------------------------------


def config_with(affinity_section: Any) -> dict[str, Any]:
    return {
        "keys": [{"key": "sk-a", "org": "a", "classes": ["batch"]}],
        "pools": {
            "llama": {
                "models": ["m"],
                "backends": [{"url": "http://10.0.0.1:8000", "slots": 4}],
                "affinity": affinity_section,
            }
        },
    }


def errors(section: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(yaml.safe_dump(config_with(section)), environ={})
    return str(info.value).splitlines()


def test_affinity_is_off_by_default_and_has_its_defaults_when_set() -> None:
    plain = config_with(None)
    assert parse_config(yaml.safe_dump(plain), environ={}).pools["llama"].affinity is None
    spec = parse_config(yaml.safe_dump(config_with({})), environ={}).pools["llama"].affinity
    assert spec is not None
    assert (
        spec.prefix_chars, spec.session_header, spec.use_user_field, spec.load_factor, spec.slack
    ) == (4096, None, False, 1.25, 2)  # fmt: skip


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"prefix_chars": -1}, ".prefix_chars: must be >= 0"),
        ({"prefix_chars": 1.5}, ".prefix_chars: expected an integer"),
        ({"load_factor": 0.99}, ".load_factor: must be >= 1"),
        ({"load_factor": float("inf")}, ".load_factor: must be a finite number"),
        ({"load_factor": float("nan")}, ".load_factor: must be a finite number"),
        ({"load_factor": 101}, ".load_factor: must be <= 100"),
        ({"slack": -1}, ".slack: must be >= 0"),
        ({"slack": 1.5}, ".slack: expected an integer"),
        ({"session_header": "x session"}, ".session_header: must be an HTTP header name"),
        ({"session_header": "Authorization"}, ".session_header: must not be a credential header"),
        ({"use_user_field": "yes"}, ".use_user_field: expected true or false"),
        (
            {"prefix_chars": 0},
            ": with prefix_chars 0 no request has a key: set session_header or use_user_field",
        ),
        ({"prefix": 10}, ".prefix: unknown field"),
    ],
)
def test_invalid_affinity_settings_fail_with_the_path_of_the_field(
    section: dict[str, Any], expected: str
) -> None:
    assert errors(section) == ["pools.llama.affinity" + expected]


def test_check_config_shows_a_pools_affinity() -> None:
    section = {"prefix_chars": 2048, "session_header": "X-Session-Id", "use_user_field": True}
    config = parse_config(yaml.safe_dump(config_with(section)), environ={})
    line = next(x for x in summary(config).splitlines() if "affinity" in x)
    assert line == (
        "  affinity: by the session named by header X-Session-Id or the body's user field, "
        "else the prompt's first 2048 chars (chat: up to its first answer); a backend takes at "
        "most 1.25× the pool's average load + 2, else the key's next"
    )
    assert "affinity" not in summary(parse_config(yaml.safe_dump(config_with(None)), environ={}))
