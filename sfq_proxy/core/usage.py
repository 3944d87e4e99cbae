"""Usage you can bill from, and budgets: the arithmetic, without I/O or a clock.

Usage is kept in rows keyed by (hour start, org, key, pool, model), each with the counters
of :class:`Counts`; a query folds them into steps (hour, day, calendar month, all UTC) and
groups. A budget limits an org's or a key's tokens or money per day or month; what it has
used is the store's total for the period as last read (``Ledger.base``) plus what this
process counted since and has not yet written (docs/usage-and-budgets.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import islice, takewhile
from typing import Literal

from ..config import BudgetSpec, Config, PriceSpec
from .keys import KeyRecord

HOUR = 3600
DAY = 86400
Step = Literal["hour", "day", "month"]
Kind = Literal["org", "key"]  # whose budget
DIMENSIONS = ("org", "key", "pool", "model")
RowKey = tuple[int, str, str, str, str]  # (hour start, org, key, pool, model)
Period = Literal["day", "month"]
Spent = tuple[int, float]  # (tokens, money) of a subject in a period
SubjectPeriod = tuple[Kind, str, Period, int]  # (kind, name, period, period start)


def add(totals: dict[SubjectPeriod, Spent], at: SubjectPeriod, spent: Spent) -> None:
    tokens, money_ = totals.get(at, (0, 0.0))
    totals[at] = tokens + spent[0], money_ + spent[1]


def period_starts(now: float) -> dict[Period, int]:
    """The starts of the day and the month holding ``now``: the periods budgets count."""
    return {"day": period_start(now, "day"), "month": period_start(now, "month")}


@dataclass(slots=True)
class Counts:
    """What a row counts. ``priced`` is how many of its requests had a price: the money of
    a row none of whose requests had one is unknown (null), not 0."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    charged_cost: float = 0.0
    actual_cost: float = 0.0
    money: float = 0.0
    priced: int = 0

    def add(self, other: Counts) -> None:
        """Field by field, not through ``COUNTERS``: it runs once per request."""
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.charged_cost += other.charged_cost
        self.actual_cost += other.actual_cost
        self.money += other.money
        self.priced += other.priced

    @property
    def spent(self) -> Spent:
        return self.prompt_tokens + self.completion_tokens, self.money


COUNTERS = tuple(f.name for f in fields(Counts))
INT_COUNTERS = frozenset({"requests", "prompt_tokens", "completion_tokens", "priced"})


@dataclass(slots=True)
class Table:
    """Rows of usage, added into."""

    rows: dict[RowKey, Counts] = field(default_factory=dict)

    def add(self, key: RowKey, counts: Counts) -> None:
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = row = Counts()
        row.add(counts)

    def merge(self, rows: Mapping[RowKey, Counts]) -> None:
        for key, counts in rows.items():
            self.add(key, counts)

    def between(self, since: float, until: float) -> Iterator[tuple[RowKey, Counts]]:
        """The rows of the hours that begin in [the hour of ``since``, ``until``)."""
        first = period_start(since, "hour")
        return ((k, c) for k, c in self.rows.items() if first <= k[0] < until)

    def prune(self, before: int, limit: int) -> int:
        """Remove at most ``limit`` rows of the hours before ``before``; how many went.
        Rows are added in time order (a batch written late lags by minutes), so those to
        go are at the front: a call costs what it removes, not the whole table."""
        old = list(islice(takewhile(lambda key: key[0] < before, self.rows), limit))
        for key in old:
            del self.rows[key]
        return len(old)

    def totals(self, starts: Mapping[Period, int]) -> dict[SubjectPeriod, Spent]:
        """Every org's and key's tokens and money from each period's start on."""
        out: dict[SubjectPeriod, Spent] = {}
        for key, counts in self.rows.items():
            for period, start in starts.items():
                if key[0] >= start:
                    add(out, ("org", key[1], period, start), counts.spent)
                    add(out, ("key", key[2], period, start), counts.spent)
        return out

    def spent(self, kind: Kind, name: str, since: int) -> Spent:
        """``kind`` ``name``'s tokens and money in the rows from ``since`` on."""
        at = 1 if kind == "org" else 2
        tokens, money = 0, 0.0
        for key, counts in self.rows.items():
            if key[at] == name and key[0] >= since:
                tokens, money = tokens + counts.spent[0], money + counts.money
        return tokens, money


# -- UTC periods (days since 1970-01-01 to a civil date and back: H. Hinnant's algorithms) --


def _civil(days: int) -> tuple[int, int, int]:
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def _days(year: int, month: int, day: int) -> int:
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146_097 + doe - 719_468


def period_start(t: float, step: Step) -> int:
    """The Unix time at which the UTC hour, day or calendar month holding ``t`` begins."""
    if step == "hour":
        return int(t // HOUR) * HOUR
    days = int(t // DAY)
    if step == "day":
        return days * DAY
    year, month, _ = _civil(days)
    return _days(year, month, 1) * DAY


def next_start(t: float, step: Step) -> int:
    """When the period holding ``t`` ends: the next one's start (a budget's reset)."""
    start = period_start(t, step)
    if step != "month":
        return start + (HOUR if step == "hour" else DAY)
    year, month, _ = _civil(start // DAY)
    return _days(year + month // 12, month % 12 + 1, 1) * DAY


def iso(t: int) -> str:
    """``t`` (whole seconds) as ISO-8601 UTC: 2026-12-02T00:00:00Z."""
    year, month, day = _civil(t // DAY)
    hours, seconds = divmod(t % DAY, 3600)
    return f"{year:04d}-{month:02d}-{day:02d}T{hours:02d}:{seconds // 60:02d}:{seconds % 60:02d}Z"


# -- queries -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Group:
    start: int  # the step's start (the query's since without a step)
    values: tuple[str, ...]  # the group_by dimensions' values, in their order
    counts: Counts


def fold(
    rows: Iterable[tuple[RowKey, Counts]], group_by: Sequence[str], step: Step | None, since: int
) -> list[Group]:
    """``rows`` summed per step and per the values of ``group_by``, in time then name order."""
    at = [1 + DIMENSIONS.index(d) for d in group_by]
    groups: dict[tuple[int, tuple[str, ...]], Counts] = {}
    for key, counts in rows:
        start = since if step is None else max(since, period_start(key[0], step))
        total = groups.setdefault((start, tuple(str(key[i]) for i in at)), Counts())
        total.add(counts)
    return [Group(s, v, c) for (s, v), c in sorted(groups.items(), key=lambda g: g[0])]


# -- prices --------------------------------------------------------------------------------


def price_of(config: Config, pool: str, model: str) -> PriceSpec | None:
    """The price of ``model`` in ``pool``: its own, else the pool's ``"*"``, else none."""
    spec = config.pools.get(pool)
    if spec is None:
        return None
    return spec.prices.get(model) or spec.prices.get("*")


def money(price: PriceSpec, prompt_tokens: int, completion_tokens: int) -> float:
    return (prompt_tokens * price.prompt_per_1m + completion_tokens * price.completion_per_1m) / 1e6


# -- budgets -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    kind: Kind
    name: str  # the org, or the key's name
    spec: BudgetSpec
    org: str  # the org, or the key's org

    @property
    def unit(self) -> Literal["tokens", "money"]:
        return "tokens" if self.spec.tokens is not None else "money"

    @property
    def limit(self) -> float:
        return float(self.spec.tokens if self.spec.tokens is not None else self.spec.money or 0)

    def used(self, spent: Spent) -> float:
        return spent[0] if self.unit == "tokens" else spent[1]


def budgets_of(config: Config, records: Iterable[KeyRecord] = ()) -> list[Budget]:
    """Every budget: the orgs', the file's keys', then those of the admin API's keys
    ``records`` (the ones in force, :func:`~sfq_proxy.core.keys.in_force`), each key's
    under its name (an API key's alias), which no two keys in force share."""
    budgets = [Budget("org", n, b, n) for n, org in config.orgs.items() for b in org.budgets]
    for i, key in enumerate(config.keys):
        name = key.name or f"{key.org}#{i}"
        budgets += [Budget("key", name, b, key.org) for b in key.budgets]
    budgets += [Budget("key", r.alias, b, r.org) for r in records for b in r.budgets]
    return budgets


@dataclass(frozen=True, slots=True)
class Level:
    """A budget as of ``now``: how much of it its period has used, and when it resets."""

    budget: Budget
    used: float
    start: int
    resets: int

    @property
    def ratio(self) -> float:
        return self.used / self.budget.limit

    @property
    def exceeded(self) -> bool:
        """Admitted while used < limit: a request that starts under it may end over it."""
        return self.used >= self.budget.limit

    def refusal(self) -> str:
        b = self.budget
        spend = (
            f"has used {self.used:.0f} of its {b.limit:.0f} tokens"
            if b.unit == "tokens"
            else f"has spent {self.used:.6g} of its money budget of {b.limit:g}"
        )
        return (
            f"Budget exceeded: {b.kind} '{b.name}' {spend} for the {b.spec.period}; "
            f"it resets at {iso(self.resets)}."
        )


class Ledger:
    """This process's side of the usage: rows not yet written (``pending``), batches taken
    to be written and not yet in ``base`` (``writing``), and every org's and key's stored
    total for the day and month as of the last read (``base``). A batch leaves ``writing``
    only when a read made after its write replaces ``base``: nothing counts twice or never.
    (A failed write is sent again as it was, under the same id: the stores apply a batch
    once, so a write whose answer was lost is not counted twice.)"""

    def __init__(self, budgets: list[Budget]) -> None:
        self.budgets = budgets  # and the subjects they limit (the setter)
        self.pending = Table()
        self.writing: list[Table] = []
        # every org's and key's spending in the day and the month of the last read
        self.base: dict[SubjectPeriod, Spent] = {}
        # what the requests dispatched and not yet recorded may spend, per org and key:
        # counted as used until their usage replaces it (``reserve``), with how many they are
        self.reserved: dict[tuple[Kind, str], tuple[int, Spent]] = {}
        self._warned: set[tuple[Budget, int]] = set()

    @property
    def budgets(self) -> list[Budget]:
        return self._budgets

    @budgets.setter
    def budgets(self, budgets: list[Budget]) -> None:
        self._budgets = budgets
        self._limited = frozenset((b.kind, b.name) for b in budgets)

    def limits(self, org: str, key: str) -> bool:
        """Whether a budget applies to ``org`` or ``key``: a request of neither needs no
        reservation, nor a check (most requests: the hot path asks this first)."""
        limited = self._limited
        return bool(limited) and (("org", org) in limited or ("key", key) in limited)

    def record(self, key: RowKey, counts: Counts) -> None:
        self.pending.add(key, counts)

    def reserve(self, org: str, key: str, spent: Spent, sign: int = 1) -> None:
        """A request of ``org`` by ``key`` was dispatched: what it may spend counts as used
        until it ends (``sign`` -1: it ended, its usage recorded instead). So a budget is
        checked against what runs too, and the many requests queued when it was nearly used
        up cannot all start on it: its overshoot is what was running when it was reached."""
        for subject in (("org", org), ("key", key)):
            count, (tokens, money_) = self.reserved.get(subject, (0, (0, 0.0)))
            if count + sign:
                self.reserved[subject] = (
                    count + sign,
                    (tokens + sign * spent[0], money_ + sign * spent[1]),
                )
            else:
                self.reserved.pop(subject, None)

    def take(self) -> Table:
        """The pending rows, a batch now being written."""
        batch, self.pending = self.pending, Table()
        self.writing.append(batch)
        return batch

    def read(self, base: dict[SubjectPeriod, Spent], unwritten: list[Table]) -> None:
        """``base`` was read after every batch taken so far was written, but ``unwritten``."""
        self.writing = [b for b in self.writing if any(b is u for u in unwritten)]
        self.base = base

    def level(self, budget: Budget, now: float) -> Level:
        period = budget.spec.period
        start = period_start(now, period)
        tokens, money_ = self.base.get((budget.kind, budget.name, period, start), (0, 0.0))
        for table in (self.pending, *self.writing):
            more = table.spent(budget.kind, budget.name, start)
            tokens, money_ = tokens + more[0], money_ + more[1]
        _, running = self.reserved.get((budget.kind, budget.name), (0, (0, 0.0)))
        tokens, money_ = tokens + running[0], money_ + running[1]
        return Level(budget, budget.used((tokens, money_)), start, next_start(now, period))

    def refusal(self, org: str, key: str, now: float) -> Level | None:
        """The first budget of ``org`` or ``key`` that is used up, if any."""
        for budget in self.budgets:
            if (budget.kind, budget.name) in (("org", org), ("key", key)):
                level = self.level(budget, now)
                if level.exceeded:
                    return level
        return None

    def crossings(self, now: float) -> list[Level]:
        """Budgets that reached their ``warn_at`` this period and were not reported yet."""
        out = []
        for budget in self.budgets:
            level = self.level(budget, now)
            if level.ratio >= budget.spec.warn_at and (budget, level.start) not in self._warned:
                self._warned.add((budget, level.start))
                out.append(level)
        return out
