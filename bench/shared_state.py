"""What the shared state costs: sfq-proxy in memory vs with `state: redis`, 1 and 2 workers.

    python bench/shared_state.py [--seconds 5] [--connections 1 64] [--rounds 3] [--key K]
                                 [--baseline DIR] [--sentinel]

On harness.py, as overhead.py: nginx as the fast fake OpenAI backend (the JSON one only
here), the realistic proxy config and chat body. Starts its own redis-server on a free port
(no persistence) and three `sfq-proxy serve` processes: `memory, 1 worker` (today's proxy),
`redis, 1 worker` and `redis, 2 workers` (--workers 2, SO_REUSEPORT), the last two with
`state: {redis: ..., lease_ttl_s: 5}` added to the config, each on a Redis database of its
own; and, for what the machine itself gives a second process, `servers.py passthrough` (a
bare aiohttp relay, nothing shared) as 1 and as 2 processes on one port (SO_REUSEPORT). wrk
drives each target in turn (rounds interleaved, medians shown). One table: req/s, p50/p99
latency, non-2xx answers (summed over the rounds, socket errors as +Ns; the warm-up's
not counted), CPU µs per request of the proxy (the serve process and all its workers) and of
redis-server, and FCALL calls per request (from INFO commandstats: fewer than operations
when a worker's operations leave together); then the ratios and a short note on where the
time goes, and the proxies' stderr (counted by line). CPU figures are
utime+stime from /proc; the redis figure of the memory row is Redis's background (the idle
proxies' heartbeats and inbox reads), a baseline for the others. `--baseline DIR` runs a
fourth target, another version's code (a checkout, say `git worktree add DIR REV`) as
`redis, 1 worker`, in the same rounds, and prints the medians of the paired differences.
`--sentinel` adds a replica of that Redis and a Sentinel watching it, and the Redis targets
find their Redis through it (`state: {sentinel: ...}`: redis-py's client, and every call
waiting for the replica's acknowledgement, docs/shared-state.md Failover); Sentinel names
no database, so they share database 0 (one runs at a time); the redis µs/req are the
primary's only.
Requires: apt-get install nginx-light wrk redis-server (with redis-cli) [redis-sentinel].
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import harness
from harness import Processes, Server

TARGETS = {  # name → (workers, Redis database or None for state: memory)
    "memory, 1 worker": (1, None),
    "redis, 1 worker": (1, 1),
    "redis, 2 workers": (2, 2),
}
MODEL = "bench-json"
BARE = {"bare, 1 process": 1, "bare, 2 processes": 2}  # name → processes
BASELINE = "baseline, redis 1w"  # --baseline: another version's code, as `redis, 1 worker`
SERVICE = "bench"  # --sentinel: the Sentinel's name of the primary


def config(
    backends: list[str], redis: Server, db: int | None, sentinels: list[str] | None
) -> dict[str, Any]:
    """overhead.py's proxy config (harness.proxy_config), with ``state: redis`` when ``db``
    is set (through ``sentinels`` when given)."""
    config = harness.proxy_config({"json": backends})
    if db is not None and sentinels is not None:
        config["state"] = {"sentinel": {"hosts": sentinels, "service": SERVICE}, "lease_ttl_s": 5}
    elif db is not None:
        config["state"] = {"redis": f"redis://127.0.0.1:{redis.port}/{db}", "lease_ttl_s": 5}
    return config


def sentinel(procs: Processes, primary: Server) -> list[str]:
    """A replica of ``primary`` and a Sentinel watching it as SERVICE, once the replica is in
    sync and the sentinel names the primary: the sentinel's host:port."""
    replica, port = harness.free_port(), harness.free_port()
    argv = ["redis-server", "--port", str(replica), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(procs.work), "--replicaof", "127.0.0.1",
            str(primary.port)]  # fmt: skip
    procs.start("redis-replica", harness.Command(argv))
    conf = procs.work / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {procs.work}\n"
        f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 1\n"
    )
    command = ["redis-sentinel", str(conf)] if shutil.which("redis-sentinel") else [
        "redis-server", str(conf), "--sentinel"]  # fmt: skip
    procs.start("redis-sentinel", harness.Command(command))
    asked = {
        replica: (["INFO", "replication"], "master_link_status:up"),
        port: (["SENTINEL", "get-master-addr-by-name", SERVICE], str(primary.port)),
    }
    for _ in range(200):
        if all(want in _cli(p, args) for p, (args, want) in asked.items()):
            return [f"127.0.0.1:{port}"]
        time.sleep(0.05)
    raise RuntimeError("the replica is not in sync, or the sentinel does not name the primary")


def _cli(port: int, args: list[str]) -> str:
    run = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True)
    return run.stdout


def run_wrk(url: str, connections: int, seconds: float, script: Path) -> dict[str, float]:
    """harness.wrk, counting non-2xx answers and socket errors instead of refusing them."""
    result = harness.wrk(url, script, connections, seconds, strict=False)
    if result["non2xx"] or result["sockerr"]:
        print(f"  wrk {url} c={connections}: {result['non2xx']:.0f} non-2xx, "
              f"{result['sockerr']:.0f} socket errors", file=sys.stderr)  # fmt: skip
    return result


def fcall_calls(redis: Server) -> int:
    """FCALL calls so far, from INFO commandstats (redis-cli)."""
    out = subprocess.run(
        ["redis-cli", "-p", str(redis.port), "INFO", "commandstats"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return sum(int(n) for n in re.findall(r"^cmdstat_fcall:calls=(\d+)", out, re.M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3, help="runs per target; medians shown")
    parser.add_argument(
        "--key", default="sk-bench-a", choices=harness.KEYS,
        help="whose requests: sk-bench-a's org has rpm and tpm (one more Redis call per "
        "request), sk-bench-b's an in-flight cap only",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", type=harness.checkout,
        help="a checkout of another version (git worktree add DIR REV): its `redis, 1 worker` "
        "runs beside this code's, interleaved, with the medians of the paired differences",
    )  # fmt: skip
    parser.add_argument(
        "--sentinel", action="store_true",
        help="the Redis targets through a Sentinel, with a replica (each call waits for it)",
    )  # fmt: skip
    args = parser.parse_args()
    targets = dict(TARGETS)
    if args.baseline is not None:
        targets[BASELINE] = (1, 3)
    # Ctrl-C (even when started from a shell's background job, which ignores it) and SIGTERM
    # unwind through the block below, which stops every process started here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    harness.need("nginx", "wrk", "redis-server", "redis-cli",
                 packages="nginx-light wrk redis-server")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp)) as procs:
        backends = harness.nginx(procs, ["json"])["json"]
        redis = harness.redis(procs)
        sentinels = sentinel(procs, redis) if args.sentinel else None
        middles: dict[str, Server] = {}
        for name, (workers, db) in targets.items():
            src = args.baseline if name == BASELINE else harness.ROOT
            middles[name] = harness.sfq_proxy(
                procs, name, config(backends, redis, db, sentinels), src=src, workers=workers
            )
        for name, processes in BARE.items():
            middles[name] = harness.passthrough(procs, name, backends, processes=processes)
        harness.ready(*middles.values())
        script = harness.chat_script(procs.work, MODEL, args.key)
        for middle in middles.values():  # warm-up: imports, script load, pools
            run_wrk(middle.url, max(args.connections), 1, script)
        print(HEADER)
        for connections in args.connections:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in middles}
            for _ in range(args.rounds):  # interleaved: a noisy spell hits all alike
                for name, middle in middles.items():
                    before = (middle.cpu_seconds(), redis.cpu_seconds())
                    calls = fcall_calls(redis)
                    r = run_wrk(middle.url, connections, args.seconds, script)
                    n = r["requests"]
                    r["cpu_us"] = (middle.cpu_seconds() - before[0]) * 1e6 / n
                    r["redis_us"] = (redis.cpu_seconds() - before[1]) * 1e6 / n
                    r["fcalls"] = (fcall_calls(redis) - calls) / n
                    runs[name].append(r)
            medians = {name: harness.median(rs) for name, rs in runs.items()}
            for name, rs in runs.items():  # errors: every one counts, not the median
                medians[name]["non2xx"] = sum(r["non2xx"] for r in rs)
                medians[name]["sockerr"] = sum(r["sockerr"] for r in rs)
            for name, r in medians.items():
                print(_row(connections, name, r), flush=True)
            _summary(connections, medians)
            if BASELINE in runs:
                _paired(runs["redis, 1 worker"], runs[BASELINE])
        for name in targets:
            lines = Counter(line for line in procs.err(name).read_text().splitlines() if line)
            if lines:
                print(f"\n{name}: its stderr ({lines.total()} lines, warm-up included):")
                print("\n".join(f"  {n:>5} × {line}" for line, n in lines.most_common(8)))


HEADER = (
    f"{'conn':>4} {'target':<18}{'req/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'non2xx':>7}"
    f"{'proxy µs/req':>13}{'redis µs/req':>13}{'fcall/req':>12}"
)


def _row(conns: int, name: str, r: dict) -> str:
    errors = f"{r['non2xx']:.0f}" + (f"+{r['sockerr']:.0f}s" if r["sockerr"] else "")
    return (
        f"{conns:>4} {name:<18}{r['rps']:>8.0f}{r['p50']:>8.2f}{r['p99']:>8.2f}{errors:>7}"
        f"{r['cpu_us']:>13.0f}{r['redis_us']:>13.1f}{r['fcalls']:>12.2f}"
    )


def _paired(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> None:
    """This code's `redis, 1 worker` against the baseline's, round by round (the two ran
    one after the other): the median of the differences, and in how many rounds it was lower."""
    figures = {"p50 ms": "p50", "proxy µs/req": "cpu_us", "redis µs/req": "redis_us"}
    parts = []
    for label, field in {"req/s": "rps", **figures}.items():
        diffs = [a[field] - b[field] for a, b in zip(ours, theirs, strict=True)]
        lower = sum(d < 0 for d in diffs)
        parts.append(f"{label} {statistics.median(diffs):+.2f} (lower in {lower}/{len(diffs)})")
    print(f"     this code − baseline (redis, 1 worker), paired rounds: {'; '.join(parts)}")


def _summary(conns: int, m: dict[str, dict]) -> None:
    mem, one, two = (m[name] for name in TARGETS)
    total = {name: r["cpu_us"] + r["redis_us"] for name, r in m.items()}
    added = total["redis, 1 worker"] - total["memory, 1 worker"]
    print(
        f"     throughput: redis 2w / redis 1w = {two['rps'] / one['rps']:.2f}, "
        f"redis 1w / memory = {one['rps'] / mem['rps']:.2f}; "
        f"p50 added by redis (1w) = {one['p50'] - mem['p50']:+.2f} ms"
    )
    print(
        f"     CPU per request, proxy+redis: memory {total['memory, 1 worker']:.0f} µs, "
        f"redis 1w {total['redis, 1 worker']:.0f} µs ({added:+.0f}), "
        f"redis 2w {total['redis, 2 workers']:.0f} µs "
        f"({total['redis, 2 workers'] - total['memory, 1 worker']:+.0f})"
    )
    bare1, bare2 = (m[name] for name in BARE)
    print(
        f"     the machine (wrk, nginx and Redis on the same 2 cores): bare 2 processes / 1 = "
        f"{bare2['rps'] / bare1['rps']:.2f}, CPU per request "
        f"×{bare2['cpu_us'] / bare1['cpu_us']:.2f}; redis 2w / 1w: CPU per request "
        f"×{two['cpu_us'] / one['cpu_us']:.2f}"
    )
    proxy_added = one["cpu_us"] - mem["cpu_us"]
    redis_added = one["redis_us"] - mem["redis_us"]
    print(
        f"     where the time goes (1w): {one['fcalls']:.2f} FCALLs per request for its 2-3 "
        f"operations (submit and finish, and for sk-bench-a, the default key, its org's "
        f"admit, which its submit carries on one Redis; under load a worker's operations leave "
        f"together, state/redis_batcher.py); Redis spends {redis_added:.0f} µs/req on them, the "
        f"proxy {proxy_added:+.0f} µs/req more than in memory (client side, framing, awaits)\n"
    )


if __name__ == "__main__":
    main()
