"""What each per-request feature costs, in instructions: sfq-proxy with one switched off.

    python bench/feature_cost.py [--modes json stream] [--requests 300]
                                 [--features access_log metrics ...]

The profile of a request is flat: no function of the proxy's stands out, and the cost is
spread over the features every request passes through. To decide which of them to keep
inline, sample or batch, each is measured by its absence: sfq-proxy serves
``instructions.py``'s load under callgrind on ``overhead.py``'s config, once as it is and
once per feature with that feature replaced by nothing (in the proxy's process only, by
this file run as its launcher), then with all of them replaced at once (what is left: the
path every request must take), and the instructions per request are compared. A feature
switched off here is broken on purpose (no metrics, no access line, a usage event left in
the stream): this measures, it never serves.
Requires: apt-get install valgrind nginx-light.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import instructions
import overhead

LAUNCH = "--launch"  # argv[1] of the proxy's process: this file, as its launcher
OFF_ENV = "SFQ_BENCH_OFF"


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


class _PassThrough:
    """A usage stripper that strips nothing."""

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def close(self) -> bytes:
        return b""


# feature: (what it is, [(module, attribute path, what replaces it)])
FEATURES: dict[str, tuple[str, list[tuple[str, str, object]]]] = {
    "access_log": ("the access line",
                   [("sfq_proxy.observability.access_log", "AccessRecord.emit", _nothing)]),
    "metrics": ("every metric update", [
        ("sfq_proxy.observability.metrics", f"Metrics.{name}", _nothing)
        for name in ("seen", "count", "observe", "first_byte", "placed")
    ]),
    "calibration": ("the calibration's observe",
                    [("sfq_proxy.core.cost", "CostModel.observe", _nothing)]),
    "answer_counting": ("usage read, outcome, answer metrics, calibration",
                        [("sfq_proxy.http.handler", "_count_answer", _nothing)]),
    "settling": ("request metrics and the access line",
                 [("sfq_proxy.http.handler", "_settle", _nothing)]),
    "ratelimit_headers": ("the six x-ratelimit-* headers",
                          [("sfq_proxy.core.limits", "ratelimit_headers", lambda *_: {})]),
    "usage_stripper": ("dropping the usage event asked for",
                       [("sfq_proxy.http.relay", "_UsageStripper", _PassThrough)]),
    "error_event": ("the search for an error event",
                    [("sfq_proxy.http.handler", "error_event", lambda _: False)]),
}  # fmt: skip
STREAM_ONLY = {"usage_stripper"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = ["json", "stream"]
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--features", nargs="+", choices=list(FEATURES), default=list(FEATURES))
    args = parser.parse_args()
    header = f"{'mode':<7}{'switched off':<19}{'Minstr/req':>11}{'saves':>9}  what"
    instructions.each_mode(args.modes, header, lambda mode, work: _rows(mode, work, args))


def _rows(mode: str, work: Path, args: argparse.Namespace) -> None:
    """One mode's rows: as it is, without each feature, then without all of them."""
    config = work / f"{mode}.yaml"
    config.write_text(overhead.proxy_config(work, modes=(mode,)))
    features = [f for f in args.features if mode == "stream" or f not in STREAM_ONLY]
    whole = _count(mode, config, args, ())
    print(f"{mode:<7}{'(nothing)':<19}{whole / 1e6:>11.3f}", flush=True)
    rows = [((feature,), feature, FEATURES[feature][0]) for feature in features]
    if len(features) > 1:  # what is left without any of them: the path every request takes
        rows.append((tuple(features), "all of these", ""))
    for off, name, what in rows:
        count = _count(mode, config, args, off)
        saves = f"{(whole - count) / whole:.1%}"
        print(f"{mode:<7}{name:<19}{count / 1e6:>11.3f}{saves:>9}  {what}", flush=True)


def _count(mode: str, config: Path, args: argparse.Namespace, off: tuple[str, ...]) -> float:
    os.environ[OFF_ENV] = ",".join(off)
    command = [sys.executable, __file__, LAUNCH, "serve", "--config", str(config)]
    return instructions._per_request(command, overhead.PROXY_PORT, mode, args, None)


def _launch(argv: list[str]) -> int:
    """Run ``sfq-proxy argv`` with the features named in ``$SFQ_BENCH_OFF`` replaced."""
    for feature in filter(None, os.environ.get(OFF_ENV, "").split(",")):
        for module, path, replacement in FEATURES[feature][1]:
            owner: Any = importlib.import_module(module)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            setattr(owner, name, replacement)
    from sfq_proxy.cli import main as serve

    code: int = serve(argv)
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == [LAUNCH]:
        sys.exit(_launch(sys.argv[2:]))
    main()
