"""With ``serve --workers N``: every worker's ``sfq_*`` counters and histograms in every
scrape, each series labelled ``worker``.

A scrape reaches whichever worker the kernel hands the connection to. Served alone, each
worker's own counts would alternate from scrape to scrape, which Prometheus reads as
resets, and ``rate()`` would not be the proxy's. So each worker writes its counters and
histograms to its file in the group's directory (made by the parent, removed at its exit):
every ``WRITE_EVERY_S``, at the end of its drain, and first thing when it answers a scrape;
and a scrape serves every worker's file. Each value served was read from a file its worker
only ever writes forward, so no series goes back between two scrapes, whichever worker
answers them (a sibling's counts are at most ``WRITE_EVERY_S`` old). A worker started
again after a crash keeps its index and starts its counts from 0, like any restarted
process. Gauges are levels, not counts: they are the answering worker's own, as with one
process (those read from the shared state are the pool's whichever worker answers).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..state.atomic_file import write_atomically

log = logging.getLogger(__name__)
WRITE_EVERY_S = 1.0
COUNTED = ("counter", "histogram")  # the types served from every worker's file

directory: Path | None = None  # the group's, set by the parent before it forks the workers


class WorkerGroup(Collector):
    """The worker ``index``'s metrics (``own``) as the group serves them."""

    def __init__(self, own: Collector, index: int, group_directory: Path) -> None:
        self._own, self._index, self._directory = own, index, group_directory

    def collect(self) -> Iterable[Metric]:
        families = list(self._own.collect())
        self._write(families)  # first: what this scrape serves of this worker is its file's
        return [*(f for f in families if f.type not in COUNTED), *self._read_all()]

    async def write_forever(self) -> None:
        """Keep this worker's file at most ``WRITE_EVERY_S`` old, for its siblings' scrapes;
        cancelled once the drain is over, write its last counts."""
        try:
            while True:
                await asyncio.sleep(WRITE_EVERY_S)
                self._write(list(self._own.collect()))
        finally:
            self._write(list(self._own.collect()))

    def _write(self, families: list[Metric]) -> None:
        """This worker's counts (of ``families``) to its file; a full or vanished directory
        is logged, and scrapes show its older counts meanwhile."""
        counted = [
            {
                "name": f.name,
                "help": f.documentation,
                "type": f.type,
                "samples": [[s.name, s.labels, s.value] for s in f.samples],
            }
            for f in families
            if f.type in COUNTED
        ]
        try:
            path = self._directory / f"{self._index}.json"
            write_atomically(path, json.dumps(counted), durable=False)
        except OSError as err:
            log.warning("cannot write this worker's metrics for the others: %s", err)

    def _read_all(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for path in sorted(self._directory.glob("*.json")):
            try:
                families = json.loads(path.read_text())
            except OSError:  # its worker gone, its group stopping
                continue
            for f in families:
                family = merged.get(f["name"])
                if family is None:
                    family = merged[f["name"]] = Metric(f["name"], f["help"], f["type"])
                for name, labels, value in f["samples"]:
                    family.add_sample(name, {**labels, "worker": path.stem}, value)
        return merged.values()


def group_view(own: Collector, index: int | None) -> Collector:
    """What the registry serves of ``own``: itself, or in worker ``index`` of a group, the
    group's counts and its own levels."""
    if index is None or directory is None:
        return own
    return WorkerGroup(own, index, directory)
