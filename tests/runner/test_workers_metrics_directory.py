"""``serve --workers N``'s metrics directories (runner/workers.py): a parent killed with SIGKILL
cannot remove its own, so the next parent removes those that are stale, and only those."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from sfq_proxy.runner.workers import METRICS_PREFIX, STALE_AFTER_S, remove_stale


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _made(base: Path, name: str, *, age_s: float) -> Path:
    path = base / name
    path.mkdir()
    (path / "w0.json").write_text("{}")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_a_dead_parents_directory_that_nothing_wrote_lately_is_removed(
    tmp_path: Path,
) -> None:
    old = STALE_AFTER_S + 5
    dead = _dead_pid()
    stale = _made(tmp_path, f"{METRICS_PREFIX}{dead}-abc", age_s=old)
    mine = _made(tmp_path, f"{METRICS_PREFIX}{os.getpid()}-def", age_s=old)  # a pid reused
    fresh = _made(tmp_path, f"{METRICS_PREFIX}{dead}-ghi", age_s=1)  # another pid namespace's
    alive = _made(tmp_path, f"{METRICS_PREFIX}{os.getppid()}-jkl", age_s=old)  # still running
    unnamed = _made(tmp_path, f"{METRICS_PREFIX}k2x_9qzt", age_s=old)  # an older version's
    other = _made(tmp_path, f"other-{dead}-mno", age_s=old)
    remove_stale(tmp_path)
    assert not stale.exists()
    assert not mine.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (fresh, alive, unnamed, other)
    )
