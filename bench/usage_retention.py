"""Pruning the usage rows past ``usage.retention_days`` (state/usage_store.py): what a batch
costs, what the whole prune costs, and what the event loop and a flush wait meanwhile.

A SQLite file gets ``--rows`` rows past the retention (``--keys`` rows an hour: a fleet's
keys × models) and a day within it; then the proxy's own ``UsageBook.prune`` removes
them, a ``PRUNE_BATCH`` at a time, while a ticker measures the loop's lag (a 1 ms sleep
that wakes late) and a flush is written every 50 ms (how long each waits for the book's
lock: a batch at most). For comparison: the same ticker and flushes for as long without a
prune, the same rows removed by one unbatched DELETE (the writer held throughout), and the
memory store's prune (whose flushes sum every row in the loop: their wait is that).

    python bench/usage_retention.py [--rows 1000000] [--keys 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sfq_proxy.config import parse_config
from sfq_proxy.core.usage import COUNTERS, DAY, HOUR, Counts, period_start
from sfq_proxy.state.usage_store import PRUNE_BATCH, MemoryStore, SqliteStore, Store, UsageBook

CONFIG = """
listen: {host: 127.0.0.1, port: 0}
keys: [{key: sk-bench-0000000001, org: A, classes: [batch]}]
pools: {p: {models: [m], backends: [{url: "http://127.0.0.1:9", slots: 1}]}}
usage: {retention_days: 400}
"""
RETENTION_S = 400 * DAY


def old_rows(now: float, rows: int, keys: int) -> list[tuple[int, str, str, str, str]]:
    """``rows`` row keys of the hours before the retention's cut, ``keys`` an hour."""
    cut = period_start(now - RETENTION_S, "hour")
    hours = -(-rows // keys)
    return [
        (cut - (hours - i // keys) * HOUR, "org", f"key-{i % keys}", "p", "m") for i in range(rows)
    ]


def fill(path: Path, keys: list[tuple[int, str, str, str, str]], now: float) -> None:
    """The rows, and a day of rows within the retention (once), straight into the file."""
    SqliteStore(path, time.time)  # the schema
    recent = [(period_start(now, "hour") - h * HOUR, "org", "key-0", "p", "m") for h in range(24)]
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        marks = ", ".join("?" * (5 + len(COUNTERS)))
        db.executemany(
            f"INSERT OR IGNORE INTO usage (hour, org, key, pool, model, {', '.join(COUNTERS)}) "
            f"VALUES ({marks})",
            [(*k, *([1] * len(COUNTERS))) for k in keys + recent],
        )


async def timed_prune(book: UsageBook) -> dict[str, float]:
    """``book.prune`` with each batch timed, the loop's lag and flushes' waits beside it."""
    batches: list[float] = []
    prune = book.store.prune

    async def timed(before: int, limit: int) -> int:
        started = time.perf_counter()
        try:
            return await prune(before, limit)
        finally:
            batches.append(time.perf_counter() - started)

    book.store.prune = timed  # type: ignore[method-assign]
    lags, flushes = await beside(book.prune, book.flush)
    return {
        "batches": len(batches),
        "batch_median_ms": 1000 * statistics.median(batches),
        "batch_max_ms": 1000 * max(batches),
        "total_s": sum(batches),
        "loop_lag_max_ms": 1000 * max(lags),
        "flush_wait_max_ms": 1000 * max(flushes, default=0.0),
    }


async def beside(
    work: Callable[[], Awaitable[object]], flush: Callable[[], Awaitable[None]]
) -> tuple[list[float], list[float]]:
    """Run ``work`` while a ticker measures the loop's lag and ``flush`` runs every 50 ms."""
    lags: list[float] = []
    flushes: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - started - 0.001)

    async def flush_often() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await flush()
            flushes.append(time.perf_counter() - started)
            await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(tick()), asyncio.create_task(flush_often())]
    await work()
    done.set()
    await asyncio.gather(*tasks)
    return lags, flushes


def one_delete(path: Path, now: float) -> float:
    """The seconds one DELETE of every old row holds the writer."""
    cut = period_start(now - RETENTION_S, "hour")
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        started = time.perf_counter()
        db.execute("DELETE FROM usage WHERE hour < ?", (cut,))
        return time.perf_counter() - started


async def run(rows: int, keys: int) -> None:
    now = time.time()
    config = parse_config(CONFIG, environ={})
    old = old_rows(now, rows, keys)
    print(f"{rows:,} rows past a 400-day retention, {keys:,} an hour; PRUNE_BATCH {PRUNE_BATCH}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "usage.db"
        fill(path, old, now)
        size = path.stat().st_size
        book = UsageBook(config, SqliteStore(path, time.time), time.time)
        figures = await timed_prune(book)
        lags, flushes = await beside(lambda: asyncio.sleep(figures["total_s"]), book.flush)
        await book.close()
        print(f"SQLite ({size / 1e6:.0f} MB):", _line(figures))
        print(f"  the same time without a prune: loop lag max {1000 * max(lags):.1f} ms; "
              f"a flush took at most {1000 * max(flushes):.1f} ms")  # fmt: skip
        fill(path, old, now)
        print(f"SQLite, one unbatched DELETE: the writer held {one_delete(path, now):.2f} s")
    memory: Store = MemoryStore()
    await memory.add("fill", {k: Counts(1, 1, 1) for k in old})
    book = UsageBook(config, memory, time.time)
    print("memory store:", _line(await timed_prune(book)))


def _line(figures: dict[str, float]) -> str:
    return (
        f"{figures['batches']:.0f} batches, median {figures['batch_median_ms']:.1f} ms, "
        f"max {figures['batch_max_ms']:.1f} ms; all {figures['total_s']:.2f} s; "
        f"loop lag max {figures['loop_lag_max_ms']:.1f} ms; "
        f"a flush waited at most {figures['flush_wait_max_ms']:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=5000, help="rows an hour")
    args = parser.parse_args()
    asyncio.run(run(args.rows, args.keys))


if __name__ == "__main__":
    main()
