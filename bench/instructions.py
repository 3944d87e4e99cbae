"""Instructions per request under callgrind: the A/B that CPU time is too noisy for.

    python bench/instructions.py [--modes json stream] [--requests 400] [--connections 16]
                                 [--baseline CHECKOUT] [--features [FEATURE ...]] [--tracing]

CPU time per request on this shared 2-core machine moves ±15 % between runs of
``overhead.py``, more than most single changes to the hot path save. Here each process in
the middle (the bare pass-through, the bare one on the proxy's own upstream client,
sfq-proxy, and the sfq-proxy of ``--baseline``'s checkout) runs under valgrind's callgrind
in front of nginx's backends (harness.py), on the config of ``overhead.py`` with the one
pool of the mode: after a warm-up its counters are zeroed, ``--requests`` requests are sent
(``--connections`` at a time, by aiohttp in this process), and the instructions the process
executed meanwhile are divided by them. That count does not depend on how busy the machine
is: it moves by about 1 % between runs, so a change of a few percent is seen.

``--features``: what each per-request feature costs, measured by its absence. The profile of
a request is flat: no function stands out, and the cost is spread over the features every
request passes through. sfq-proxy runs as it is, then once per feature (harness.FEATURES;
all of them if none is named) with that feature replaced by nothing, then with all of them
replaced at once (what is left: the path every request must take); "saves" is each one's
share of the whole. A feature switched off is broken on purpose (no metrics, no access
line, a usage event left in the stream): it measures, it never serves.

``--tracing``: a row more, sfq-proxy with a ``tracing:`` section (docs/tracing.md) whose
collector is nginx (``POST /v1/traces`` answered 200): what a span per request costs, its
export thread's work included (callgrind counts every thread).

It is not time: a cache miss costs more than an instruction, and the kernel's side of a
system call is not counted. ``overhead.py``'s CPU time stays the figure targets are set
in; this one tells whether a change to the hot path paid.
Requires: apt-get install valgrind nginx-light.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import harness
from harness import Processes, Server, Table

WARM_UP = 100  # requests before the counters are zeroed: imports, first connections, caches
START_S = 600  # a Python process under callgrind runs ~50× slower: imports take a while
# the same dict layouts in every run; callgrind counting, writing no file
UNDER = (
    "env",
    "PYTHONHASHSEED=0",
    "valgrind",
    "--tool=callgrind",
    "--callgrind-out-file=/dev/null",
)
TABLE = Table(
    ("mode", "<7"), ("target", "<20"), ("Minstr/req", ">11.3f"), ("×bare", ">7.2f"),
    ("sfq÷base", ">10.3f"), ("saves", ">8.1%"), ("  what", "<"),
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", nargs="+", default=["json", "stream"], choices=["json", "stream"]
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--baseline", type=harness.checkout, help="a checkout whose sfq-proxy runs too"
    )
    parser.add_argument("--features", nargs="*", metavar="FEATURE",
                        help="sfq-proxy without each of these (default: all), then without "
                        f"all of them: {', '.join(harness.FEATURES)}")  # fmt: skip
    parser.add_argument("--tracing", action="store_true", help="a row with tracing on")
    args = parser.parse_args()
    if args.features is not None:
        if args.baseline is not None:
            parser.error("--features measures this tree's sfq-proxy alone: no --baseline")
        args.features = harness.features(args.features or ["all"])
    harness.need("valgrind", "callgrind_control", "nginx", packages="valgrind nginx-light")
    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp)) as procs:
        backends = harness.nginx(procs, args.modes)
        TABLE.print_header()
        for mode in args.modes:
            if args.features is None:
                _compare(mode, args, backends[mode], procs)
            else:
                _features(mode, args, backends[mode], procs)


def _config(procs: Processes, mode: str, urls: list[str], name: str) -> dict[str, Any]:
    state = procs.work / f"calibration-{mode}-{name}.json"
    return harness.proxy_config({mode: urls}, state_file=state)


def _compare(mode: str, args: argparse.Namespace, urls: list[str], procs: Processes) -> None:
    """One mode's rows: each target measured alone, one after the other."""
    targets: list[Callable[[], Server]] = [
        lambda: harness.passthrough(procs, "bare", urls, under=UNDER),
        lambda: harness.passthrough(procs, "bare-upstream", urls, upstream=True, under=UNDER),
        lambda: harness.sfq_proxy(
            procs, "sfq-proxy", _config(procs, mode, urls, "sfq"), under=UNDER
        ),
    ]
    if args.tracing:  # nginx as the collector; a batch leaves every second
        traced = _config(procs, mode, urls, "traced")
        traced["tracing"] = {"endpoint": f"{urls[0]}/v1/traces", "schedule_delay_s": 1}
        targets.append(lambda: harness.sfq_proxy(procs, "sfq +tracing", traced, under=UNDER))
    if args.baseline is not None:
        base = _config(procs, mode, urls, "base")
        targets.append(
            lambda: harness.sfq_proxy(procs, "sfq (base)", base, src=args.baseline, under=UNDER)
        )
    counts: dict[str, float] = {}
    for start in targets:
        name, count = _per_request(start(), mode, args, procs)
        counts[name] = count
        base_ratio = counts["sfq-proxy"] / count if name == "sfq (base)" else None
        TABLE.print_row(mode, name, count / 1e6, count / counts["bare"], base_ratio)


def _features(mode: str, args: argparse.Namespace, urls: list[str], procs: Processes) -> None:
    """One mode's rows: as it is, without each feature, then without all of them."""
    features = [f for f in args.features if mode == "stream" or f not in harness.STREAM_ONLY]
    rows: list[tuple[str, tuple[str, ...], str]] = [("sfq-proxy", (), "")]
    rows += [(f"sfq −{feature}", (feature,), harness.FEATURES[feature]) for feature in features]
    if len(features) > 1:  # what is left without any of them: the path every request takes
        rows.append(("sfq −all of these", tuple(features), ""))
    whole = 0.0
    for name, off, what in rows:
        config = _config(procs, mode, urls, "sfq")
        proxy = harness.sfq_proxy(procs, name, config, without=off, under=UNDER)
        _, count = _per_request(proxy, mode, args, procs)
        whole = whole or count
        saves = (whole - count) / whole if off else None
        TABLE.print_row(mode, name, count / 1e6, None, None, saves, f"  {what}")


def _per_request(
    server: Server, mode: str, args: argparse.Namespace, procs: Processes
) -> tuple[str, float]:
    """``server``'s name, and the instructions it executes per request after a warm-up; it
    is stopped after."""
    try:
        server.ready(START_S)
        url = server.url + "/v1/chat/completions"
        asyncio.run(_drive(url, f"bench-{mode}", WARM_UP, args.connections))
        _control(server.proc.pid, "--zero")
        asyncio.run(_drive(url, f"bench-{mode}", args.requests, args.connections))
        return server.name, _instructions(server.proc.pid) / args.requests
    finally:
        procs.stop(server.name)


async def _drive(url: str, model: str, requests: int, connections: int) -> None:
    """``requests`` chat requests, ``connections`` at a time; each answer read whole and
    checked, so that what was counted is what was asked for."""
    stream = model.endswith("stream")
    body = harness.chat_body(model)
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
