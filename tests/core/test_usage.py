"""The usage core (sfq_proxy/core/usage.py): UTC periods, folding, prices, budgets and the
ledger's write cycle; and their config (errors name the path, check-config warns)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.config import ConfigError, parse_config
from sfq_proxy.config.summary import summary, warnings
from sfq_proxy.core.usage import (
    COUNTERS,
    Budget,
    Counts,
    Ledger,
    Table,
    budgets_of,
    fold,
    iso,
    money,
    next_start,
    period_start,
    price_of,
)

TIMES = st.integers(min_value=0, max_value=95_617_584_000)  # 1970 to 5000
STEPS = st.sampled_from(["hour", "day", "month"])
DEC_1 = 1_764_547_200  # 2025-12-01T00:00:00Z


def config(**fields: Any) -> Any:
    data = {
        "keys": [{"key": "sk-a", "org": "A", "classes": ["batch"], "name": "a-key"}],
        "pools": {"p": {"models": ["m", "n"], "backends": [{"url": "http://b:8000", "slots": 4}]}},
        **fields,
    }
    return parse_config(yaml.safe_dump(data), environ={})


def errors(**fields: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        config(**fields)
    return caught.value.errors


# -- periods -------------------------------------------------------------------------------


@given(TIMES, STEPS)
def test_a_time_is_in_exactly_one_period_and_the_reset_is_the_next_ones_start(
    t: int, step: Any
) -> None:
    start, end = period_start(t, step), next_start(t, step)
    assert start <= t < end
    assert period_start(end, step) == end
    assert period_start(end - 1, step) == start
    assert next_start(start, step) == end


@given(TIMES, STEPS)
def test_periods_are_utc_calendar_periods(t: int, step: Any) -> None:
    when = datetime.fromtimestamp(t, UTC)
    expected = when.replace(minute=0, second=0)
    if step != "hour":
        expected = expected.replace(hour=0)
    if step == "month":
        expected = expected.replace(day=1)
    assert period_start(t, step) == int(expected.timestamp())
    assert iso(t) == when.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_month_boundaries() -> None:
    assert iso(next_start(DEC_1 + 5, "month")) == "2026-01-01T00:00:00Z"
    feb_2024 = int(datetime(2024, 2, 29, 12, tzinfo=UTC).timestamp())
    assert iso(next_start(feb_2024, "month")) == "2024-03-01T00:00:00Z"
    assert iso(period_start(feb_2024, "day")) == "2024-02-29T00:00:00Z"


# -- folding -------------------------------------------------------------------------------

ROWS = st.lists(
    st.tuples(
        st.integers(0, 24 * 70).map(lambda h: DEC_1 + 3600 * h),
        st.sampled_from(["A", "B"]),
        st.sampled_from(["k1", "k2"]),
        st.sampled_from(["p", "q"]),
        st.sampled_from(["m", "n"]),
        st.integers(0, 10**6),
        st.integers(0, 10**6),
    ),
    max_size=40,
)
GROUPS = st.lists(st.sampled_from(["org", "key", "pool", "model"]), unique=True)


@given(ROWS, GROUPS, st.sampled_from([None, "hour", "day", "month"]))
def test_grouped_sums_equal_the_total(rows: list[Any], group_by: list[str], step: Any) -> None:
    table = Table()
    for hour, org, key, pool, model, prompt, completion in rows:
        table.add((hour, org, key, pool, model), Counts(1, prompt, completion))
    groups = fold(table.rows.items(), group_by, step, DEC_1)
    assert sum(g.counts.requests for g in groups) == len(rows)
    assert sum(g.counts.prompt_tokens for g in groups) == sum(r[5] for r in rows)
    assert sum(g.counts.completion_tokens for g in groups) == sum(r[6] for r in rows)
    keys = [(g.start, g.values) for g in groups]
    assert keys == sorted(set(keys))  # one row per step and group, in order
    assert all(len(g.values) == len(group_by) for g in groups)


def test_between_takes_whole_hours_from_since_to_until() -> None:
    table = Table()
    for hour in (DEC_1 - 3600, DEC_1, DEC_1 + 3600):
        table.add((hour, "A", "k", "p", "m"), Counts(1))
    assert [k[0] for k, _ in table.between(DEC_1 + 10, DEC_1 + 3600)] == [DEC_1]


def test_prune_takes_at_most_a_batch_of_the_hours_before_from_the_front() -> None:
    """The memory store's retention: rows come in time order, so the old ones are first;
    a row of an old hour written late (behind a newer one) goes at a later prune."""
    table = Table()
    for hour in range(5):
        for key in ("k1", "k2"):
            table.add((DEC_1 + hour * 3600, "A", key, "p", "m"), Counts(1))
    table.add((DEC_1, "A", "late", "p", "m"), Counts(1))
    assert table.prune(DEC_1 + 2 * 3600, 3) == 3
    assert table.prune(DEC_1 + 2 * 3600, 3) == 1
    assert table.prune(DEC_1 + 2 * 3600, 3) == 0  # the late row waits behind hour 2's
    assert [k[0] for k in table.rows] == [DEC_1 + h * 3600 for h in (2, 2, 3, 3, 4, 4, 0)]
    assert table.prune(DEC_1 + 5 * 3600, 100) == 7


# -- prices --------------------------------------------------------------------------------


def test_a_model_price_beats_the_pools_star_and_money_is_per_million() -> None:
    prices = {"m": {"prompt_per_1m": 1.0, "completion_per_1m": 2.0},
              "*": {"prompt_per_1m": 5.0, "completion_per_1m": 5.0}}  # fmt: skip
    cfg = config(pools={"p": {"models": ["m", "n"], "prices": prices,
                              "backends": [{"url": "http://b:8000", "slots": 4}]}})  # fmt: skip
    m, n = price_of(cfg, "p", "m"), price_of(cfg, "p", "n")
    assert m is not None
    assert n is not None
    assert money(m, 1_000_000, 500_000) == 2.0
    assert money(n, 200_000, 0) == 1.0
    assert price_of(cfg, "p", "x") == n
    assert price_of(cfg, "nowhere", "m") is None


# -- budgets and the ledger ----------------------------------------------------------------


def ledger_with(**budget: Any) -> tuple[Ledger, Budget]:
    cfg = config(orgs={"A": {"budgets": [{"period": "day", **budget}]}})
    budgets = budgets_of(cfg)
    return Ledger(budgets), budgets[0]


def use(ledger: Ledger, at: int, tokens: int, org: str = "A", money_: float = 0.0) -> None:
    ledger.record((period_start(at, "hour"), org, "a-key", "p", "m"),
                  Counts(1, tokens, 0, money=money_, priced=1))  # fmt: skip


def test_admitted_while_under_the_limit_refused_at_it() -> None:
    ledger, _ = ledger_with(tokens=100)
    use(ledger, DEC_1 + 5, 99)
    assert ledger.refusal("A", "a-key", DEC_1 + 6) is None
    use(ledger, DEC_1 + 7, 1)
    level = ledger.refusal("A", "a-key", DEC_1 + 8)
    assert level is not None
    assert level.used == 100
    assert level.resets == DEC_1 + 86400
    assert level.refusal() == (
        "Budget exceeded: org 'A' has used 100 of its 100 tokens for the day; "
        "it resets at 2025-12-02T00:00:00Z."
    )
    assert ledger.refusal("B", "b-key", DEC_1 + 8) is None
    assert ledger.refusal("A", "a-key", DEC_1 + 86400) is None  # a new day


def test_what_runs_counts_against_a_budget_until_its_usage_replaces_it() -> None:
    """A hundred requests queued while the budget was nearly unused cannot all start on it:
    each dispatched one reserves its estimate, so the next dispatch sees it used."""
    ledger, _ = ledger_with(tokens=20_000)
    now = DEC_1 + 5
    started = 0
    for _ in range(100):  # each checked at its dispatch, as UsageBook.dispatched does
        if ledger.refusal("A", "a-key", now) is not None:
            break
        ledger.reserve("A", "a-key", (1_056, 0.0))
        started += 1
    assert started == 19  # 19 · 1,056 = 20,064 ≥ 20,000: the 20th is refused
    for _ in range(started):  # they end: their usage replaces the reservations
        ledger.reserve("A", "a-key", (1_056, 0.0), sign=-1)
        use(ledger, now, 1_056)
    assert ledger.reserved == {}
    level = ledger.refusal("A", "a-key", now)
    assert level is not None
    assert level.used == 19 * 1_056


def test_a_batch_counts_until_a_read_after_its_write_and_never_twice() -> None:
    ledger, budget = ledger_with(tokens=1000)
    store = Table()

    def used() -> float:
        return ledger.level(budget, DEC_1).used

    use(ledger, DEC_1, 10)
    first = ledger.take()
    use(ledger, DEC_1, 5)  # while the write is under way
    assert used() == 15
    second = ledger.take()
    store.merge(second.rows)  # the second is written, the first failed: read back
    ledger.read(store.totals({"day": DEC_1, "month": DEC_1}), unwritten=[first])
    assert used() == 15
    assert ledger.writing == [first]
    store.merge(first.rows)  # sent again; a read fails: both still counted once
    assert used() == 15
    use(ledger, DEC_1, 1)
    ledger.read(store.totals({"day": DEC_1, "month": DEC_1}), unwritten=[])
    assert used() == 16
    assert ledger.writing == []


def test_a_money_budget_counts_money_and_a_key_budget_its_key() -> None:
    cfg = config(
        keys=[{"key": "sk-a", "org": "A", "classes": ["batch"], "name": "a-key",
               "budgets": [{"period": "month", "money": 1.5}]}],
        pools={"p": {"models": ["m"], "backends": [{"url": "http://b:8000", "slots": 4}],
                     "prices": {"m": {"prompt_per_1m": 1, "completion_per_1m": 1}}}},
    )  # fmt: skip
    ledger = Ledger(budgets_of(cfg))
    use(ledger, DEC_1 + 20 * 86400, 10**9, money_=1.0)
    assert ledger.refusal("A", "a-key", DEC_1 + 25 * 86400) is None
    use(ledger, DEC_1 + 21 * 86400, 10**9, money_=0.5)
    level = ledger.refusal("A", "a-key", DEC_1 + 25 * 86400)
    assert level is not None
    assert level.budget.kind == "key"
    assert "key 'a-key' has spent 1.5 of its money budget of 1.5 for the month" in level.refusal()
    assert ledger.refusal("A", "other-key", DEC_1 + 25 * 86400) is None


def test_the_warning_crosses_once_per_period() -> None:
    ledger, _ = ledger_with(tokens=100, warn_at=0.5)
    use(ledger, DEC_1, 49)
    assert ledger.crossings(DEC_1) == []
    use(ledger, DEC_1, 1)
    assert [c.ratio for c in ledger.crossings(DEC_1)] == [0.5]
    assert ledger.crossings(DEC_1 + 10) == []
    use(ledger, DEC_1 + 86400, 80)
    assert [c.start for c in ledger.crossings(DEC_1 + 86400)] == [DEC_1 + 86400]


# -- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ({"period": "day"}, "needs exactly one of tokens, money"),
        ({"period": "day", "tokens": 5, "money": 1.0}, "needs exactly one of tokens, money"),
        ({"period": "week", "tokens": 5}, "'day' or 'month'"),
        ({"period": "day", "tokens": 0}, "must be > 0"),
        ({"period": "day", "tokens": -3}, "must be > 0"),
        ({"period": "day", "money": float("nan")}, "finite"),
        ({"period": "day", "money": float("inf")}, "finite"),
        ({"period": "day", "tokens": 5, "warn_at": 1}, "must be < 1"),
        ({"period": "day", "tokens": 5, "warn_at": 0}, "must be > 0"),
        ({"period": "day", "tokens": "5"}, "integer"),
    ],
)
def test_a_bad_budget_names_its_path(budget: dict[str, Any], message: str) -> None:
    [(path, text)] = errors(orgs={"A": {"budgets": [budget]}})
    assert path.startswith("orgs.A.budgets[0]"), path
    assert message in text, text


def test_two_budgets_of_one_period_and_unit_and_prices_of_unknown_models_are_errors() -> None:
    twice = [{"period": "day", "tokens": 5}, {"period": "day", "tokens": 9}]
    [(path, text)] = errors(orgs={"A": {"budgets": twice}})
    assert path == "orgs.A.budgets"
    assert "same period and unit" in text
    price = {"prompt_per_1m": 1, "completion_per_1m": 1}
    pools = {"p": {"models": ["m"], "backends": [{"url": "http://b:8000", "slots": 4}],
                   "prices": {"x": price}}}  # fmt: skip
    assert errors(pools=pools) == [("pools.p.prices.x", "is not one of the pool's models, nor *")]
    pools["p"]["prices"] = {"m": {"prompt_per_1m": -1, "completion_per_1m": 1}}
    [(path, _)] = errors(pools=pools)
    assert path == "pools.p.prices.m.prompt_per_1m"


def test_a_money_budget_without_any_price_is_an_error() -> None:
    [(path, text)] = errors(orgs={"A": {"budgets": [{"period": "month", "money": 10}]}})
    assert path == "orgs.A.budgets[0].money"
    assert "needs prices" in text


def test_usage_settings_are_bounded() -> None:
    assert errors(usage={"flush_s": 0})[0][0] == "usage.flush_s"
    assert errors(usage={"retention_days": 31})[0][0] == "usage.retention_days"  # a month
    [(path, text)] = errors(usage={"redis_ttl_days": 400})
    assert (path, text) == ("usage", "redis_ttl_days is now retention_days (for every store)")
    assert errors(usage={"file": ""})[0][0] == "usage.file"


def test_check_config_says_where_usage_is_lost_or_counts_no_money(tmp_path: Any) -> None:
    assert warnings(config()) == []  # no budget, no price: nothing to say
    budgets = {"A": {"budgets": [{"period": "day", "tokens": 5}]}}
    [lost] = warnings(config(orgs=budgets))
    assert lost.startswith("warning: usage.file is not set: usage is kept in this process only")
    assert warnings(config(orgs=budgets, usage={"file": str(tmp_path / "u.db")})) == []
    missing = tmp_path / "no" / "u.db"
    [unwritable] = warnings(config(orgs=budgets, usage={"file": str(missing)}))
    assert "does not exist" in unwritable
    price = {"prompt_per_1m": 1, "completion_per_1m": 1}
    pools = {
        "p": {"models": ["m"], "backends": [{"url": "http://b:8000", "slots": 4}],
              "prices": {"*": price}},
        "q": {"models": ["x"], "backends": [{"url": "http://c:8000", "slots": 4}]},
    }  # fmt: skip
    assert "warning: pools.q has no prices: its requests count no money" in warnings(
        config(pools=pools, usage={"file": str(tmp_path / "u.db")})
    )


def test_check_config_shows_the_budgets_and_where_keys_and_usage_are_kept() -> None:
    day = {"period": "day", "tokens": 100000}
    month = {"period": "month", "money": 50, "warn_at": 0.9}
    prices = {"*": {"prompt_per_1m": 1.0, "completion_per_1m": 2.0}}
    backends = [{"url": "http://b:8000", "slots": 4}]
    pools = {"p": {"models": ["m"], "backends": backends, "prices": prices}}
    cfg = config(
        orgs={"A": {"budgets": [day, month]}},
        pools=pools,
        usage={"file": "/var/lib/sfq/usage.db"},
        key_store_file="/var/lib/sfq/keys.json",
    )
    text = summary(cfg)
    assert (
        "  A: weight=1, budgets [day 100000 tokens (warn 80%), month 50 money (warn 90%)];" in text
    )
    assert "admin API keys: /var/lib/sfq/keys.json\nusage: /var/lib/sfq/usage.db\n" in text
    plain = summary(config())
    assert "admin API keys: off (no key_store_file: only the keys of this file)" in plain
    assert "usage: in the process only (no usage.file)" in plain


def test_adding_counts_adds_every_field() -> None:
    for name in COUNTERS:  # a field added to Counts but not to Counts.add fails here
        total = Counts()
        total.add(Counts(**{name: 2}))
        total.add(Counts(**{name: 3}))
        assert total == Counts(**{name: 5}), name
