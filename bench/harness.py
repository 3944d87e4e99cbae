"""The benches' harness: what they start, how they load it, what they count and how they show it.

The benches that start servers are scripts on this module, which imports none of them
(bench/README.md lists them all). Of the package it imports nothing: the proxy runs as its
CLI (``python -m sfq_proxy.cli serve --config FILE``) in a process of its own, from this
tree or from another checkout (``src``), so that moving a module inside ``sfq_proxy``
breaks no bench.

- **Ports**: free ones (``free_ports``), never fixed: two benches, or two people's, can run
  side by side.
- **Processes**: ``Processes`` starts each child with its output in a file (or nowhere),
  kills it with the bench (even a SIGKILLed one), and stops it and the workers it forked
  when the block ends.
- **Backends**: ``nginx`` (fixed answers, far faster than any Python proxy: a chat
  completion, or a 200-event SSE stream sent in one burst), ``paced`` (``servers.py
  paced``: the same stream, an event per write 1 ms apart, as a model server writes tokens),
  ``redis``.
- **Middles**: ``passthrough`` (``servers.py passthrough``: aiohttp + uvloop, nothing else;
  the floor), ``sfq_proxy`` (the CLI on a generated YAML: ``proxy_config``, every feature
  of config/example.yaml on; optionally with per-request features switched off, or
  profiled, by ``servers.py serve``), ``vllm_router`` (the vLLM project's Rust router,
  pip-installed into bench/.venv-router on first use).
- **CPU**: ``tree_cpu_seconds``, utime + stime of a process and its descendants, from /proc.
- **Load**: ``wrk`` on a Lua script (``chat_script``: the realistic chat body and a key).
- **Tables**: ``Table`` prints figures in columns as they come; ``median`` of rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVERS = HERE / "servers.py"
KEYS = {"sk-bench-a": ("team-a", "interactive"), "sk-bench-b": ("team-b", "batch"),
        "sk-bench-c": ("team-c", "batch"), "sk-bench-d": ("team-d", "interactive")}  # fmt: skip
CHAT = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Summarise the quarterly report in three "
                      "bullet points, focusing on revenue, costs and the outlook."}],
        "max_tokens": 200, "temperature": 0.2}  # fmt: skip
STREAM_EVENTS = 200  # chunks of a stream (a role, tokens, a finish); then usage and [DONE]
ROUTER = "vllm-router==0.1.17"
ROUTER_VENV = HERE / ".venv-router"
OFF_ENV = "SFQ_BENCH_OFF"  # features servers.py switches off in the proxy's process
PROFILE_ENV = "SFQ_BENCH_PROFILE"  # where servers.py writes the profile (SIGUSR1 … SIGUSR2)
# feature → what it is; servers.py holds what it replaces (names of package internals)
FEATURES = {
    "access_log": "the access line",
    "metrics": "every metric update",
    "calibration": "the calibration's observe",
    "answer_counting": "usage read, outcome, answer metrics, calibration",
    "settling": "request metrics and the access line",
    "ratelimit_headers": "the six x-ratelimit-* headers",
    "usage_stripper": "dropping the usage event asked for",
    "error_event": "the search for an error event",
}
STREAM_ONLY = {"usage_stripper"}


def need(*tools: str, packages: str) -> None:
    """Exit saying what to install when one of ``tools`` is missing."""
    if missing := [tool for tool in tools if not shutil.which(tool)]:
        sys.exit(f"{', '.join(missing)} missing: apt-get install {packages}")


# --- ports --------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """Ports of 127.0.0.1 that nothing is bound to now."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]


def listeners(port: int) -> int:
    """Sockets listening on ``port`` of 127.0.0.1 (one per worker under SO_REUSEPORT)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    suffix = f":{port:04X}"
    return sum(1 for line in lines if line.split()[1].endswith(suffix) and line.split()[3] == "0A")


# --- processes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """A process to start: its argv, environment (None: this one's) and working directory."""

    argv: list[str]
    env: dict[str, str] | None = None
    cwd: Path | None = None

    def under(self, *prefix: str) -> Command:
        """The same, run by ``prefix`` (valgrind, say)."""
        return replace(self, argv=[*prefix, *self.argv])


def _die_with_parent() -> None:
    """In the child: SIGTERM when the bench dies, even by SIGKILL (Linux prctl)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Processes:
    """A bench's child processes: each one's stdout and stderr in ``work/NAME.out`` and
    ``.err`` (or dropped), all stopped when the block ends, however it ends."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name in reversed(list(self.procs)):  # the middles before their backends
            self.stop(name)

    def start(
        self, name: str, command: Command, out: bool = True, err: bool = True
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` as ``name``, its stdout in ``out(name)`` and its stderr in
        ``err(name)``, or nowhere (a proxy's access log under load, the tracebacks of a relay
        whose requests wrk cuts at its end)."""
        if name in self.procs:
            raise ValueError(f"{name} runs already")
        with contextlib.ExitStack() as stack:
            files: list[Any] = [
                stack.enter_context(open(path(name), "wb")) if keep else subprocess.DEVNULL
                for keep, path in ((out, self.out), (err, self.err))
            ]
            self.procs[name] = subprocess.Popen(
                command.argv, stdout=files[0], stderr=files[1], env=command.env,
                cwd=command.cwd, preexec_fn=_die_with_parent,
            )  # fmt: skip
        return self.procs[name]

    def out(self, name: str) -> Path:
        return self.work / f"{name}.out"

    def err(self, name: str) -> Path:
        return self.work / f"{name}.err"

    def tail(self, name: str) -> str:
        path = self.err(name)
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.tail(name)}")

    def stop(self, name: str) -> None:
        """SIGTERM (a serve parent passes it to its workers), SIGKILL if it does not end in 15
        s; then any descendant left behind."""
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        pids = tree_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in pids[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Server:
    """A process listening on ``port`` (with ``workers`` sockets), once ``ready``."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    procs: Processes
    workers: int = 1
    ready_path: str | None = None  # a GET that answers 200 once it serves (e.g. /readyz)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self, seconds: float = 60) -> Server:
        """Wait until it listens (and its ``ready_path`` answers 200); fail at once if it
        exits meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.procs.tail(self.name)
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{tail}")
            if listeners(self.port) >= self.workers and self._answers():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready on {self.port} in {seconds} s")

    def _answers(self) -> bool:
        if self.ready_path is None:
            return True
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def cpu_seconds(self) -> float:
        """CPU of the process and of all it forked."""
        return tree_cpu_seconds(self.proc.pid)


def ready(*servers: Server, seconds: float = 60) -> None:
    """Wait for ``servers``, started before: they start up side by side."""
    for server in servers:
        server.ready(seconds)


# --- CPU ----------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name (state, ppid, …)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (a serve process's workers and parse worker)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):  # ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def tree_cpu_seconds(root: int) -> float:
    """CPU of ``root``'s whole tree: live processes, plus the children it reaped already."""
    total = 0.0
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    fields = _stat(root)
    return total + (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert found is not None, status
    return int(found.group(1)) * 1024


# --- the answers and the backends ---------------------------------------------------------


def completion() -> str:
    """A chat completion with usage: nginx's JSON answer."""
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench-json",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Revenue up. " * 20}}],
        "usage": {"prompt_tokens": 42, "completion_tokens": 60, "total_tokens": 102},
    })  # fmt: skip


def stream(model: str = "bench-stream", events: int = STREAM_EVENTS) -> str:
    """A chat completion's SSE stream of ``events`` chunks (a role, tokens, a finish), then a
    usage chunk and [DONE] (35 KB): nginx's stream answer, and the paced backend's."""
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
            "model": model}  # fmt: skip

    def event(data: dict[str, object]) -> str:
        return f"data: {json.dumps({**head, **data}, separators=(',', ':'))}\n\n"

    def chunk(delta: dict[str, str], finish: str | None = None) -> str:
        return event({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": f" tok{i}"}) for i in range(events - 2)]
    out.append(chunk({"content": " end"}, "stop"))
    usage = {"prompt_tokens": 42, "completion_tokens": events, "total_tokens": 42 + events}
    out.append(event({"choices": [], "usage": usage}))
    return "".join(out) + "data: [DONE]\n\n"


NGINX_ANSWERS = {"json": ("completion.json", "application/json", completion),
                 "stream": ("stream.txt", "text/event-stream", stream)}  # fmt: skip


def nginx(
    procs: Processes, kinds: Iterable[str] = NGINX_ANSWERS, count: int = 2
) -> dict[str, list[str]]:
    """nginx (one worker) as ``count`` backends of each of ``kinds`` (``json``, ``stream``)
    on free ports, listening when this returns; their URLs by kind. Any POST gets the
    kind's answer, ``GET /health`` and ``POST /v1/traces`` a 200."""
    need("nginx", packages="nginx-light")
    work = procs.work
    work.chmod(0o755)  # nginx's workers (not root) read the bodies from here
    ports = {kind: free_ports(count) for kind in kinds}
    servers = []
    for kind, kind_ports in ports.items():
        body, content_type, make = NGINX_ANSWERS[kind]
        (work / body).write_text(make())
        for port in kind_ports:
            servers.append(f"""
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location = /health {{ return 200; }}
    location = /v1/traces {{ return 200; }}  # an OTLP collector that takes every span
    location / {{
      # POST to a static file: answered by the 405 handler with the file and 200
      error_page 405 =200 $uri;
      default_type {content_type};
      root {work};
      try_files /{body} =404;
    }}
  }}""")
    (work / "nginx.conf").write_text(f"""worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {"".join(servers)}
}}""")
    proc = procs.start("nginx", Command(["nginx", "-c", str(work / "nginx.conf")]))
    for kind_ports in ports.values():
        for port in kind_ports:
            Server("nginx", port, proc, procs).ready(10)
    return {
        kind: [f"http://127.0.0.1:{p}" for p in kind_ports] for kind, kind_ports in ports.items()
    }


def paced(procs: Processes, count: int = 2, events: int = STREAM_EVENTS) -> list[str]:
    """``count`` paced backends (servers.py paced: each SSE event its own write, 1 ms apart),
    listening when this returns; their URLs."""
    servers = []
    for i, port in enumerate(free_ports(count)):
        argv = [sys.executable, str(SERVERS), "paced", str(port), "--events", str(events)]
        servers.append(Server(f"paced-{i}", port, procs.start(f"paced-{i}", Command(argv)), procs))
    ready(*servers, seconds=10)
    return [server.url for server in servers]


def redis(procs: Processes, name: str = "redis") -> Server:
    """redis-server on a free port, without persistence, answering PING when this returns."""
    need("redis-server", packages="redis-server")
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(procs.work)]  # fmt: skip
    server = Server(name, port, procs.start(name, Command(argv)), procs).ready(10)
    for _ in range(100):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as sock:
            sock.sendall(b"PING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return server
        time.sleep(0.05)
    raise RuntimeError("redis-server does not answer PING")


# --- the middles --------------------------------------------------------------------------


def passthrough(
    procs: Processes,
    name: str,
    backends: Sequence[str],
    upstream: bool = False,
    processes: int = 1,
    under: Sequence[str] = (),
) -> Server:
    """servers.py passthrough in front of ``backends`` (in turn): aiohttp + uvloop relaying,
    nothing else; ``upstream``: on sfq-proxy's own upstream connections instead of aiohttp's
    client; ``processes`` sharing the port (SO_REUSEPORT); run by ``under`` (valgrind, say)
    if given. Started, not yet ready."""
    port = free_port()
    argv = [sys.executable, str(SERVERS), "passthrough", "--processes", str(processes)]
    if upstream:  # it imports sfq_proxy: this tree's
        argv.append("--upstream")
    command = Command([*argv, str(port), *backends], {**os.environ, "PYTHONPATH": str(ROOT)})
    # its output goes nowhere: a traceback for each request wrk cuts at its end
    proc = procs.start(name, command.under(*under), out=False, err=False)
    return Server(name, port, proc, procs, processes)


def package_module(src: Path = ROOT) -> str:
    """The module that runs ``src``'s CLI: ``sfq_proxy`` if it has a ``__main__``."""
    return "sfq_proxy" if (src / "sfq_proxy" / "__main__.py").exists() else "sfq_proxy.cli"


def checkout(path: str | Path) -> Path:
    """``path`` if it holds a ``sfq_proxy/`` to run (argparse's type of ``--baseline``):
    without one, the package installed in the venv would run instead, unseen."""
    src = Path(path).resolve()
    if not (src / "sfq_proxy").is_dir():
        raise argparse.ArgumentTypeError(f"{src} holds no sfq_proxy/ to run")
    return src


def cli(*args: str, src: Path = ROOT, env: dict[str, str] | None = None) -> Command:
    """``sfq-proxy ARGS`` of the package in ``src`` (this tree, or another checkout): its
    directory first on the path, as the working directory too (``-m`` puts it first)."""
    src = checkout(src)
    environ = {**os.environ, **(env or {}), "PYTHONPATH": str(src)}
    return Command([sys.executable, "-m", package_module(src), *args], environ, src)


def proxy_command(
    config: Path,
    src: Path = ROOT,
    workers: int = 1,
    without: Sequence[str] = (),
    profile: Path | None = None,
    env: dict[str, str] | None = None,
) -> Command:
    """``sfq-proxy serve --config CONFIG`` of ``src`` (``env`` added to the environment);
    with ``without`` (names of FEATURES) or ``profile``, run by servers.py, which switches
    those features off and profiles between a SIGUSR1 and a SIGUSR2 (into ``profile``)
    before it hands over to the CLI."""
    args = ["serve", "--config", str(config)] + (["--workers", str(workers)] if workers > 1 else [])
    command = cli(*args, src=src, env=env)
    if not without and profile is None:
        return command
    env = {**(command.env or {}), OFF_ENV: ",".join(without), PROFILE_ENV: str(profile or "")}
    return Command(
        [sys.executable, str(SERVERS), "serve", package_module(src), *args], env, src.resolve()
    )


def features(names: Sequence[str]) -> list[str]:
    """``names`` checked against FEATURES; ``all``: every one."""
    if list(names) == ["all"]:
        return list(FEATURES)
    if unknown := sorted(set(names) - set(FEATURES)):
        sys.exit(f"no feature {unknown}; known: {list(FEATURES)} or all")
    return list(names)


def proxy_config(
    pools: dict[str, Sequence[str]], port: int = 0, state_file: Path | None = None
) -> dict[str, Any]:
    """config/example.yaml's features on bench backends: a pool per kind of ``pools``
    (model ``bench-KIND``, 512 slots per backend), keys of four orgs, orgs with caps and
    rates, classes with queue limits, the queue-memory bound, metrics and the access log (on
    by default), and calibration kept in ``state_file``. Caps and rates far above
    what a bench sends: their code runs on every request, and nothing is refused."""
    config: dict[str, Any] = {
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
        "pools": {
            kind: {
                "models": [f"bench-{kind}"],
                "health": {"interval_s": 5},
                "backends": [{"url": url, "slots": 512} for url in urls],
            }
            for kind, urls in pools.items()
        },
    }
    if state_file is not None:
        config["calibration"] = {"state_file": str(state_file)}
    return config


def sfq_proxy(
    procs: Processes,
    name: str,
    config: dict[str, Any],
    src: Path = ROOT,
    workers: int = 1,
    without: Sequence[str] = (),
    profile: Path | None = None,
    out: bool = False,
    err: bool = True,
    under: Sequence[str] = (),
    ready_path: str = "/readyz",
) -> Server:
    """``sfq-proxy serve`` of ``src`` on ``config`` (its ``listen.port`` replaced by a free
    one), run by ``under`` if given, ready once every worker listens and ``ready_path``
    answers 200 (``/readyz``: its backends are healthy). Started, not yet ready. Its
    stdout (the access log) goes nowhere unless ``out``; its stderr to a file unless not
    ``err``."""
    port = free_port()
    config = {**config, "listen": {**config.get("listen", {}), "port": port}}
    path = procs.work / f"{name.replace(' ', '_')}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = proxy_command(path, src, workers, without, profile).under(*under)
    proc = procs.start(name, command, out, err)
    return Server(name, port, proc, procs, workers, ready_path)


def ensure_router() -> Path:
    """vllm-router in its own venv (its pins are not ours), installed on first use."""
    binary = ROUTER_VENV / "bin" / "vllm-router"
    if not binary.exists():
        print(f"installing {ROUTER} into {ROUTER_VENV} …", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True)
        subprocess.run([str(ROUTER_VENV / "bin" / "pip"), "install", "-q", ROUTER], check=True)
    return binary


def vllm_router(procs: Processes, name: str, backends: Sequence[str]) -> Server:
    """vllm-router, round robin over ``backends``. Started, not yet ready."""
    port = free_port()
    argv = [str(ensure_router()), "--host", "127.0.0.1", "--port", str(port), "--policy",
            "round_robin", "--log-level", "warning", "--worker-urls", *backends]  # fmt: skip
    return Server(name, port, procs.start(name, Command(argv), out=False, err=False), procs)


# --- load ---------------------------------------------------------------------------------


def chat_body(model: str, stream: bool | None = None) -> str:
    """The realistic chat body for ``model``; a stream if ``model`` ends in ``stream``."""
    streaming = model.endswith("stream") if stream is None else stream
    return json.dumps({**CHAT, "model": model, "stream": streaming})


def chat_script(work: Path, model: str, key: str = "sk-bench-a") -> Path:
    """A wrk script POSTing ``model``'s chat body with ``key``."""
    script = work / f"{model}-{key}.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(chat_body(model))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
    )
    return script


def wrk(
    url: str,
    script: Path,
    connections: int,
    seconds: float,
    threads: int | None = None,
    strict: bool = True,
    path: str = "/v1/chat/completions",
) -> dict[str, float]:
    """wrk's figures for ``seconds`` of ``script``'s requests to ``url``: rps, requests,
    p50 and p99 (ms), non2xx, sockerr (connect, read, write and timeout errors). ``strict``:
    a non-2xx answer is an error."""
    threads = threads or min(connections, 2)
    argv = ["wrk", f"-c{connections}", f"-t{threads}", f"-d{max(1, round(seconds))}s",
            "--latency", "-s", str(script), url + path]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if strict and non2xx:
        raise RuntimeError(f"errors under load:\n{out}")
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)

    def found(pattern: str) -> str:
        match = re.search(pattern, out)
        if match is None:
            raise RuntimeError(f"wrk: no {pattern!r} in:\n{out}")
        return match.group(1)

    return {
        "rps": float(found(r"Requests/sec:\s+([\d.]+)")),
        "requests": int(found(r"(\d+) requests in")),
        "p50": _ms(found(r"50%\s+([\d.]+\w+)")),
        "p99": _ms(found(r"99%\s+([\d.]+\w+)")),
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "sockerr": sum(map(int, sock.groups())) if sock else 0,
    }


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


# --- tables -------------------------------------------------------------------------------


class Table:
    """Columns of figures, printed a row at a time as they come. A column is a title and a
    format spec (``"<14"`` for text, ``">9.2f"`` for a figure); a cell of None is blank."""

    def __init__(self, *columns: tuple[str, str]) -> None:
        self.columns = columns

    @staticmethod
    def _align(spec: str) -> str:
        """The spec's alignment and width alone, for a title or text."""
        match = re.match(r"[<>^]?\d*", spec)
        return match.group(0) if match else ""

    def header(self) -> str:
        return "".join(f"{title:{self._align(spec)}}" for title, spec in self.columns).rstrip()

    def row(self, *cells: object) -> str:
        out = []
        for (_, spec), cell in zip(self.columns, cells, strict=False):
            if cell is None or isinstance(cell, str):
                out.append(f"{cell or '':{self._align(spec)}}")
            else:
                out.append(f"{cell:{spec}}")
        return "".join(out).rstrip()

    def print_header(self) -> None:
        print(self.header(), flush=True)

    def print_row(self, *cells: object) -> None:
        print(self.row(*cells), flush=True)


def median(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds (shared cores make single runs jumpy)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base
