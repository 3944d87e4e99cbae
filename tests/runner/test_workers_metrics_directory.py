"""``serve --workers N``'s metrics directories (runner/workers.py): a parent killed with SIGKILL
cannot remove its own, so the next parent removes those that are stale, and only those; the
workers of a parent killed so end, rather than go on serving beside the next group."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from proxy_lab import children, config_yaml, eventually, serve_process

from sfq_proxy.runner.workers import METRICS_PREFIX, remove_stale

SHM = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _made(base: Path, name: str) -> Path:
    path = base / name
    path.mkdir()
    (path / "w0.json").write_text("{}")
    return path


@contextlib.contextmanager
def _held(directory: Path) -> Iterator[None]:
    """``directory``'s lock held, as a live group's processes hold theirs."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_only_a_dead_parents_directory_whose_lock_is_free_is_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = _made(tmp_path, f"{METRICS_PREFIX}{dead}-abc")
    mine = _made(tmp_path, f"{METRICS_PREFIX}{os.getpid()}-def")  # a pid reused
    held = _made(tmp_path, f"{METRICS_PREFIX}{dead}-ghi")  # another pid namespace's, or orphans'
    alive = _made(tmp_path, f"{METRICS_PREFIX}{os.getppid()}-jkl")  # its parent still running
    unnamed = _made(tmp_path, f"{METRICS_PREFIX}k2x_9qzt")  # an older version's
    other = _made(tmp_path, f"other-{dead}-mno")
    with _held(held):
        remove_stale(tmp_path)
    assert not stale.exists()
    assert not mine.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (held, alive, unnamed, other)
    )


def test_what_is_not_a_directory_is_left_alone_and_nothing_hangs(tmp_path: Path) -> None:
    """A local user's FIFO with a stale-looking name (an open for reading would wait for a
    writer forever, and the start with it), and links (to a FIFO, to a stale-looking
    directory: neither followed) are left alone; the stale directory beside them is still
    removed. In a process of its own, ended after 10 s if it hangs."""
    dead = _dead_pid()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fifo = tmp_path / f"{METRICS_PREFIX}{dead}-fifo"
    os.mkfifo(fifo)
    os.mkfifo(elsewhere / "fifo")
    to_fifo = tmp_path / f"{METRICS_PREFIX}{dead}-tofifo"
    to_fifo.symlink_to(elsewhere / "fifo")
    target = _made(elsewhere, f"{METRICS_PREFIX}{dead}-target")
    to_directory = tmp_path / f"{METRICS_PREFIX}{dead}-todir"
    to_directory.symlink_to(target)
    stale = _made(tmp_path, f"{METRICS_PREFIX}{dead}-abc")
    remove = "import sys, pathlib, sfq_proxy.runner.workers as w; "
    remove += "w.remove_stale(pathlib.Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", remove, str(tmp_path)], check=True, timeout=10)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (elsewhere, fifo, to_fifo, to_directory)
    )
    assert (target / "w0.json").exists()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.redis
async def test_a_sigkilled_parents_workers_end_and_the_next_start_removes_its_directory(
    tmp_path: Path, redis_url: str
) -> None:
    """The parent of ``serve --workers 2`` killed with SIGKILL: its workers are sent SIGTERM
    (they drain and end), and the next start removes the directory they left, at once;
    the new group's own stays until it ends."""
    text = config_yaml(["http://127.0.0.1:9"], state={"redis": redis_url})
    first, _ = await serve_process(text, tmp_path, workers=2)
    [left] = SHM.glob(f"{METRICS_PREFIX}{first.pid}-*")
    workers = children(first.pid)
    assert len(workers) == 2
    try:
        first.kill()
        await eventually(lambda: not any(_running(w) for w in workers), within=15)  # drain 5 s
    finally:
        for worker in workers:  # alive only if this failed: not for this test to leave
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        await asyncio.wait_for(first.wait(), 20)
    assert left.exists()
    second, _ = await serve_process(text, tmp_path, workers=2)
    try:
        assert not left.exists()
        assert len(list(SHM.glob(f"{METRICS_PREFIX}{second.pid}-*"))) == 1
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second.wait(), 20) == 0
    assert not list(SHM.glob(f"{METRICS_PREFIX}{second.pid}-*"))
