"""Side by side: direct to a fast backend, a bare pass-through, sfq-proxy, vllm-router.

    python bench/overhead.py [--seconds 5] [--connections 1 16 64] [--rounds 3]
                             [--modes json stream paced] [--no-router]
                             [--baseline CHECKOUT] [--without FEATURE ...]

Three kinds of answer: ``json``, a fixed chat completion with usage, and ``stream``, a
200-event SSE stream ending with a usage chunk and [DONE], both from nginx (Debian's
package), much faster than any Python proxy, which sends a stream in one burst; and
``paced``, the same stream from ``paced_backend.py``, each event its own write 1 ms apart,
as a model server writes tokens. wrk (Debian's package) drives load with a realistic chat
body and a key. sfq-proxy runs ``sfq-proxy serve`` on a config with every feature on as
in config/example.yaml (keys, orgs with caps and rates, classes with queue limits, metrics,
the access log, calibration, the queue-memory bound); the bare floor is ``passthrough.py``
(aiohttp + uvloop, nothing else), and ``bare-upstream`` the same on the upstream
connections sfq-proxy uses instead of aiohttp's ``ClientSession`` (``passthrough.py
--upstream``): the floor on the proxy's own client; the peer is vllm-router (Rust), round
robin, installed with pip into ``bench/.venv-router`` on first use. One table: req/s,
p50/p99 latency, ratio to direct, and the CPU microseconds per request (per event too, for
``paced``) of the process in the middle with its ratio to the bare pass-through's: medians
of --rounds runs, interleaved across targets so a noisy spell hits all alike. ``--baseline`` adds
"sfq (base)": the sfq-proxy of another checkout (``git worktree add /tmp/base <commit>``)
on the same config and port kind, so that a change is measured against the code before it
in the same rounds. ``--without`` adds "sfq −features": sfq-proxy with those per-request
features switched off (``feature_cost.py``'s names, or ``all``), so that what the rest of
the path costs is timed beside the whole, in the same rounds.
Requires: apt-get install nginx-light wrk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
NGINX_PORTS = {"json": (18301, 18302), "stream": (18311, 18312)}
PACED_PORTS = (18351, 18352)  # paced_backend.py
MODES = ("json", "stream", "paced")
PASS_PORT, UPSTREAM_PORT, PROXY_PORT, BASE_PORT, ROUTER_PORT = 18320, 18321, 18330, 18331, 18340
WITHOUT_PORT = 18332  # sfq-proxy with features switched off (--without)
PACED_EVENTS = 200  # as nginx's stream: 200 chunks, then a usage event and [DONE]
ROUTER = "vllm-router==0.1.17"
ROUTER_VENV = HERE / ".venv-router"
KEYS = {"sk-bench-a": ("team-a", "interactive"), "sk-bench-b": ("team-b", "batch"),
        "sk-bench-c": ("team-c", "batch"), "sk-bench-d": ("team-d", "interactive")}  # fmt: skip
CHAT = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Summarise the quarterly report in three "
                      "bullet points, focusing on revenue, costs and the outlook."}],
        "max_tokens": 200, "temperature": 0.2}  # fmt: skip


def completion() -> str:
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench-json",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Revenue up. " * 20}}],
        "usage": {"prompt_tokens": 42, "completion_tokens": 60, "total_tokens": 102},
    })  # fmt: skip


def stream() -> str:
    def event(delta: dict, finish: str | None = None) -> str:
        chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                 "model": "bench-stream",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"

    events = [event({"role": "assistant", "content": ""})]
    events += [event({"content": f" tok{i}"}) for i in range(198)]
    events.append(event({"content": " end"}, "stop"))
    usage = {
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
        "model": "bench-stream", "choices": [],
        "usage": {"prompt_tokens": 42, "completion_tokens": 200, "total_tokens": 242},
    }  # fmt: skip
    return "".join(events) + f"data: {json.dumps(usage, separators=(',', ':'))}\n\ndata: [DONE]\n\n"


def nginx_conf(work: Path) -> str:
    (work / "completion.json").write_text(completion())
    (work / "stream.txt").write_text(stream())
    servers = []
    for mode, ports in NGINX_PORTS.items():
        body, kind = (("completion.json", "application/json") if mode == "json"
                      else ("stream.txt", "text/event-stream"))  # fmt: skip
        for port in ports:
            servers.append(f"""
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location = /health {{ return 200; }}
    location / {{
      # POST to a static file: answered by the 405 handler with the file and 200
      error_page 405 =200 $uri;
      default_type {kind};
      root {work};
      try_files /{body} =404;
    }}
  }}""")
    return f"""worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {"".join(servers)}
}}"""


@contextmanager
def nginx_backends(work: Path, modes: Iterable[str] = NGINX_PORTS) -> Iterator[None]:
    """nginx as ``modes``' backends (``nginx_conf``), serving from ``work``, until the
    block ends."""
    work.chmod(0o755)  # nginx's workers (not root) read the bodies from here
    (work / "nginx.conf").write_text(nginx_conf(work))
    nginx = subprocess.Popen(["nginx", "-c", str(work / "nginx.conf")])
    try:
        for mode in modes:
            for port in NGINX_PORTS[mode]:
                wait_listening(port)
        yield
    finally:
        nginx.terminate()
        nginx.wait()


def backend_ports() -> dict[str, tuple[int, ...]]:
    """Each mode's two backends (other benches replace NGINX_PORTS)."""
    return {**NGINX_PORTS, "paced": PACED_PORTS}


def proxy_config(
    work: Path | None = None, modes: tuple[str, ...] = MODES, port: int = PROXY_PORT
) -> str:
    """config/example.yaml's features on bench backends (a pool per mode of ``modes``, whose
    backends the caller runs): keys, orgs with caps and rates, classes with queue limits,
    the queue-memory bound, calibration kept in a state file, metrics and the access log (on
    by default). Caps and rates far above what the bench sends: their code runs on every
    request, and nothing is refused."""
    pools = {
        mode: {"models": [f"bench-{mode}"], "health": {"interval_s": 5},
               "backends": [{"url": f"http://127.0.0.1:{p}", "slots": 512} for p in ports]}
        for mode, ports in backend_ports().items()
        if mode in modes
    }  # fmt: skip
    config: dict[str, object] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "limits": {"queue_memory_mb": 512},
        "keys": [{"key": k, "org": o, "classes": [c, "batch"]} for k, (o, c) in KEYS.items()],
        "classes": {
            "interactive": {"weight": 6, "max_queue_age_s": 45, "max_queue_len": 1000},
            "batch": {"weight": 1, "max_queue_age_s": 7200, "max_queue_len": 100000},
        },
        "orgs": {
            "team-a": {"weight": 2, "max_in_flight": 4096, "rpm": 10**9, "tpm": 10**12},
            "team-b": {"weight": 1, "max_in_flight": 400},
        },
        "pools": pools,
    }
    if work is not None:
        config["calibration"] = {"state_file": str(work / f"calibration-{port}.json")}
    return json.dumps(config, indent=1)


def ensure_router() -> Path:
    """vllm-router in its own venv (its pins are not ours), installed on first use."""
    binary = ROUTER_VENV / "bin" / "vllm-router"
    if not binary.exists():
        print(f"installing {ROUTER} into {ROUTER_VENV} …", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True)
        pip = [str(ROUTER_VENV / "bin" / "pip"), "install", "-q", ROUTER]
        subprocess.run(pip, check=True)
    return binary


def wrk(
    url: str, model: str, connections: int, seconds: float, work: Path, key: str = "sk-bench-a"
) -> dict[str, float]:
    """wrk's figures for ``seconds`` of ``model``'s chat requests with ``key`` (of KEYS)."""
    script = work / f"{model}.lua"
    body = json.dumps({**CHAT, "model": model, "stream": model.endswith("stream")})
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(body)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
    )
    out = subprocess.run(
        ["wrk", f"-c{connections}", f"-t{min(connections, 2)}", f"-d{seconds}s", "--latency",
         "-s", str(script), url + "/v1/chat/completions"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    if "Non-2xx" in out:
        raise RuntimeError(f"errors under load:\n{out}")
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "p50": _ms(re.search(r"50%\s+([\d.]+\w+)", out).group(1)),
        "p99": _ms(re.search(r"99%\s+([\d.]+\w+)", out).group(1)),
    }


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_listening(port: int, seconds: float = 10) -> None:
    import socket

    for _ in range(round(seconds / 0.05)):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3, help="runs per target; medians shown")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    parser.add_argument("--baseline", type=Path, help="a checkout whose sfq-proxy runs too")
    parser.add_argument(
        "--without",
        nargs="+",
        default=[],
        metavar="FEATURE",
        help="also run sfq-proxy with these features off (feature_cost.py's)",
    )
    args = parser.parse_args()
    args.without = _features(args.without)
    for tool in ("nginx", "wrk"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: apt-get install nginx-light wrk")
    router = None if args.no_router else ensure_router()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # nginx's workers (not root) read the bodies from here
        (work / "nginx.conf").write_text(nginx_conf(work))
        (work / "proxy.yaml").write_text(proxy_config(work))
        (work / "base.yaml").write_text(proxy_config(work, port=BASE_PORT))
        (work / "without.yaml").write_text(proxy_config(work, port=WITHOUT_PORT))
        procs = [subprocess.Popen(["nginx", "-c", str(work / "nginx.conf")])]
        paced = [sys.executable, str(HERE / "paced_backend.py"), "--events", str(PACED_EVENTS)]
        procs += [subprocess.Popen([*paced, str(port)]) for port in PACED_PORTS]
        try:
            for ports in backend_ports().values():
                for port in ports:
                    wait_listening(port)
            print(HEADER)
            for mode in args.modes:
                procs += _compare(mode, args, work, router)
        finally:
            for proc in procs:
                _stop(proc)


def _compare(
    mode: str, args: argparse.Namespace, work: Path, router: Path | None
) -> list[subprocess.Popen[bytes]]:
    """One mode's rows: every target in front of the mode's two backends, at each count of
    connections. Returns the processes it started (stopped already)."""
    backends = [f"http://127.0.0.1:{p}" for p in backend_ports()[mode]]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    middles = {
        # the bare floor prints a traceback for each request wrk cuts at its end: quiet
        "bare": (PASS_PORT, subprocess.Popen(
            [sys.executable, str(HERE / "passthrough.py"), str(PASS_PORT), *backends], **quiet)),
        "bare-upstream": (UPSTREAM_PORT, subprocess.Popen(
            [sys.executable, str(HERE / "passthrough.py"), "--upstream", str(UPSTREAM_PORT),
             *backends], **quiet)),
        "sfq-proxy": (PROXY_PORT, subprocess.Popen(
            [sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(work / "proxy.yaml")],
            **quiet)),  # the access log, and a first start's "no calibration state yet"
    }  # fmt: skip
    if args.baseline is not None:
        serve = [sys.executable, "-m", "sfq_proxy.cli", "serve", "--config"]
        serve.append(str(work / "base.yaml"))
        env = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
        base = subprocess.Popen(serve, env=env, cwd=args.baseline, **quiet)  # ``-m``: cwd first
        middles["sfq (base)"] = (BASE_PORT, base)
    if args.without:
        middles["sfq −features"] = (WITHOUT_PORT, _without(args.without, work, quiet))
    if router is not None:
        command = [str(router), "--host", "127.0.0.1", "--port", str(ROUTER_PORT), "--policy",
                   "round_robin", "--log-level", "warning", "--worker-urls", *backends]  # fmt: skip
        middles["vllm-router"] = (ROUTER_PORT, subprocess.Popen(command, **quiet))
    for port, _ in middles.values():
        wait_listening(port, seconds=60)
    try:
        for connections in args.connections:
            targets = [("direct", backends[0], None)] + [
                (name, f"http://127.0.0.1:{port}", proc) for name, (port, proc) in middles.items()
            ]
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in targets}
            for _ in range(args.rounds):  # interleaved: a noisy spell hits all alike
                for name, url, proc in targets:
                    before = cpu_seconds(proc.pid) if proc else 0.0
                    result = wrk(url, f"bench-{mode}", connections, args.seconds, work)
                    if proc:
                        result["cpu_us"] = (cpu_seconds(proc.pid) - before) * 1e6
                        result["cpu_us"] /= result["requests"]
                    runs[name].append(result)
            direct, bare = _median(runs["direct"]), _median(runs["bare"])
            for name, *_ in targets:
                print(_row(mode, connections, name, _median(runs[name]), direct, bare), flush=True)
    finally:
        for _, proc in middles.values():
            _stop(proc)
    return [proc for _, proc in middles.values()]


def _features(names: list[str]) -> list[str]:
    """--without's features, checked against feature_cost.py's (``all``: every one)."""
    import feature_cost  # it imports this module: here, not at the top

    known = list(feature_cost.FEATURES)
    if names == ["all"]:
        return known
    if unknown := sorted(set(names) - set(known)):
        sys.exit(f"--without: no feature {unknown}; known: {known} or all")
    return names


def _without(features: list[str], work: Path, quiet: dict[str, int]) -> subprocess.Popen[bytes]:
    """sfq-proxy with ``features`` switched off, run by feature_cost.py as its launcher."""
    import feature_cost

    env = {**os.environ, feature_cost.OFF_ENV: ",".join(features)}
    serve = [sys.executable, str(HERE / "feature_cost.py"), feature_cost.LAUNCH, "serve"]
    return subprocess.Popen([*serve, "--config", str(work / "without.yaml")], env=env, **quiet)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait()


HEADER = (
    f"{'mode':<7}{'conn':>5} {'target':<14}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
    f"{'×direct':>8}{'cpu µs/req':>12}{'cpu ×bare':>10}{'µs/event':>10}"
)


def _median(results: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds (shared cores make single runs jumpy)."""
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def _row(mode: str, conns: int, name: str, r: dict, direct: dict, bare: dict) -> str:
    cpu = ""
    if "cpu_us" in r:
        cpu = f"{r['cpu_us']:>12.0f}{r['cpu_us'] / bare['cpu_us']:>10.2f}"
        if mode == "paced":
            cpu += f"{r['cpu_us'] / (PACED_EVENTS + 2):>10.1f}"
    return (f"{mode:<7}{conns:>5} {name:<14}{r['rps']:>9.0f}{r['p50']:>9.2f}{r['p99']:>9.2f}"
            f"{r['rps'] / direct['rps']:>8.2f}{cpu}")  # fmt: skip


if __name__ == "__main__":
    main()
