"""The process beside the proxy in ``/metrics``: ``sfq_build_info`` and prometheus-client's
standard collectors, ``process_*`` (CPU, memory, file descriptors, start time),
``python_info`` and ``python_gc_*``.

With ``serve --workers N`` each worker is a process of its own, and a scrape reaches
whichever worker the kernel hands the connection to. So every worker serves the
``process_*`` of the whole group, read from ``/proc``: one series per process, labelled
``worker`` — ``main`` for the parent that forks and supervises the workers, ``0`` … ``N-1``
for the workers — the same whichever worker answers. A worker started again after a crash
keeps its index, so its CPU counter restarts from 0 like any restarted process's.
``python_gc_*`` are the counters of the interpreter that answers and cannot be read from
another process: with workers they are left out rather than jump from worker to worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PROC = Path("/proc")
PR_SET_NAME = 15  # prctl(2): the calling thread's name, /proc/<pid>/comm (15 bytes at most)
WORKER_NAME = "sfq-proxy w{}"  # a worker's name, so that its siblings can tell its index
_WORKER_NAME = re.compile(r"sfq-proxy w(\d+)")
MAIN = "main"  # the worker label of the supervising parent

_worker: int | None = None  # this process's index under `serve --workers N`, else None


def version() -> str:
    """The installed package's version (its metadata, as pip installed it)."""
    try:
        return metadata.version("sfq-proxy")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def become_worker(index: int) -> None:
    """In a worker just forked by ``serve --workers``: remember its index, and name the
    process after it (``ps`` shows ``sfq-proxy w0``; its siblings' scrapes read it)."""
    global _worker
    _worker = index
    with contextlib.suppress(OSError, AttributeError):  # not Linux: label by pid instead
        name = WORKER_NAME.format(index).encode()[:15]
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name, 0, 0, 0)


def worker_index() -> int | None:
    """This process's index under ``serve --workers N``; None when it serves alone."""
    return _worker


def register(registry: CollectorRegistry) -> None:
    """Add the build info and the process, platform and GC collectors to ``registry``."""
    registry.register(_BuildInfo())
    PlatformCollector(registry=registry)
    if _worker is None:
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
    else:
        registry.register(_WorkerGroup(os.getppid()))


class _BuildInfo(Collector):
    def collect(self) -> Iterable[Metric]:
        info = GaugeMetricFamily(
            "sfq_build_info",
            "Always 1: the sfq-proxy version and the Python version serving it",
            labels=["version", "python"],
        )
        info.add_metric([version(), platform.python_version()], 1)
        yield info


class _WorkerGroup(Collector):
    """``process_*`` of the parent ``main_pid`` and of each of its children (the workers),
    labelled ``worker``."""

    def __init__(self, main_pid: int) -> None:
        self._main = main_pid

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for pid, label in [(self._main, MAIN), *_workers(self._main)]:
            collector = ProcessCollector(pid=lambda pid=pid: pid, registry=None)  # type: ignore[misc]
            for family in collector.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type
                    )
                for sample in family.samples:
                    merged.add_sample(sample.name, {"worker": label}, sample.value)
        return families.values()


def _workers(parent: int) -> list[tuple[int, str]]:
    """The parent's children with their index (from the name ``become_worker`` gave them;
    the pid when it has none)."""
    found = []
    for pid in _children(parent):
        try:
            name = (PROC / str(pid) / "comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        index = _WORKER_NAME.fullmatch(name)
        found.append((pid, index[1] if index else f"pid {pid}"))
    return sorted(found, key=lambda item: (len(item[1]), item[1]))


def _children(parent: int) -> list[int]:
    try:  # the kernel's list (CONFIG_PROC_CHILDREN): the workers are the main thread's
        return [int(pid) for pid in (PROC / f"{parent}/task/{parent}/children").read_text().split()]
    except OSError:
        pass
    children = []
    for stat in PROC.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # ended meanwhile
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(stat.parent.name))
    return children
