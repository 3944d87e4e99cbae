"""Gaming the cost estimate (issues 16 and 38): the share of the actual work each trick gets.

    python bench/gaming.py [--proxy-src DIR] [--tricks a b c e1 e2] [--requests 12]
    python bench/gaming.py --issue 38 --baseline DIR [--proxy-src DIR] [--seed 7] [--tricks …]

``--issue 38`` prints one table of issue 38's tricks (tests/support/served_cost.py: a backend that
reports usage as a function of the body, 4 slots), each played against honest chats by the
proxy of ``--baseline`` (before the change: charged on the estimate alone) and of
``--proxy-src`` (this tree: trued up to the usage reported), in memory and as two replicas
on one Redis (a redis-server of its own). A row is the cheater's share of the reported cost
while both were backlogged (fair: 50 %), or, for the budget tricks e and f, the tokens the
backend served the budgeted key ÷ its day's budget of 20,000.

Issue 16 (the default). SFQ is fair on what it charges, an estimate made at admission
(docs/design.md §3, §4). For each trick, one org (the cheater) plays it and another
(honest: plain text, max_tokens set) does not, both of weight 1, through `sfq-proxy serve`
in front of a simulated vLLM that does what a real one does with the trick:

  a   no max_tokens: the server generates up to the context, the proxy charged its default
  b   n=4: four sequences for one request
  c   four 1024 × 1024 PNGs (765 tokens each, by OpenAI's rule) and a short caption
  e1  after 80 varied tiny chats (1-3 messages of 4-32 characters; the template adds 7
      tokens a message), long single-message prompts against a backlog of tiny chats
  e2  the same, after 80 copies of one tiny chat

Each scenario queues both orgs' whole backlog in the proxy before anything is served (the
server is held behind two blocker requests, then released), and measures over the
dispatches made while both orgs still had requests queued. The *actual* cost of a request
is the pool's formula on the usage it was answered with (`prompt_tokens +
completion_tokens`, both weights 1); the fair share is 50 %, and SFQ keeps the *charged*
shares within two requests' worth of it. A trick pays when the cheater's actual share is
well above 50 %.

The proxy runs from DIR (default: this tree) as `python -m sfq_proxy.cli serve --config
FILE`, with PYTHONPATH=DIR and DIR as its working directory, on an ephemeral port, so that
an old checkout (before the fixes) and this one can be measured on the same scenarios. The
config uses only fields every version accepts (listen, models, backends, slots, keys, orgs,
classes, cost.input_weight/output_weight/default_max_tokens): each version runs with its
own defaults. The simulated servers always come from this tree, in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import harness
import openai
import redis as redis_client
import yaml

ROOT = harness.ROOT
# the simulated server and tests/support/images.py from this tree
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

import served_cost  # noqa: E402
from images import png_part  # noqa: E402
from redis_server import queued_in_redis, running_redis  # noqa: E402

from sfq_proxy.sim.server import SimBackend  # noqa: E402
from sfq_proxy.sim.settings import SimConfig  # noqa: E402

MODEL = "sim-llama"
SLOTS = 2
KEYS = {"cheater": "sk-bench-cheater", "honest": "sk-bench-honest", "blocker": "sk-bench-blocker"}
PROMPT = ("Summarise the quarterly report for the board. " * 35)[:1600]  # 400 tokens by chars/4
ASK = [{"role": "user", "content": PROMPT}]
HONEST = {"messages": ASK, "max_tokens": 400}
WARM_UP = 80  # above every version's default min_org_samples (50): calibration has learnt
TIME_SCALE = 500.0
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Trick:
    """One scenario: the server's options, the pool's cost, each org's backlog and body,
    and what the cheater does before the contention (to teach calibration)."""

    name: str
    what: str
    cheater: dict[str, Any]
    honest: dict[str, Any] = field(default_factory=lambda: HONEST)
    backlog: tuple[int, int] = (12, 36)  # cheater's, honest's requests (× --requests / 12)
    sim: dict[str, Any] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)
    warm_up: Callable[[int], list[dict[str, Any]]] | None = None


def varied_chats(count: int) -> list[dict[str, Any]]:
    """1-3 messages of 4-32 characters each, in varying mixes."""
    return [
        {"messages": [{"role": "user", "content": "abcd" * (1 + (i * 3 + k * 5) % 8)}
                      for k in range(1 + i % 3)], "max_tokens": 1}
        for i in range(count)
    ]  # fmt: skip


def same_chat(count: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 1}] * count


TINY = {"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 64}
LONG = {"messages": ASK, "max_tokens": 64}
IMAGES = [{"type": "text", "text": "Describe these."}] + [png_part(1024, 1024)] * 4
TRICKS = {
    t.name: t
    for t in (
        Trick("a", "no max_tokens", {"messages": ASK},
              sim={"max_model_len": 4096, "default_max_tokens": None},
              cost={"default_max_tokens": 300}),
        Trick("b", "n=4", {"messages": ASK, "max_tokens": 400, "n": 4}),
        Trick("c", "4 images", {"messages": [{"role": "user", "content": IMAGES}],
                                "max_tokens": 64}),
        Trick("e1", "tiny chats (varied)", TINY, honest=LONG, backlog=(240, 10),
              sim={"tokens_per_message": 7}, warm_up=varied_chats),
        Trick("e2", "tiny chats (one)", TINY, honest=LONG, backlog=(240, 10),
              sim={"tokens_per_message": 7}, warm_up=same_chat),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Reply:
    org: str
    user: str
    charged: float | None  # X-Cost-Charged, when the proxy sends it
    actual: int  # prompt_tokens + completion_tokens


@dataclass
class Result:
    trick: Trick
    window: list[Reply]
    failures: list[str]

    def share(self, org: str, of: Callable[[Reply], float | None]) -> float | None:
        values = [(r.org, of(r)) for r in self.window]
        if not values or any(v is None for _, v in values):
            return None
        total = sum(v for _, v in values if v is not None)
        return sum(v for o, v in values if o == org and v is not None) / total


# --- the proxy under test, as a subprocess -----------------------------------------------------


def proxy_config(port: int, sim_url: str, cost: dict[str, Any]) -> str:
    """Only fields that every version of the config accepts."""
    return yaml.safe_dump(
        {
            "listen": {"host": "127.0.0.1", "port": port},
            "keys": [{"key": key, "org": org, "classes": ["batch"]} for org, key in KEYS.items()],
            "classes": {"batch": {"weight": 1}},
            "orgs": {org: {"weight": 1} for org in KEYS},
            "pools": {
                "sim": {
                    "models": [MODEL],
                    "backends": [{"url": sim_url, "slots": SLOTS}],
                    "cost": {"input_weight": 1, "output_weight": 1, **cost},
                }
            },
        },
        sort_keys=False,
    )


def imported_from(src: Path) -> str:
    """Where DIR's interpreter set-up really imports sfq_proxy from (a check on PYTHONPATH)."""
    code = "import sfq_proxy, os; print(os.path.dirname(sfq_proxy.__file__))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=harness.cli(src=src).env, cwd=src,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


@contextlib.asynccontextmanager
async def proxy(src: Path, sim_url: str, cost: dict[str, Any], work: Path):  # type: ignore[no-untyped-def]
    """DIR's proxy in front of ``sim_url`` until the block ends; yields its URL."""
    port = harness.free_port()
    log = work / "proxy.log"
    process = start_proxy(src, proxy_config(port, sim_url, cost), work, log)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_proxy(src: Path, config: str, work: Path, log: Path) -> subprocess.Popen[bytes]:
    """``serve`` from ``src`` with ``config``, its output (the access log) into ``log``."""
    path = work / "proxy.yaml"
    path.write_text(config)
    command = harness.proxy_command(path, src)
    with open(log, "wb") as out:
        return subprocess.Popen(
            command.argv, env=command.env, cwd=command.cwd, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, key: str = KEYS["honest"]
) -> None:
    """Until the proxy answers an authenticated ``GET /v1/models`` with 200."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                status = process.returncode
                raise RuntimeError(f"the proxy exited with status {status}:\n{tail(log)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/v1/models", headers=headers) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the proxy did not answer in {READY_TIMEOUT_S} s; see {log}")


async def queued(session: aiohttp.ClientSession, url: str) -> int | None:
    """Requests waiting in the proxy by its ``sfq_queue_length`` gauges; None without them."""
    async with session.get(f"{url}/metrics") as response:
        if response.status != 200:
            return None
        text = await response.text()
    values = re.findall(r"^sfq_queue_length\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return round(sum(float(v) for v in values)) if "# TYPE sfq_queue_length" in text else None


async def until_queued(url: str, count: int) -> None:
    """Until ``count`` requests wait in the proxy (by /metrics), or, for a proxy without the
    gauge, a moment after they were sent: the proxy queues a request as soon as it is read."""
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            found = await queued(session, url)
            if found is None:
                await asyncio.sleep(2.0)
                return
            if found >= count:
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{count} requests never all waited in the proxy")


# --- one scenario ------------------------------------------------------------------------------


class Clients:
    def __init__(self, url: str) -> None:
        self.by_org = {
            org: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
            for org, key in KEYS.items()
        }

    async def ask(self, org: str, user: str, body: dict[str, Any]) -> Reply:
        raw = await self.by_org[org].chat.completions.with_raw_response.create(
            model=MODEL, user=user, **body
        )
        answer = raw.parse()
        assert answer.usage is not None, "no usage in the answer"
        charged = raw.headers.get("X-Cost-Charged")
        return Reply(
            org=org,
            user=user,
            charged=None if charged is None else float(charged),
            actual=answer.usage.prompt_tokens + answer.usage.completion_tokens,
        )

    async def close(self) -> None:
        for client in self.by_org.values():
            await client.close()


async def run_trick(trick: Trick, src: Path, scale: float, work: Path) -> Result:
    sim = SimBackend(SimConfig(models=[MODEL], max_num_seqs=64, time_scale=TIME_SCALE,
                               **trick.sim))  # fmt: skip
    await sim.start()
    try:
        async with proxy(src, sim.url, trick.cost, work) as url:
            clients = Clients(url)
            try:
                return await contend(trick, sim, url, clients, scale)
            finally:
                await clients.close()
    finally:
        await sim.stop()


async def contend(
    trick: Trick, sim: SimBackend, url: str, clients: Clients, scale: float
) -> Result:
    """Warm up, then queue both backlogs behind two held blockers, release, and measure."""
    failures: list[str] = []
    if trick.warm_up is not None:
        warm = [clients.ask("cheater", f"warm-{i}", body)
                for i, body in enumerate(trick.warm_up(WARM_UP))]  # fmt: skip
        failures += outcome(await asyncio.gather(*warm, return_exceptions=True))
    start = len(sim.stats.log)
    sim.hold()
    blockers = [
        asyncio.create_task(clients.ask("blocker", "blocker", {"messages": ASK, "max_tokens": 1}))
        for _ in range(SLOTS)
    ]
    await until(lambda: len(sim.stats.log) == start + SLOTS)
    counts = dict(zip(("cheater", "honest"), trick.backlog, strict=True))
    tasks = [
        asyncio.create_task(clients.ask(org, f"{org}-{i}", body))
        for org, body in (("cheater", trick.cheater), ("honest", trick.honest))
        for i in range(max(1, round(counts[org] * scale)))
    ]
    await until_queued(url, len(tasks))
    sim.release()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failures += outcome(await asyncio.gather(*blockers, return_exceptions=True))
    failures += outcome(results)
    replies = {r.user: r for r in results if isinstance(r, Reply)}
    order = [replies[rec.user] for rec in sim.stats.log[start + SLOTS :] if rec.user in replies]
    return Result(trick, backlogged(order), failures)


def outcome(results: list[Any]) -> list[str]:
    """The failures among ``results``, described."""
    return [f"{type(r).__name__}: {r}"[:200] for r in results if isinstance(r, BaseException)]


async def until(predicate: Callable[[], bool], within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("the blockers never reached the server")
        await asyncio.sleep(0.01)


def backlogged(replies: list[Reply]) -> list[Reply]:
    """The dispatches made while both orgs had requests queued: up to and including the last
    dispatch of the org that ran out first."""
    last = {r.org: i for i, r in enumerate(replies)}
    if len(last) < 2:
        return []
    return replies[: min(last.values()) + 1]


# --- the table ---------------------------------------------------------------------------------


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def row(result: Result) -> str:
    cheater = result.share("cheater", lambda r: r.actual)
    honest = result.share("honest", lambda r: r.actual)
    charged = result.share("cheater", lambda r: r.charged)
    ratio = "—" if cheater is None else f"{cheater / 0.5:.2f}"
    counts = {org: sum(r.org == org for r in result.window) for org in ("cheater", "honest")}
    window = f"{counts['cheater']} + {counts['honest']}"
    trick = f"{result.trick.name:<3} {result.trick.what}"
    shares = f"{pct(cheater):>8} {pct(honest):>8} {ratio:>6} {pct(charged):>8}"
    line = f"{trick:<27} {shares} {window:>9}"
    if result.failures:
        line += f"  ({len(result.failures)} failed, e.g. {result.failures[0]})"
    return line


HEADER = (
    f"{'':<27} {'share of actual cost':>26} {'cheater':>8} {'window':>9}\n"
    f"{'trick':<27} {'cheater':>8} {'honest':>8} {'×fair':>6} {'charged':>8} {'C + H':>9}"
)


async def main_async(args: argparse.Namespace, src: Path) -> None:
    print("$ " + " ".join([Path(sys.executable).name, *sys.argv]))
    command = harness.proxy_command(Path("FILE"), src)
    print(f"proxy: {imported_from(src)}  ({' '.join(command.argv[1:])})")
    print(f"{SLOTS} slots, equal weights; shares of actual cost over the backlogged window")
    print(HEADER)
    with tempfile.TemporaryDirectory(prefix="sfq-gaming-") as tmp:
        for name in args.tricks:
            result = await run_trick(TRICKS[name], src, args.requests / 12, Path(tmp))
            print(row(result), flush=True)
    print("×fair: the cheater's actual share ÷ its fair share (50 %). charged: its share of what")
    print("the proxy charged (X-Cost-Charged; — if not sent). window: requests of each org served")
    print("while both had requests queued (C cheater, H honest)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy-src", default=str(ROOT), type=harness.checkout,
                        help="source tree whose sfq_proxy serves (default: this one)")  # fmt: skip
    parser.add_argument("--issue", type=int, choices=(16, 38), default=16)
    parser.add_argument("--tricks", nargs="+",
                        help="the rows (all by default): issue 16's a b c e1 e2; issue 38's "
                             "names, 'drawn' and 'hidden'")  # fmt: skip
    parser.add_argument("--requests", type=int, default=12,
                        help="the cheater's backlog in tricks a-c (all in proportion)")  # fmt: skip
    parser.add_argument("--baseline", type=harness.checkout,
                        help="issue 38: the checkout from before the change")  # fmt: skip
    parser.add_argument("--seed", type=int, default=7, help="issue 38: the drawn row's case")
    parser.add_argument("--modes", nargs="+", choices=("memory", "redis"),
                        default=["memory", "redis"], help="issue 38")  # fmt: skip
    args = parser.parse_args()
    if args.issue == 38:
        if args.baseline is None:
            parser.error("--issue 38 needs --baseline DIR, a checkout from before the change")
        asyncio.run(
            served_table(args, Path(args.baseline).resolve(), Path(args.proxy_src).resolve())
        )
        return
    args.tricks = args.tricks or list(TRICKS)
    asyncio.run(main_async(args, Path(args.proxy_src).resolve()))


# --- issue 38: charged what was served ---------------------------------------------------------

BUDGET = served_cost.BUDGET


@dataclass(frozen=True)
class Row:
    """A line of the issue-38 table: a trick of tests/support/served_cost.py, or the drawn one, or
    a budget hole (``budget``: org A's day budget, and its in-flight cap)."""

    name: str
    what: str
    usage: served_cost.Usage = served_cost.vllm_like
    trick: served_cost.Trick | None = None
    cheats: tuple[served_cost.Ask, ...] = ()
    budget: dict[str, Any] | None = None


class Seeded:
    """served_cost's Chooser over a seeded random.Random."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def number(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)


def drawn(seed: int) -> Row:
    """The generic test's case from ``seed``: a usage function and one to three shapes, drawn
    again until both backlogs hold a run's worth of work (as the test assumes)."""
    choose = Seeded(seed)
    while True:
        usage = served_cost.drawn_usage(choose)
        cheats = tuple(served_cost.drawn_shape(choose) for _ in range(choose.integer(1, 3)))
        backlogs = [
            served_cost.backlog(served_cost.cycle(cheats), usage, WORK, served_cost.MOST),
            served_cost.backlog(served_cost.honest_chats(), usage, WORK, served_cost.MOST),
        ]
        if all(served_cost.work(usage, asks) >= WORK for asks in backlogs):
            return Row("drawn", f"drawn usage and shapes, seed {seed}", usage, cheats=cheats)


WORK = served_cost.WORK


def rows(seed: int) -> list[Row]:
    tricks = [Row(t.name, t.what, trick=t) for t in served_cost.TRICKS.values()]
    return [
        drawn(seed),
        Row("hidden", "16,000 chars in `documents`", served_cost.PLAIN_USAGE,
            cheats=(served_cost.HIDDEN,)),
        *tricks,
        Row("e", 'stream, include_usage "false"', cheats=(served_cost.USAGE_OFF,), budget={}),
        Row("f", "100 at once, max_in_flight 1", cheats=(served_cost.AT_ONCE,),
            budget={"max_in_flight": 1}),
    ]  # fmt: skip


def served_config(port: int, url: str, redis: str | None, budget: dict[str, Any] | None) -> str:
    """Fields every version accepts; A's key has a day's BUDGET in the budget rows."""
    spent = {"budgets": [{"period": "day", "tokens": BUDGET}]} if budget is not None else {}
    keys = {"A": spent, "B": {}, "C": {}}
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "keys": [
            {"key": f"sk-bench-{org}", "org": org, "classes": ["batch"], **more}
            for org, more in keys.items()
        ],
        "classes": {"batch": {"weight": 1}},
        "orgs": {"A": {"weight": 1, **(budget or {})}, "B": {"weight": 1}, "C": {"weight": 1}},
        "pools": {
            "sim": {
                "models": [served_cost.MODEL],
                "backends": [{"url": url, "slots": served_cost.SLOTS}],
                "cost": {"input_weight": 1, "output_weight": 1},
            }
        },
    }
    if redis is not None:
        config["state"] = {"redis": redis, "lease_ttl_s": 30}
    return yaml.safe_dump(config, sort_keys=False)


@contextlib.asynccontextmanager
async def replicas(  # type: ignore[no-untyped-def]
    src: Path, url: str, redis: str | None, budget: dict[str, Any] | None, work: Path
):
    """``src``'s proxy in front of ``url``: one in memory, or two replicas on ``redis``;
    yields their URLs."""
    started: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for i in range(1 if redis is None else 2):
            port = harness.free_port()
            log = work / f"proxy-{i}.log"
            (work / f"proxy-{i}").mkdir(exist_ok=True)
            config = served_config(port, url, redis, budget)
            started.append(start_proxy(src, config, work / f"proxy-{i}", log))
            urls.append(f"http://127.0.0.1:{port}")
            await wait_ready(urls[-1], started[-1], log, key="sk-bench-B")
        yield urls
    finally:
        for process in started:
            process.terminate()
        for process in started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def measure(row: Row, src: Path, redis: str | None, work: Path) -> str:
    """One cell: the cheater's share in %, or the budgeted key's tokens ÷ its budget."""
    double = served_cost.UsageDouble(row.usage)
    async with double.running() as url, replicas(src, url, redis, row.budget, work) as urls:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def waiting() -> int:
                if redis is not None:
                    return await queued_in_redis(redis)
                return await queued(session, urls[0]) or 0

            keys = {org: f"sk-bench-{org}" for org in "ABC"}
            proxies = served_cost.Proxies(urls, keys, waiting, session)
            if row.budget is not None:
                return await spend(row, double, proxies)
            if row.trick is not None:
                contest = await served_cost.play(row.trick, double, proxies)
            else:
                backlogs = {
                    "A": served_cost.backlog(served_cost.cycle(row.cheats), row.usage, WORK,
                                             served_cost.MOST),
                    "B": served_cost.backlog(served_cost.honest_chats(), row.usage, WORK,
                                             served_cost.MOST),
                }  # fmt: skip
                contest = await served_cost.contend(double, proxies, backlogs)
            return f"{contest.share('A'):.1%}"


async def spend(row: Row, double: served_cost.UsageDouble, proxies: served_cost.Proxies) -> str:
    """e: the trick's streams one at a time until one is refused (40 at most); f: 100 at
    once. The tokens the backend served A ÷ A's budget."""
    (ask,) = row.cheats
    urls = proxies.urls
    if row.name == "e":
        statuses: list[int] = []
        while len(statuses) < 40 and set(statuses) <= {200}:
            url = urls[len(statuses) % len(urls)]
            statuses.append(await proxies.send(url, "A", f"A-{len(statuses)}", ask))
    else:
        statuses = await asyncio.gather(
            *(proxies.send(urls[i % len(urls)], "A", f"A-{i}", ask) for i in range(100))
        )
    never = "+" if set(statuses) == {200} else " "  # never refused: at least that
    return f"{double.reported('A') / BUDGET:.2f}×{never}budget"


async def served_table(args: argparse.Namespace, baseline: Path, src: Path) -> None:
    print("$ " + " ".join([Path(sys.executable).name, *sys.argv]))
    trees = {"before": baseline, "after": src}
    for name, where in trees.items():
        print(f"{name}: {imported_from(where)}")
    print(f"{served_cost.SLOTS} slots, equal weights; the cheater's share of the reported cost "
          "while both were backlogged (fair: 50 %)")  # fmt: skip
    columns = [(t, m) for t in trees for m in args.modes]
    head = "".join(f"{t + ' ' + m:>16}" for t, m in columns)
    print(f"{'trick':<45}{head}", flush=True)
    notes = ("e, f: the tokens served to the budgeted key ÷ its day budget (20,000); "
             "'+': never refused (40 streams, 100 requests sent)")  # fmt: skip
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        redis = stack.enter_context(running_redis()).url if "redis" in args.modes else None
        for row in rows(args.seed):
            if args.tricks and row.name not in args.tricks:
                continue
            cells = []
            for tree, mode in columns:
                shared = redis if mode == "redis" else None
                if shared is not None:
                    with redis_client.Redis.from_url(shared) as client:
                        client.flushall()
                try:
                    cell = await measure(row, trees[tree], shared, Path(tmp))
                except Exception as err:  # a version that cannot play it: say so, go on
                    cell = f"{type(err).__name__}"[:15]
                cells.append(f"{cell:>16}")
            print(f"{row.name + '  ' + row.what:<45}{''.join(cells)}", flush=True)
    print(notes)


if __name__ == "__main__":
    main()
