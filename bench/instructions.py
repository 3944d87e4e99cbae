"""Instructions per request under callgrind: the A/B that CPU time is too noisy for.

    python bench/instructions.py [--modes json stream] [--requests 400] [--connections 16]
                                 [--baseline CHECKOUT]

CPU time per request on this shared 2-core machine moves ±15 % between runs of
``overhead.py``, more than most single changes to the hot path save. Here each process in
the middle (the bare pass-through, the bare one on the proxy's own upstream client,
sfq-proxy, and the sfq-proxy of ``--baseline``'s checkout) runs under valgrind's callgrind
in front of ``overhead.py``'s nginx backends, on its config with the one pool of the mode:
after a warm-up its counters are zeroed, ``--requests`` requests are sent
(``--connections`` at a time, by aiohttp in this process), and the instructions the process
executed meanwhile are divided by them. That count does not depend on how busy the machine
is: it moves by about 1 % between runs, so a change of a few percent is seen.

It is not time: a cache miss costs more than an instruction, and the kernel's side of a
system call is not counted. ``overhead.py``'s CPU time stays the figure targets are set
in; this one tells whether a change to the hot path paid.
Requires: apt-get install valgrind nginx-light.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp
import overhead

WARM_UP = 100  # requests before the counters are zeroed: imports, first connections, caches
START_S = 600  # a Python process under callgrind runs ~50× slower: imports take a while


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", nargs="+", default=["json", "stream"], choices=["json", "stream"]
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--baseline", type=Path, help="a checkout whose sfq-proxy runs too")
    args = parser.parse_args()
    header = f"{'mode':<7}{'target':<15}{'Minstr/req':>11}{'×bare':>7}{'sfq÷base':>10}"
    each_mode(args.modes, header, lambda mode, work: _compare(mode, args, work))


def each_mode(modes: Sequence[str], header: str, rows: Callable[[str, Path], None]) -> None:
    """Print ``header``, then ``rows(mode, work)`` for each of ``modes``, in front of
    overhead.py's nginx backends (their files in the temporary directory ``work``)."""
    for tool in ("valgrind", "callgrind_control", "nginx"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: apt-get install valgrind nginx-light")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with overhead.nginx_backends(work, modes):
            print(header, flush=True)
            for mode in modes:
                rows(mode, work)


def _compare(mode: str, args: argparse.Namespace, work: Path) -> None:
    """One mode's rows: each target measured alone, one after the other."""
    backends = [f"http://127.0.0.1:{port}" for port in overhead.NGINX_PORTS[mode]]
    passthrough = [sys.executable, str(overhead.HERE / "passthrough.py")]
    serve = [sys.executable, "-m", "sfq_proxy.cli", "serve", "--config"]
    config = work / f"{mode}.yaml"
    config.write_text(overhead.proxy_config(work, modes=(mode,)))
    targets: list[tuple[str, int, list[str], Path | None]] = [
        ("bare", overhead.PASS_PORT, [*passthrough, str(overhead.PASS_PORT), *backends], None),
        ("bare-upstream", overhead.UPSTREAM_PORT,
         [*passthrough, "--upstream", str(overhead.UPSTREAM_PORT), *backends], None),
        ("sfq-proxy", overhead.PROXY_PORT, [*serve, str(config)], None),
    ]  # fmt: skip
    if args.baseline is not None:
        base = work / f"{mode}-base.yaml"
        base.write_text(overhead.proxy_config(work, modes=(mode,), port=overhead.BASE_PORT))
        targets.append(("sfq (base)", overhead.BASE_PORT, [*serve, str(base)], args.baseline))
    counts: dict[str, float] = {}
    for name, port, command, checkout in targets:
        count = counts[name] = _per_request(command, port, mode, args, checkout)
        row = f"{mode:<7}{name:<15}{count / 1e6:>11.3f}{count / counts['bare']:>7.2f}"
        if name == "sfq (base)":  # the change: sfq-proxy against the code before it
            row += f"{counts['sfq-proxy'] / count:>10.3f}"
        print(row, flush=True)


def _per_request(
    command: Sequence[str], port: int, mode: str, args: argparse.Namespace, checkout: Path | None
) -> float:
    """Instructions the process under ``command`` executes per request, after a warm-up."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in every run
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout.resolve())
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    proc = subprocess.Popen(
        [*valgrind, *command], env=env, cwd=checkout, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        overhead.wait_listening(port, seconds=START_S)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(_drive(url, f"bench-{mode}", WARM_UP, args.connections))
        _control(proc.pid, "--zero")
        asyncio.run(_drive(url, f"bench-{mode}", args.requests, args.connections))
        return _instructions(proc.pid) / args.requests
    finally:
        proc.terminate()
        proc.wait()


async def _drive(url: str, model: str, requests: int, connections: int) -> None:
    """``requests`` chat requests, ``connections`` at a time; each answer read whole and
    checked, so that what was counted is what was asked for."""
    stream = model.endswith("stream")
    body = json.dumps({**overhead.CHAT, "model": model, "stream": stream})
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench-a"}
    whole = b"data: [DONE]" if stream else b'"usage"'  # the end of the answer is there
    left = requests
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(url, data=body, headers=headers) as response:
                    answer = await response.read()
                    if response.status != 200 or whole not in answer:
                        raise RuntimeError(f"{url}: {response.status} {answer[:200]!r}")

        await asyncio.gather(*(client() for _ in range(connections)))


def _control(pid: int, *options: str) -> str:
    return subprocess.run(
        ["callgrind_control", *options, str(pid)], capture_output=True, text=True, check=True
    ).stdout


def _instructions(pid: int) -> int:
    """The instructions counted since the last zeroing, summed over the process's threads
    (``callgrind_control -e`` prints a line ``Th N  <count>`` for each)."""
    found = re.findall(r"^\s*Th\s+\d+\s+([\d,]+)", _control(pid, "-e"), re.MULTILINE)
    if not found:
        raise RuntimeError(f"no counts from callgrind for pid {pid}")
    return sum(int(count.replace(",", "")) for count in found)


if __name__ == "__main__":
    main()
