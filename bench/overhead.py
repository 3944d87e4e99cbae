"""The headline: sfq-proxy against a bare pass-through and vllm-router, on the same backends.

    python bench/overhead.py [--seconds 5] [--connections 1 16 64] [--rounds 3]
                             [--modes json stream paced] [--no-router] [--upstream]
                             [--baseline CHECKOUT] [--without FEATURE ... | all]
    python bench/overhead.py --profile [--modes json] [--connections 16] [--seconds 5]
                             [--top 30] [--sort tottime|cumulative|ncalls] [--save FILE]

Three kinds of answer: ``json``, a fixed chat completion with usage, and ``stream``, a
200-event SSE stream ending with a usage chunk and [DONE], both from nginx, much faster than
any Python proxy, which sends a stream in one burst; and ``paced``, the same stream from
``servers.py paced``, each event its own write 1 ms apart, as a model server writes tokens.
wrk drives load with a realistic chat body and a key. In the middle, in front of the
mode's two backends (harness.py starts them all on free ports):

- ``direct``: no middle, the backend alone (the ceiling);
- ``bare``: ``servers.py passthrough``, aiohttp + uvloop relaying and nothing else: the
  floor; ``--upstream`` adds ``bare-upstream``, the same on sfq-proxy's own upstream
  connections instead of aiohttp's ``ClientSession`` (the floor on the proxy's own client);
- ``sfq-proxy``: ``sfq-proxy serve`` with every feature on as in config/example.yaml
  (keys, orgs with caps and rates, classes with queue limits, metrics, the access log,
  calibration, the queue-memory bound);
- ``vllm-router`` (Rust), round robin, pip-installed into bench/.venv-router on first use
  (``--no-router``: left out);
- ``--baseline CHECKOUT`` adds ``sfq (base)``: the sfq-proxy of another checkout (``git
  worktree add /tmp/base <commit>``, or ``compiled_core.py``'s copy) on the same config, so
  that a change is measured against the code before it in the same rounds;
- ``--without FEATURE … | all`` adds ``sfq −features``: sfq-proxy with those per-request
  features switched off (harness.FEATURES), so that what the rest of the path costs is
  timed beside the whole.

One table: req/s, p50/p99 latency, CPU µs per request of the process in the middle (with
all it forked), and req/s and CPU as ratios to ``bare``'s (per event too, for ``paced``):
medians of ``--rounds`` runs after a second's warm-up, interleaved across targets so that a
noisy spell of the shared machine hits all alike.

``--profile``: instead of the table, sfq-proxy (with ``--without``'s features off) under
cProfile while wrk loads it, at each of ``--modes`` and ``--connections``: the top
functions with their calls *per request* (call counts, unlike times, do not depend on how
busy the machine is) and µs per request: the profile to read before changing the relay path.
Requires: apt-get install nginx-light wrk.
"""

from __future__ import annotations

import argparse
import os
import pstats
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import Processes, Server, Table

MODES = ("json", "stream", "paced")
TABLE = Table(
    ("mode", "<7"), ("conn", ">5"), ("  target", "<16"), ("req/s", ">9.0f"), ("p50 ms", ">9.2f"),
    ("p99 ms", ">9.2f"), ("cpu µs/req", ">12.0f"), ("req/s×bare", ">11.2f"),
    ("cpu×bare", ">9.2f"), ("µs/event", ">10.1f"),
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3, help="runs per target; medians shown")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    parser.add_argument("--upstream", action="store_true", help="add bare-upstream")
    parser.add_argument(
        "--baseline", type=harness.checkout, help="a checkout whose sfq-proxy runs too"
    )
    parser.add_argument("--without", nargs="+", default=[], metavar="FEATURE",
                        help=f"also run sfq-proxy with these off: {', '.join(harness.FEATURES)}"
                        " or all")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="cProfile sfq-proxy instead")
    parser.add_argument("--top", type=int, default=30, help="--profile: functions shown")
    parser.add_argument("--sort", default="tottime", help="--profile: pstats' sort key")
    parser.add_argument("--save", type=Path, help="--profile: also write the raw profile here")
    args = parser.parse_args()
    if args.profile and args.baseline is not None:
        parser.error("--profile profiles this tree's sfq-proxy alone: no --baseline")
    args.without = harness.features(args.without)
    harness.need("nginx", "wrk", packages="nginx-light wrk")
    router = not (args.no_router or args.profile)
    if router:  # installed first, on first use: before anything is started
        harness.ensure_router()
    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp)) as procs:
        backends = harness.nginx(procs, [m for m in args.modes if m != "paced"])
        if "paced" in args.modes:
            backends["paced"] = harness.paced(procs)
        if args.profile:
            for mode in args.modes:
                for connections in args.connections:
                    profile(mode, connections, args, backends, procs)
            return
        TABLE.print_header()
        for mode in args.modes:
            _compare(mode, args, backends, procs, router)


def _middles(
    mode: str, args: argparse.Namespace, backends: dict[str, list[str]], procs: Processes,
    router: bool,
) -> list[Server]:  # fmt: skip
    """Every target in front of ``mode``'s backends, started and ready."""

    def config(name: str) -> dict[str, Any]:  # each its own calibration state
        return harness.proxy_config(backends, state_file=procs.work / f"calibration-{name}.json")

    urls = backends[mode]
    middles = [harness.passthrough(procs, f"bare {mode}", urls)]
    if args.upstream:
        middles.append(harness.passthrough(procs, f"bare-upstream {mode}", urls, upstream=True))
    middles.append(harness.sfq_proxy(procs, f"sfq-proxy {mode}", config("sfq")))
    if args.baseline is not None:
        base = config("base")
        middles.append(harness.sfq_proxy(procs, f"sfq (base) {mode}", base, src=args.baseline))
    if args.without:
        off = config("without")
        middles.append(harness.sfq_proxy(procs, f"sfq −features {mode}", off, without=args.without))
    if router:
        middles.append(harness.vllm_router(procs, f"vllm-router {mode}", urls))
    harness.ready(*middles)
    return middles


def _compare(
    mode: str, args: argparse.Namespace, backends: dict[str, list[str]], procs: Processes,
    router: bool,
) -> None:  # fmt: skip
    """One mode's rows, at each count of connections; its middles stopped after."""
    middles = _middles(mode, args, backends, procs, router)
    script = harness.chat_script(procs.work, f"bench-{mode}")
    targets: list[tuple[str, str, Server | None]] = [("direct", backends[mode][0], None)]
    targets += [(m.name.removesuffix(f" {mode}"), m.url, m) for m in middles]
    for _, url, _ in targets:  # warm-up: first connections, caches, calibration
        harness.wrk(url, script, max(args.connections), 1)
    try:
        for connections in args.connections:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in targets}
            for _ in range(args.rounds):  # interleaved: a noisy spell hits all alike
                for name, url, middle in targets:
                    before = middle.cpu_seconds() if middle else 0.0
                    result = harness.wrk(url, script, connections, args.seconds)
                    if middle:
                        cpu = middle.cpu_seconds() - before
                        result["cpu_us"] = cpu * 1e6 / result["requests"]
                    runs[name].append(result)
            bare = harness.median(runs["bare"])
            for name, *_ in targets:
                _row(mode, connections, name, harness.median(runs[name]), bare)
    finally:
        for middle in middles:
            procs.stop(middle.name)


def _row(
    mode: str, connections: int, name: str, r: dict[str, float], bare: dict[str, float]
) -> None:
    cpu = r.get("cpu_us")
    per_event = cpu / (harness.STREAM_EVENTS + 2) if cpu is not None and mode == "paced" else None
    TABLE.print_row(
        mode, connections, f"  {name}", r["rps"], r["p50"], r["p99"], cpu,
        harness.ratio(r["rps"], bare["rps"]), harness.ratio(cpu, bare["cpu_us"]), per_event,
    )  # fmt: skip


def profile(
    mode: str, connections: int, args: argparse.Namespace, backends: dict[str, list[str]],
    procs: Processes,
) -> None:  # fmt: skip
    """sfq-proxy under cProfile for ``args.seconds`` of wrk's load (after a second's
    warm-up, not profiled); the top functions per request."""
    out = procs.work / f"profile-{mode}-{connections}.pstats"
    name = f"sfq-proxy {mode} c{connections}"
    config = harness.proxy_config(
        {mode: backends[mode]}, state_file=procs.work / "calibration.json"
    )
    proxy = harness.sfq_proxy(procs, name, config, without=args.without, profile=out).ready()
    script = harness.chat_script(procs.work, f"bench-{mode}")
    try:
        harness.wrk(proxy.url, script, connections, 1)
        os.kill(proxy.proc.pid, signal.SIGUSR1)
        requests = int(harness.wrk(proxy.url, script, connections, args.seconds)["requests"])
        os.kill(proxy.proc.pid, signal.SIGUSR2)
        for _ in range(200):
            if out.exists():
                break
            time.sleep(0.05)
        stats = pstats.Stats(str(out)).sort_stats(args.sort)
    finally:
        procs.stop(name)
    if args.save:
        stats.dump_stats(
            args.save.with_name(f"{args.save.stem}-{mode}-{connections}{args.save.suffix}")
        )
    off = f", without {', '.join(args.without)}" if args.without else ""
    print(f"{requests} requests ({mode}, c={connections}{off}); per request:")
    print(f"{'calls':>7} {'tot µs':>7} {'cum µs':>7}  function")
    for func in stats.fcn_list[: args.top]:  # type: ignore[attr-defined]
        calls, _, tottime, cumtime, _ = stats.stats[func]  # type: ignore[attr-defined]
        where = f"{Path(func[0]).name}:{func[1]}({func[2]})"
        print(f"{calls / requests:>7.2f} {tottime / requests * 1e6:>7.1f} "
              f"{cumtime / requests * 1e6:>7.1f}  {where}")  # fmt: skip
    print(flush=True)


if __name__ == "__main__":
    main()
