"""Usage retention (docs/usage-and-budgets.md, Where it is kept): rows older than
``usage.retention_days`` are pruned in bounded batches, at start and every hour, without
stalling the event loop; the SQLite file and its ``-wal`` and ``-shm`` are 0600."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from proxy_lab import MODEL, Lab, proxy_config

from sfq_proxy.core.usage import DAY, HOUR, Counts, period_start
from sfq_proxy.state import usage_store
from sfq_proxy.state.usage_store import SqliteStore

DEC_1 = 1_764_547_200  # 2025-12-01T00:00:00Z


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a file made without a mode is 0644."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.usefixtures("umask_022")
async def test_the_usage_file_and_its_wal_and_shm_are_made_0600(tmp_path: Path) -> None:
    path = tmp_path / "usage.db"
    store = SqliteStore(path, lambda: DEC_1)
    await store.add("b1", {(DEC_1, "A", "A#0", "sim", MODEL): Counts(1, 10, 5)})
    files = [path, tmp_path / "usage.db-wal", tmp_path / "usage.db-shm"]
    assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
    await store.close()


@pytest.mark.usefixtures("umask_022")
def test_an_older_versions_0644_files_are_made_0600(tmp_path: Path) -> None:
    """What a version before this one left: the database and the WAL of a crash, 0644."""
    files = [tmp_path / name for name in ("usage.db", "usage.db-wal", "usage.db-shm")]
    with sqlite3.connect(files[0]) as db:
        db.execute("CREATE TABLE t (x)")
    for f in files[1:]:
        f.touch()
    assert {mode(f) for f in files} == {0o644}
    SqliteStore(files[0], time.time)
    assert {mode(f) for f in files} == {0o600}


async def test_sqlite_prunes_only_the_hours_before_and_at_most_a_batch(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "usage.db", lambda: DEC_1)
    hours = [DEC_1 + h * HOUR for h in range(10)]
    rows = {(h, "A", f"A#{k}", "sim", MODEL): Counts(1, 10, 5) for h in hours for k in range(3)}
    await store.add("b1", rows)
    assert await store.prune(hours[4], 5) == 5  # 12 rows of hours 0-3: a batch of 5
    assert await store.prune(hours[4], 5) == 5
    assert await store.prune(hours[4], 5) == 2
    assert await store.prune(hours[4], 5) == 0
    left = sorted({key[0] for key, _ in await store.rows(0, hours[-1] + HOUR)})
    assert left == hours[4:]
    await store.close()


async def fill(path: Path, hours: range, keys: int) -> int:
    """``keys`` rows per hour of ``hours`` in the file, as a proxy's flushes write them;
    how many."""
    store = SqliteStore(path, time.time)
    rows = {(h, "A", f"A#{k}", "sim", MODEL): Counts(1) for h in hours for k in range(keys)}
    await store.add("fill", rows)
    await store.close()
    return len(rows)


def count(path: Path, before: int) -> tuple[int, int]:
    """The rows of the hours before ``before``, and the others."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        old = db.execute("SELECT COUNT(*) FROM usage WHERE hour < ?", (before,)).fetchone()[0]
        new = db.execute("SELECT COUNT(*) FROM usage WHERE hour >= ?", (before,)).fetchone()[0]
    return old, new


async def test_a_proxy_prunes_past_retention_at_start_and_keeps_answering(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file with 10 days of rows past a 32-day retention (48 rows an hour) and 20 days
    within it: at start the proxy removes the old ones, in batches made small here (50
    rows: ~230 of them) so that the prune lasts, while ``/healthz`` keeps answering; the
    rows within the retention stay."""
    monkeypatch.setattr(usage_store, "PRUNE_BATCH", 50)
    path = tmp_path / "usage.db"
    cut = period_start(time.time() - 32 * DAY, "hour")
    total = await fill(path, range(cut - 10 * DAY, cut + 20 * DAY, HOUR), 48)
    old, kept = count(path, cut)
    assert (old, kept) == (10 * 24 * 48, 20 * 24 * 48)
    config = proxy_config(["http://127.0.0.1:9"], usage={"file": str(path), "retention_days": 32})
    served = await lab.proxy(config)
    http = await lab.http()
    waits: list[float] = []
    while count(path, cut)[0]:
        started = time.perf_counter()
        async with http.get(f"{served.url}/healthz") as resp:
            assert resp.status == 200
        waits.append(time.perf_counter() - started)
        assert len(waits) < 10_000, "the prune did not end"
    assert count(path, cut) == (0, kept)
    assert len(waits) > 1, "pruned before /healthz was asked: nothing was shown"
    print(f"pruned {old} of {total} rows; /healthz answered {len(waits)} times meanwhile, "
          f"slowest {1000 * max(waits):.1f} ms")  # fmt: skip
    assert max(waits) < 1.0  # a correctness bound: no batch, let alone the prune, blocks it


@pytest.mark.redis
async def test_redis_hashes_expire_retention_days_after_their_last_write(
    lab: Lab, redis_url: str
) -> None:
    """Redis needs no prune: each hash a flush writes expires ``retention_days`` later (the
    TTL its store was made with: a reload says it changes at the next restart)."""
    sim = await lab.backend()
    config = proxy_config([sim.url], state={"redis": redis_url}, usage={"retention_days": 40})
    served = await lab.proxy(config)
    await lab.client(served).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert served.state.usage is not None
    await served.state.usage.flush()
    client = aioredis.Redis.from_url(redis_url)
    try:
        names = [n async for n in client.scan_iter("sfq:{usage}:*")]
        hashes = [n for n in names if b":batch:" not in n]
        assert {n.split(b":")[2] for n in hashes} == {b"h", b"day", b"month"}
        ttls = [await client.ttl(n) for n in hashes]
    finally:
        await client.aclose()
    assert all(40 * DAY - 60 < ttl <= 40 * DAY for ttl in ttls), ttls
    longer = proxy_config([sim.url], state={"redis": redis_url}, usage={"retention_days": 50})
    assert served.state.reload(longer) == [
        "usage.retention_days on Redis changes at the next restart"
    ]
