"""Where usage is kept, and the book that counts it and enforces budgets.

Three stores, one interface (docs/usage-and-budgets.md): in the process only (``usage.file``
unset, memory mode), a SQLite file (memory mode; written off the event loop), or Redis
(``state: redis``: every replica adds into the same hourly hashes). The book counts each
request that reached a backend into this process's ``Ledger`` and writes the rows every
``usage.flush_s``, then reads back the day's and month's totals per org and key that
budgets are checked against; queries read the store plus what is not yet written. Rows
older than ``usage.retention_days`` are pruned at start and every hour, a bounded batch at
a time (Redis's expire on their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from ..config import Config
from ..core.errors import ApiError
from ..core.keys import KeyRecord
from ..core.usage import (
    COUNTERS,
    DAY,
    HOUR,
    INT_COUNTERS,
    Counts,
    Ledger,
    Level,
    Period,
    RowKey,
    Spent,
    SubjectPeriod,
    Table,
    add,
    budgets_of,
    money,
    period_start,
    period_starts,
    price_of,
)

log = logging.getLogger(__name__)
Rows = list[tuple[RowKey, Counts]]
REDIS_PREFIX = "sfq:{usage}:"  # one hash tag: one slot of a Redis Cluster, one pipeline


class Served(Protocol):
    """What the book reads of a request (the access log's record): this layer sits below
    the HTTP surface, so it names the fields, not the record's type."""

    @property
    def org(self) -> str | None: ...
    @property
    def key(self) -> str | None: ...
    @property
    def pool(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def backend(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def cost(self) -> float | None: ...
    @property
    def cost_actual(self) -> float | None: ...


class Store(Protocol):
    async def add(self, batch: str, rows: Mapping[RowKey, Counts]) -> None:
        """Add ``rows``, unless a batch of this id was added already (within a day)."""

    async def rows(self, since: int, until: int) -> Rows: ...

    async def totals(self, starts: Mapping[Period, int]) -> dict[SubjectPeriod, Spent]: ...

    async def prune(self, before: int, limit: int) -> int:
        """Remove at most ``limit`` rows of the hours before ``before``; how many went."""

    async def close(self) -> None: ...


class MemoryStore:
    """Usage in the process only: lost at restart (check-config says so)."""

    def __init__(self) -> None:
        self._table = Table()

    async def add(self, batch: str, rows: Mapping[RowKey, Counts]) -> None:
        self._table.merge(rows)  # cannot fail halfway: no id to remember

    async def rows(self, since: int, until: int) -> Rows:
        return list(self._table.between(since, until))

    async def totals(self, starts: Mapping[Period, int]) -> dict[SubjectPeriod, Spent]:
        return self._table.totals(starts)

    async def prune(self, before: int, limit: int) -> int:
        return self._table.prune(before, limit)

    async def close(self) -> None:
        return None


_COLUMNS = ", ".join(COUNTERS)
_SCHEMA = f"""CREATE TABLE IF NOT EXISTS usage (
    hour INTEGER NOT NULL, org TEXT NOT NULL, key TEXT NOT NULL, pool TEXT NOT NULL,
    model TEXT NOT NULL, {", ".join(f"{c} {'INTEGER' if c in INT_COUNTERS else 'REAL'} NOT NULL"
                                   for c in COUNTERS)},
    PRIMARY KEY (hour, org, key, pool, model)) WITHOUT ROWID"""  # fmt: skip
_UPSERT = (
    f"INSERT INTO usage (hour, org, key, pool, model, {_COLUMNS}) "
    f"VALUES ({', '.join('?' * (5 + len(COUNTERS)))}) ON CONFLICT DO UPDATE SET "
    + ", ".join(f"{c} = {c} + excluded.{c}" for c in COUNTERS)
)
_SELECT = f"SELECT hour, org, key, pool, model, {_COLUMNS} FROM usage WHERE hour >= ? AND hour < ?"
BATCH_MEMORY_S = DAY  # how long a store remembers a batch it applied
PRUNE_EVERY_S = HOUR  # rows are kept per hour
PRUNE_BATCH = 5000  # rows a pruning transaction removes at most (bench/usage_retention.py)
_BATCHES = "CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, at REAL NOT NULL)"
_TOTALS = (
    "SELECT {0}, SUM(prompt_tokens + completion_tokens), SUM(money) FROM usage "
    "WHERE hour >= ? GROUP BY {0}"
)
_KEY = "hour, org, key, pool, model"
_PRUNE = f"DELETE FROM usage WHERE ({_KEY}) IN (SELECT {_KEY} FROM usage WHERE hour < ? LIMIT ?)"


class SqliteStore:
    """One table of hourly rows, added into (an upsert per row of a flush, one transaction;
    WAL). Every call runs in a worker thread, one at a time (the book's lock)."""

    def __init__(self, path: Path, wall: Callable[[], float]) -> None:
        self._wall = wall  # when a batch was applied: remembered for BATCH_MEMORY_S
        _private(path)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._db.execute(_BATCHES)

    async def add(self, batch: str, rows: Mapping[RowKey, Counts]) -> None:
        values = [(*key, *(getattr(c, n) for n in COUNTERS)) for key, c in rows.items()]
        # in a thread that goes on if the flush is cancelled: the id makes the retry a no-op
        await asyncio.to_thread(self._write, batch, values, self._wall())

    def _write(self, batch: str, values: list[tuple[Any, ...]], now: float) -> None:
        with contextlib.closing(self._db.cursor()) as cursor:
            cursor.execute("BEGIN IMMEDIATE")
            try:
                cursor.execute("DELETE FROM batches WHERE at < ?", (now - BATCH_MEMORY_S,))
                cursor.execute("INSERT OR IGNORE INTO batches VALUES (?, ?)", (batch, now))
                if cursor.rowcount == 1:  # not applied before
                    cursor.executemany(_UPSERT, values)
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")

    async def rows(self, since: int, until: int) -> Rows:
        found = await asyncio.to_thread(self._read, _SELECT, (since, until))
        return [(tuple(r[:5]), Counts(*r[5:])) for r in found]

    async def totals(self, starts: Mapping[Period, int]) -> dict[SubjectPeriod, Spent]:
        out: dict[SubjectPeriod, Spent] = {}
        for period, start in starts.items():
            for kind in ("org", "key"):
                found = await asyncio.to_thread(self._read, _TOTALS.format(kind), (start,))
                for name, tokens, money_ in found:
                    add(out, (kind, name, period, start), (int(tokens), float(money_)))
        return out

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, args).fetchall()

    async def prune(self, before: int, limit: int) -> int:
        """One transaction of at most ``limit`` rows, found by the primary key's first
        column: the writer is held for that batch only."""
        return await asyncio.to_thread(self._delete, before, limit)

    def _delete(self, before: int, limit: int) -> int:
        return self._db.execute(_PRUNE, (before, limit)).rowcount

    async def close(self) -> None:
        await asyncio.to_thread(self._db.close)


def _private(path: Path) -> None:
    """``path`` created 0600, or made so, before SQLite opens it: the rows name every org
    and key. SQLite gives the ``-wal`` and ``-shm`` files it makes the database's mode;
    those a crash left are made 0600 too."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        with contextlib.suppress(FileNotFoundError):
            name.chmod(0o600)


class RedisStore:
    """A hash per hour (``sfq:{usage}:h:<hour>``, a field per row and counter) and a hash
    per day and month with each org's and key's tokens and money, for budgets
    (``sfq:{usage}:day:<start>``); every hash expires ``ttl_s`` after its last write."""

    def __init__(self, redis: Redis | RedisCluster, ttl_s: int) -> None:
        self._redis, self._ttl_s = redis, ttl_s
        self._add = redis.register_script(_ADD)

    async def add(self, batch: str, rows: Mapping[RowKey, Counts]) -> None:
        """One script: all of the batch or nothing, and once (its id is remembered)."""
        keys = [f"{REDIS_PREFIX}batch:{batch}"]
        args: list[str | int] = [BATCH_MEMORY_S, self._ttl_s]

        def incr(name: str, field: list[str], value: float, integer: bool) -> None:
            if name not in keys:
                keys.append(name)
            args.extend([keys.index(name) + 1, "i" if integer else "f", json.dumps(field),
                         str(value) if integer else f"{value:.17g}"])  # fmt: skip

        for key, counts in rows.items():
            for name in COUNTERS:
                field = [*key[1:], name]
                incr(
                    f"{REDIS_PREFIX}h:{key[0]}", field, getattr(counts, name), name in INT_COUNTERS
                )
            for period, start in period_starts(key[0]).items():
                for kind, name in (("org", key[1]), ("key", key[2])):
                    where = f"{REDIS_PREFIX}{period}:{start}"
                    incr(where, [kind, name, "tokens"], counts.spent[0], True)
                    incr(where, [kind, name, "money"], counts.money, False)
        await self._add(keys=keys, args=args)

    async def rows(self, since: int, until: int) -> Rows:
        hours = range(period_start(since, "hour"), until, HOUR)
        pipe = self._redis.pipeline(transaction=False)
        for hour in hours:
            pipe.hgetall(f"{REDIS_PREFIX}h:{hour}")
        table = Table()
        for hour, found in zip(hours, await pipe.execute(), strict=True):
            for field, value in found.items():
                *names, counter = json.loads(field)
                number = int(value) if counter in INT_COUNTERS else float(value)
                table.add((hour, *names), Counts(**{counter: number}))  # type: ignore[arg-type]
        return list(table.rows.items())

    async def totals(self, starts: Mapping[Period, int]) -> dict[SubjectPeriod, Spent]:
        out: dict[SubjectPeriod, Spent] = {}
        for period, start in starts.items():
            found = await self._redis.hgetall(f"{REDIS_PREFIX}{period}:{start}")
            for field, value in found.items():
                kind, name, unit = json.loads(field)
                spent = (int(value), 0.0) if unit == "tokens" else (0, float(value))
                add(out, (kind, name, period, start), spent)
        return out

    async def prune(self, before: int, limit: int) -> int:
        """Nothing to do: every hash expires ``ttl_s`` after its last write."""
        return 0

    async def close(self) -> None:
        return None  # the client is the shared state's, closed with it


# KEYS[1]: the batch's marker, the rest the hashes; ARGV: the marker's and the hashes' TTLs,
# then (hash index, "i" or "f", field, amount) per increment
_ADD = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 3, #ARGV, 4 do
  local op = ARGV[i + 1] == 'i' and 'HINCRBY' or 'HINCRBYFLOAT'
  redis.call(op, KEYS[tonumber(ARGV[i])], ARGV[i + 2], ARGV[i + 3])
end
for j = 2, #KEYS do redis.call('EXPIRE', KEYS[j], ARGV[2]) end
return 1
"""


class UsageBook:
    """Counts what each request used, writes it every ``flush_s``, checks budgets."""

    def __init__(self, config: Config, store: Store, wall: Callable[[], float]) -> None:
        self.config, self.store, self.wall = config, store, wall
        self.ledger = Ledger(budgets_of(config))
        # id(record) → (org, key, spent): the reservations of the requests dispatched, by
        # record (not by request id, which a client chooses)
        self._reserved: dict[int, tuple[str, str, Spent]] = {}
        self._lock = asyncio.Lock()  # one write or read of the store at a time
        self._unwritten: list[tuple[str, Table]] = []  # (id, batch): sent again as they were
        self._ids = (f"{secrets.token_hex(8)}.{n}" for n in itertools.count())

    def reconfigure(self, config: Config, records: Iterable[KeyRecord]) -> None:
        """A reload, or a change of the admin API's keys in force (``records``): new
        budgets and prices apply at once; what was used stays."""
        self.config = config
        self.ledger.budgets = budgets_of(config, records)

    def dispatched(self, record: Served, input_tokens: int, max_tokens: int) -> None:
        """A request of ``record``'s org and key is about to be sent upstream, with its
        estimated input and at most ``max_tokens`` of output: refused (the 429 of ``check``)
        if a budget is used up by now, counting what runs; else what it may spend is
        reserved until ``record``. Once per request: a retry keeps its reservation."""
        org, key = record.org or "", record.key or ""
        if not self.ledger.limits(org, key):
            return
        self.check(org, key)
        if id(record) in self._reserved:
            return
        price = price_of(self.config, record.pool or "", record.model or "")
        cost = 0.0 if price is None else money(price, input_tokens, max_tokens)
        spent = (input_tokens + max_tokens, cost)
        self._reserved[id(record)] = (org, key, spent)
        self.ledger.reserve(org, key, spent)

    def record(self, record: Served) -> None:
        """A request that reached a backend, at its end (its tokens as the backend reported)."""
        reserved = self._reserved.pop(id(record), None)
        if reserved is not None:
            self.ledger.reserve(*reserved, sign=-1)
        if record.backend is None or not (record.org and record.pool and record.model):
            return
        prompt, completion = record.prompt_tokens or 0, record.completion_tokens or 0
        price = price_of(self.config, record.pool, record.model)
        counts = Counts(
            requests=1,
            prompt_tokens=prompt,
            completion_tokens=completion,
            charged_cost=record.cost or 0.0,
            actual_cost=record.cost_actual or 0.0,
            money=0.0 if price is None else money(price, prompt, completion),
            priced=int(price is not None),
        )
        hour = period_start(self.wall(), "hour")
        self.ledger.record((hour, record.org, record.key or "", record.pool, record.model), counts)

    def check(self, org: str, key: str) -> None:
        """Refuse a request of ``org`` by ``key`` once one of their budgets is used up."""
        now = self.wall()
        level = self.ledger.refusal(org, key, now)
        if level is not None:
            raise ApiError(
                429, level.refusal(), code="budget_exceeded", retry_after=level.resets - now
            )

    def levels(self) -> list[Level]:
        """Every budget as of now (the ``sfq_budget_used_ratio`` gauge)."""
        now = self.wall()
        return [self.ledger.level(budget, now) for budget in self.ledger.budgets]

    async def flush(self) -> None:
        """Write what is pending, then read the day's and month's totals back."""
        async with self._lock:
            batch = self.ledger.take()
            if batch.rows:
                self._unwritten.append((next(self._ids), batch))
            while self._unwritten:  # a failure leaves the rest for the next flush
                await self.store.add(self._unwritten[0][0], self._unwritten[0][1].rows)
                del self._unwritten[0]
            base = await self.store.totals(period_starts(self.wall()))
            self.ledger.read(base, [b for _, b in self._unwritten])
        for level in self.ledger.crossings(self.wall()):
            _warn(level)

    async def flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.usage.flush_s)
            try:  # shielded: cancelled at shutdown, a write ends before the last flush
                await asyncio.shield(self.flush())
            except Exception as err:  # a full disk or a lost Redis: kept for the next try
                log.warning("usage: cannot write it (kept for the next try): %s", err)

    async def prune_forever(self) -> None:
        """Prune at start, then every ``PRUNE_EVERY_S``."""
        while True:
            try:
                await self.prune()
            except Exception as err:  # a full disk, say: the next round tries again
                log.warning("usage: cannot prune the rows past retention_days: %s", err)
            await asyncio.sleep(PRUNE_EVERY_S)

    async def prune(self) -> int:
        """Remove the stored rows of the hours that ended ``usage.retention_days`` ago or
        earlier, ``PRUNE_BATCH`` at a time: each batch holds the book's lock (and SQLite's
        writer) alone, so a flush or a query waits one batch at most, and the event loop
        none (SQLite works in its thread). Returns how many rows went."""
        before = period_start(self.wall() - self.config.usage.retention_days * DAY, "hour")
        removed = 0
        while True:
            # shielded: cancelled at shutdown, a batch ends before the last flush
            batch = await asyncio.shield(self._prune_batch(before))
            removed += batch
            if batch < PRUNE_BATCH:
                return removed

    async def _prune_batch(self, before: int) -> int:
        async with self._lock:
            return await self.store.prune(before, PRUNE_BATCH)

    async def rows(self, since: int, until: int) -> Rows:
        """The store's rows of [since, until) and this process's not yet written."""
        async with self._lock:
            table = Table()
            try:
                stored = await self.store.rows(since, until)
            except (RedisError, sqlite3.Error) as err:
                log.warning("usage: the store did not answer a query: %s", err)
                raise ApiError(503, "The usage store did not answer; try again.") from None
            for key, counts in stored:
                table.add(key, counts)
            for key, counts in self.ledger.pending.between(since, until):
                table.add(key, counts)
            return list(table.rows.items())

    async def close(self) -> None:
        """The last flush, at shutdown, once every request has ended."""
        try:
            await self.flush()
        except Exception as err:
            log.warning("usage: the last write failed, the last %g s are lost: %s",
                        self.config.usage.flush_s, err)  # fmt: skip
        await self.store.close()


def _warn(level: Level) -> None:
    """Once per period and budget: it reached its ``warn_at``."""
    budget = level.budget
    log.warning(
        "budget: %s '%s' has used %.0f%% of its %s budget for the %s (warn_at %g)",
        budget.kind, budget.name, 100 * level.ratio, budget.unit, budget.spec.period,
        budget.spec.warn_at,
    )  # fmt: skip
