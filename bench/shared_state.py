"""What the shared state costs: sfq-proxy in memory vs with `state: redis`, 1 and 2 workers.

    python bench/shared_state.py [--seconds 5] [--connections 1 64] [--rounds 3] [--key K]
                                 [--baseline DIR]

Reuses bench/overhead.py: nginx as the fast fake OpenAI backend (the JSON one only here),
its realistic proxy config and chat body. Starts its own redis-server on port 18340 (no
persistence) and three `sfq-proxy serve` processes: `memory, 1 worker` (today's proxy),
`redis, 1 worker` and `redis, 2 workers` (--workers 2, SO_REUSEPORT), the last two with
`state: {redis: ..., lease_ttl_s: 5}` added to the config, each on a Redis database of its
own; and, for what the machine itself gives a second process, bench/passthrough.py (a bare
aiohttp relay, nothing shared) as 1 and as 2 processes on one port (SO_REUSEPORT). wrk
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
Requires: apt-get install nginx-light wrk redis-server (with redis-cli).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
import overhead

REDIS_PORT = 18340
TARGETS = {  # name → (port, workers, Redis database or None for state: memory)
    "memory, 1 worker": (18331, 1, None),
    "redis, 1 worker": (18332, 1, 1),
    "redis, 2 workers": (18333, 2, 2),
}
MODEL = "bench-json"
BARE = {"bare, 1 process": (18335, 1), "bare, 2 processes": (18336, 2)}  # name → (port, processes)
BASELINE = "baseline, redis 1w"  # --baseline: another version's code, as `redis, 1 worker`


def config_text(port: int, db: int | None) -> str:
    """overhead.py's proxy config on ``port``, with ``state: redis`` when ``db`` is set."""
    config = yaml.safe_load(overhead.proxy_config(modes=tuple(overhead.NGINX_PORTS)))
    config["listen"]["port"] = port
    if db is not None:
        config["state"] = {"redis": f"redis://127.0.0.1:{REDIS_PORT}/{db}", "lease_ttl_s": 5}
    return yaml.safe_dump(config, sort_keys=False)


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (the serve process and its forked workers), from ppid."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def tree_cpu_seconds(root: int) -> float:
    """CPU of the whole tree: live processes, plus the children ``root`` reaped already."""
    total = 0.0
    for pid in tree_pids(root):
        try:
            total += overhead.cpu_seconds(pid)
        except OSError:
            continue
    fields = Path(f"/proc/{root}/stat").read_text().rsplit(")", 1)[1].split()
    return total + (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def listeners(port: int) -> int:
    """Sockets listening on ``port`` (one per worker under SO_REUSEPORT)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(
        1 for line in lines if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"
    )


def wait_ready(
    port: int, workers: int, proc: subprocess.Popen, log: Path | None, readyz: bool = True
) -> None:
    """Every worker listening and /readyz answering 200 (Redis reached, backends healthy);
    without ``readyz`` (the bare relay has none), listening."""
    for _ in range(300):
        if proc.poll() is not None:
            output = log.read_text() if log else ""
            raise RuntimeError(f"{port}: ended ({proc.returncode}):\n{output}")
        if listeners(port) >= workers:
            if not readyz:
                return
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"{port}: not ready:\n{log.read_text() if log else ''}")


def run_wrk(url: str, connections: int, seconds: float, work: Path, key: str) -> dict[str, float]:
    """overhead.wrk, but counting non-2xx answers and socket errors instead of refusing them."""
    try:
        out = None
        result = overhead.wrk(url, MODEL, connections, seconds, work, key)
    except RuntimeError as err:  # "errors under load:\n" + wrk's output
        out = str(err).split("\n", 1)[1]
        result = {
            "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "requests": int(re.search(r"(\d+) requests in", out).group(1)),
            "p50": overhead._ms(re.search(r"50%\s+([\d.]+\w+)", out).group(1)),
            "p99": overhead._ms(re.search(r"99%\s+([\d.]+\w+)", out).group(1)),
        }
        print(f"  wrk {url} c={connections}: {out.strip()}", file=sys.stderr)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out or "")
    result["non2xx"] = int(non2xx.group(1)) if non2xx else 0
    sock = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out or ""
    )
    result["sockerr"] = sum(map(int, sock.groups())) if sock else 0
    return result


def fcall_calls() -> int:
    """FCALL calls so far, from INFO commandstats (redis-cli: redis-py would
    import the stdlib's queue, which bench/queue.py shadows here)."""
    out = subprocess.run(
        ["redis-cli", "-p", str(REDIS_PORT), "INFO", "commandstats"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return sum(int(n) for n in re.findall(r"^cmdstat_fcall:calls=(\d+)", out, re.M))


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the serve parent passes it to its workers), then SIGKILL the tree if stuck."""
    if proc.poll() is not None:
        return
    pids = tree_pids(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in pids[1:]:  # a worker left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3, help="runs per target; medians shown")
    parser.add_argument(
        "--key", default="sk-bench-a", choices=overhead.KEYS,
        help="whose requests: sk-bench-a's org has rpm and tpm (one more Redis call per "
        "request), sk-bench-b's an in-flight cap only",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", type=Path,
        help="a checkout of another version (git worktree add DIR REV): its `redis, 1 worker` "
        "runs beside this code's, interleaved, with the medians of the paired differences",
    )  # fmt: skip
    args = parser.parse_args()
    targets = dict(TARGETS)
    if args.baseline is not None:
        targets[BASELINE] = (18334, 1, 3)
    # Ctrl-C (even when started from a shell's background job, which ignores it) and SIGTERM
    # unwind through the finally below, which stops every process started here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for tool in ("nginx", "wrk", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: apt-get install nginx-light wrk redis-server")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # nginx's workers (not root) read the bodies from here
        (work / "nginx.conf").write_text(overhead.nginx_conf(work))
        procs: list[subprocess.Popen] = []
        try:
            procs.append(subprocess.Popen(["nginx", "-c", str(work / "nginx.conf")]))
            redis_proc = subprocess.Popen(
                ["redis-server", "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
                 "--bind", "127.0.0.1", "--dir", str(work)], stdout=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(redis_proc)
            for ports in overhead.NGINX_PORTS.values():
                for port in ports:
                    overhead.wait_listening(port)
            overhead.wait_listening(REDIS_PORT)
            proxies: dict[str, subprocess.Popen] = {}
            for name, (port, workers, db) in targets.items():
                path, log = work / f"proxy-{port}.yaml", work / f"proxy-{port}.log"
                path.write_text(config_text(port, db))
                code = args.baseline.resolve() if name == BASELINE else None
                env = None if code is None else {**os.environ, "PYTHONPATH": str(code)}
                with log.open("w") as err:
                    proxies[name] = subprocess.Popen(
                        [sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path),
                         "--workers", str(workers)], stdout=subprocess.DEVNULL, stderr=err,
                        cwd=code, env=env,
                    )  # fmt: skip
                procs.append(proxies[name])
                wait_ready(port, workers, proxies[name], log)
            ports = {name: port for name, (port, *_) in targets.items()}
            backends = [f"http://127.0.0.1:{port}" for port in overhead.NGINX_PORTS["json"]]
            for name, (port, processes) in BARE.items():
                proxies[name] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).parent / "passthrough.py"), "--processes",
                     str(processes), str(port), *backends],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # wrk's cut requests
                )  # fmt: skip
                procs.append(proxies[name])
                wait_ready(port, processes, proxies[name], None, readyz=False)
                ports[name] = port
            for port in ports.values():  # warm-up: imports, script load, pools
                run_wrk(f"http://127.0.0.1:{port}", max(args.connections), 1, work, args.key)
            print(HEADER)
            for connections in args.connections:
                runs: dict[str, list[dict[str, float]]] = {name: [] for name in ports}
                for _ in range(args.rounds):  # interleaved: a noisy spell hits all alike
                    for name, port in ports.items():
                        pid = proxies[name].pid
                        before = (tree_cpu_seconds(pid), overhead.cpu_seconds(redis_proc.pid))
                        calls = fcall_calls()
                        url = f"http://127.0.0.1:{port}"
                        r = run_wrk(url, connections, args.seconds, work, args.key)
                        n = r["requests"]
                        r["cpu_us"] = (tree_cpu_seconds(pid) - before[0]) * 1e6 / n
                        r["redis_us"] = (overhead.cpu_seconds(redis_proc.pid) - before[1]) * 1e6 / n
                        r["fcalls"] = (fcall_calls() - calls) / n
                        runs[name].append(r)
                medians = {name: overhead._median(rs) for name, rs in runs.items()}
                for name, rs in runs.items():  # errors: every one counts, not the median
                    medians[name]["non2xx"] = sum(r["non2xx"] for r in rs)
                    medians[name]["sockerr"] = sum(r["sockerr"] for r in rs)
                for name, r in medians.items():
                    print(_row(connections, name, r), flush=True)
                _summary(connections, medians)
                if BASELINE in runs:
                    _paired(runs["redis, 1 worker"], runs[BASELINE])
            for name in targets:
                log = work / f"proxy-{targets[name][0]}.log"
                lines = Counter(line for line in log.read_text().splitlines() if line.strip())
                if lines:
                    print(f"\n{name}: its stderr ({lines.total()} lines, warm-up included):")
                    print("\n".join(f"  {n:>5} × {line}" for line, n in lines.most_common(8)))
        finally:
            for proc in reversed(procs):  # proxies first, then redis and nginx
                stop(proc)


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
