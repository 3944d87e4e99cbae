"""Gaming the cost estimate, through the real proxy (issue 16).

SFQ is fair on the cost it *charges* (docs/design.md §3), and the charge is an estimate made
at admission (§4). A tenant who can make its requests cost more than they are charged gets
more than its share of the work actually done. Each test here plays one such trick with the
official ``openai`` SDK, through the real proxy, in front of a simulated vLLM that does what
a real one does with it (generates up to the context when no ``max_tokens`` is set, ``n``
sequences, prices images), and checks that it no longer pays.

How a share is measured: one pool with two slots and two orgs of equal weight, A (who tries
the trick) and B (plain text, ``max_tokens`` set). The simulated server is held while both
queue their whole backlog behind two blocker requests of a third org, then released, so
every request waits in the proxy before the first is dispatched and the order is the
scheduler's alone. The *actual* cost of a request is the pool's formula on the usage it was
answered with (``input_weight·prompt_tokens + output_weight·completion_tokens``); shares are
taken over the dispatches made while both orgs still had requests queued (up to the last
dispatch of the org that ran out first), in the order the server received them.

Why the tolerance: over any such interval SFQ guarantees, for the *charged* costs W of two
flows of weight 1, ``|W_A − W_B| ≤ c_A,max + c_B,max`` (§3). If actual costs equalled the
charges, A's share of the actual cost X would then be at most ``1/2 + (c_A,max +
c_B,max) / (2·(X_A + X_B))``. Estimates are not exact (the proxy counts characters, not the
template's tokens; the sim rounds each message up), so each org's actual cost may differ
from its charge by a relative error ε, which moves the share by at most about ε/2. The
tests allow ε = 10 %: a trick that pays makes A's actual cost several times its charge,
far beyond it. c_max is read from what the proxy says it charged (``X-Cost-Charged``), never
from the actual costs, so a trick that still pays cannot widen its own tolerance.

The last trick of the issue, a priority band that could take every slot (``priority: true``
without a cap, or capped at a pool's slots), is refused when the config is read: see
tests/config/test_config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from images import png_part
from proxy_lab import KEYS, MODEL, Lab, Served, eventually, proxy_config
from redis_server import queued_in_redis
from served_cost import (
    AT_ONCE,
    BUDGET,
    HIDDEN,
    LONG_STREAM,
    MOST,
    PLAIN_USAGE,
    SHARE_LIMIT,
    TRICKS,
    USAGE_OFF,
    WORK,
    Ask,
    Contest,
    Drawn,
    Proxies,
    Trick,
    Usage,
    UsageDouble,
    backlog,
    cycle,
    drawn_shape,
    drawn_usage,
    honest_chats,
    play,
    reported,
    vllm_like,
    work,
)
from served_cost import SLOTS as SERVED_SLOTS
from served_cost import contend as contend_served
from wall import DEC_1, Wall

from sfq_proxy.config import Config
from sfq_proxy.sim.server import SimBackend

SLOTS = 2  # few, so that both orgs stay backlogged
CLASSES = {  # equal weights; a small capped band, as the config requires (§3)
    "system": {"priority": True, "max_in_flight": 1, "max_queue_age_s": 30, "max_queue_len": 10},
    "interactive": {"weight": 1},
    "batch": {"weight": 1},
}
# 1,600 characters: 400 tokens by the proxy's chars/4, 404 by the sim's (template: 4)
PROMPT = ("Summarise the quarterly report for the board. " * 35)[:1600]
ASK = [{"role": "user", "content": PROMPT}]
HONEST = {"messages": ASK, "max_tokens": 400}
ERROR = 0.10  # the estimate's relative error allowed for, on each org's actual cost
SIM = {"max_num_seqs": 64, "time_scale": 500.0}  # the proxy's slots bind, never the sim's


@dataclass(frozen=True)
class Reply:
    """One answered request: who sent it, what it was charged, what it really cost."""

    org: str
    user: str
    charged: float
    prompt_tokens: int
    completion_tokens: int
    choices: int

    @property
    def actual(self) -> float:
        return self.prompt_tokens + self.completion_tokens  # input and output weights 1


async def ask(lab: Lab, served: Served, org: str, user: str, **body: Any) -> Reply:
    """One chat request with the SDK; what the proxy charged comes from ``X-Cost-Charged``."""
    raw = await lab.client(served, org).chat.completions.with_raw_response.create(
        model=MODEL, user=user, **body
    )
    answer = raw.parse()
    assert answer.usage is not None
    return Reply(
        org=org,
        user=user,
        charged=float(raw.headers["X-Cost-Charged"]),
        prompt_tokens=answer.usage.prompt_tokens,
        completion_tokens=answer.usage.completion_tokens,
        choices=len(answer.choices),
    )


async def contend(
    lab: Lab, served: Served, sim: SimBackend, backlog: dict[str, tuple[int, dict[str, Any]]]
) -> list[Reply]:
    """Queue every org's ``(count, body)`` backlog in the proxy before anything is served,
    then serve it all; returns the replies in dispatch order (the server's arrival order).

    The server is held while two blockers of org C take the pool's slots and the backlog
    queues behind them; releasing it frees the slots with every request already waiting.
    """
    sim.hold()
    blockers = [
        asyncio.create_task(ask(lab, served, "C", "blocker", messages=ASK, max_tokens=1))
        for _ in range(SLOTS)
    ]
    await eventually(lambda: len(sim.stats.log) == SLOTS)
    tasks = [
        asyncio.create_task(ask(lab, served, org, f"{org}-{i}", **body))
        for org, (count, body) in backlog.items()
        for i in range(count)
    ]
    await eventually(lambda: len(served.queue()) == len(tasks), within=10)
    sim.release()
    replies = {r.user: r for r in await asyncio.gather(*tasks)}
    await asyncio.gather(*blockers)
    return [replies[rec.user] for rec in sim.stats.log[SLOTS:] if rec.user in replies]


def backlogged(replies: list[Reply]) -> list[Reply]:
    """The replies dispatched while every org still had requests queued: up to and including
    the last dispatch of the org that ran out first (all were queued before the first)."""
    last = {r.org: i for i, r in enumerate(replies)}
    return replies[: min(last.values()) + 1]


def assert_no_more_than_its_share(replies: list[Reply], cheater: str = "A") -> None:
    """The cheater's share of the actual cost while both were backlogged is within the SFQ
    bound of its weighted share (1/2), plus the estimate's error (module docstring)."""
    window = backlogged(replies)
    orgs = {r.org for r in replies}
    assert len(orgs) == 2, orgs
    actual = {org: sum(r.actual for r in window if r.org == org) for org in orgs}
    total = sum(actual.values())
    c_max = sum(max(r.charged for r in window if r.org == org) for org in orgs)
    share = actual[cheater] / total
    limit = 1 / 2 + c_max / (2 * total) + ERROR / 2
    counts = {org: sum(r.org == org for r in window) for org in orgs}
    assert share <= limit, (
        f"{cheater} got {share:.1%} of the actual cost (limit {limit:.1%}) over "
        f"{len(window)} dispatches {counts}, actual {actual}"
    )


def gaming_config(sim: SimBackend, *, cost: dict[str, Any] | None = None, **more: Any) -> Config:
    """One pool of SLOTS slots in front of ``sim``; equal weights; ``cost`` for the pool."""
    pool = {"cost": cost} if cost else None
    return proxy_config([sim.url], slots=SLOTS, classes=CLASSES, pool=pool, **more)


def asked_by(sim: SimBackend, org: str) -> list[dict[str, Any]]:
    """The output fields of ``org``'s requests as the server received them."""
    return [rec.asked for rec in sim.stats.log if (rec.user or "").startswith(f"{org}-")]


# --- a. leaving max_tokens out ----------------------------------------------------------------


async def test_omitting_max_tokens_does_not_buy_the_context(lab: Lab) -> None:
    """Without max_tokens, vLLM generates up to the context (here ~3,700 tokens), while the
    proxy charged the pool's default_max_tokens (300). The proxy now writes what it charged
    into the upstream body, so the backend generates no more than that."""
    sim = await lab.backend(**SIM, max_model_len=4096, default_max_tokens=None)
    served = await lab.proxy(gaming_config(sim, cost={"default_max_tokens": 300}))
    replies = await contend(lab, served, sim, {"A": (12, {"messages": ASK}), "B": (36, HONEST)})
    assert asked_by(sim, "A") == [{"max_tokens": 300}] * 12
    assert asked_by(sim, "B") == [{"max_tokens": 400}] * 36  # a client's own is left alone
    assert_no_more_than_its_share(replies)


@pytest.mark.parametrize(
    ("inject", "stream", "added"),
    [
        (None, False, {"max_tokens": 300}),  # the default: max_tokens
        ("max_tokens", True, {"max_tokens": 300, "stream_options": {"include_usage": True}}),
        ("max_completion_tokens", False, {"max_completion_tokens": 300}),
        (False, False, {}),
    ],
)
async def test_the_upstream_body_carries_what_was_charged(
    lab: Lab, inject: str | bool | None, stream: bool, added: dict[str, Any]
) -> None:
    """``cost.inject_max_tokens`` names the field written into a body that set neither;
    with ``false`` the body reaches the backend byte for byte as the client sent it. A raw
    client and a recording backend, to compare bytes: the SDK re-serialises both ends."""
    received: list[bytes] = []
    url = await recording_backend(lab, received)
    cost: dict[str, Any] = {"default_max_tokens": 300}
    if inject is not None:
        cost["inject_max_tokens"] = inject
    served = await lab.proxy(proxy_config([url], pool={"cost": cost}, classes=CLASSES))
    sent = {"model": MODEL, "messages": ASK, "stream": stream, "user": "A-0"}
    raw = json.dumps(sent).encode()
    session = await lab.http()
    headers = {"Authorization": f"Bearer {KEYS['A']}", "Content-Type": "application/json"}
    async with session.post(f"{served.url}/v1/chat/completions", data=raw, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
    (upstream,) = received
    assert json.loads(upstream) == {**sent, **added}
    if not added:
        assert upstream == raw


async def recording_backend(lab: Lab, received: list[bytes]) -> str:
    """A backend that keeps every body it is sent and answers with a minimal completion."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        received.append(body)
        usage = {"prompt_tokens": 404, "completion_tokens": 1, "total_tokens": 405}
        if json.loads(body).get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
            return response
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return web.json_response(
            {"id": "c", "object": "chat.completion", "model": MODEL, "created": 0,
             "choices": [choice], "usage": usage}
        )  # fmt: skip

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return f"http://127.0.0.1:{await lab.serve(app)}"


# --- b. n choices -----------------------------------------------------------------------------


async def test_asking_for_n_choices_pays_for_n(lab: Lab) -> None:
    """n=4 generates four sequences for one request; it is charged four outputs."""
    sim = await lab.backend(**SIM)
    served = await lab.proxy(gaming_config(sim))
    cheat = {"messages": ASK, "max_tokens": 400, "n": 4}
    replies = await contend(lab, served, sim, {"A": (12, cheat), "B": (36, HONEST)})
    assert {r.choices for r in replies if r.org == "A"} == {4}
    assert {rec.sequences for rec in sim.stats.log if (rec.user or "").startswith("A-")} == {4}
    assert_no_more_than_its_share(replies)


# --- c. images --------------------------------------------------------------------------------


async def test_images_are_not_free(lab: Lab) -> None:
    """Four 1024 × 1024 PNGs and a short caption: 4 × 765 input tokens by OpenAI's rule,
    which the server counts, and which a text-only estimate priced at nothing."""
    sim = await lab.backend(**SIM)
    served = await lab.proxy(gaming_config(sim))
    content = [{"type": "text", "text": "Describe these."}] + [png_part(1024, 1024)] * 4
    cheat = {"messages": [{"role": "user", "content": content}], "max_tokens": 64}
    replies = await contend(lab, served, sim, {"A": (12, cheat), "B": (36, HONEST)})
    assert {r.prompt_tokens for r in replies if r.org == "A"} == {4 + 4 + 4 * 765}
    assert_no_more_than_its_share(replies)


# --- d. a huge max_tokens ---------------------------------------------------------------------

CEILING = {"max_request_tokens": 8192}


async def test_a_huge_max_tokens_is_refused_naming_the_ceiling(lab: Lab) -> None:
    """max_tokens 1,000,000 against a ceiling of 8,192 tokens per request is a 400 that
    names the ceiling, before it is queued; the other org is served as if it were not there."""
    sim = await lab.backend(**SIM, max_model_len=16384)
    served = await lab.proxy(gaming_config(sim, cost=CEILING))
    huge = [ask(lab, served, "A", f"A-{i}", messages=ASK, max_tokens=1_000_000) for i in range(4)]
    honest = [ask(lab, served, "B", f"B-{i}", **HONEST) for i in range(8)]
    results = await asyncio.gather(*huge, *honest, return_exceptions=True)
    refused, served_b = results[:4], results[4:]
    for error in refused:
        assert isinstance(error, openai.BadRequestError), error
        assert error.body["code"] == "tokens_exceed_limit"
        assert "8192" in error.body["message"]
    assert all(isinstance(r, Reply) for r in served_b), served_b
    assert asked_by(sim, "A") == []  # never sent upstream
    assert len(asked_by(sim, "B")) == 8


@pytest.mark.parametrize("n", [1, 2])
async def test_with_clamp_a_huge_max_tokens_is_lowered_to_the_ceiling(lab: Lab, n: int) -> None:
    """``over_limit: clamp`` serves it with max_tokens lowered so that input + n outputs fit
    the ceiling: floor((8192 − 400 input tokens) / n), and charges that."""
    sim = await lab.backend(**SIM, max_model_len=16384)
    served = await lab.proxy(gaming_config(sim, cost={**CEILING, "over_limit": "clamp"}))
    reply = await ask(lab, served, "A", "A-0", messages=ASK, max_tokens=1_000_000, n=n)
    clamped = (8192 - 400) // n
    assert asked_by(sim, "A") == [{"max_tokens": clamped, "n": n}]
    assert reply.completion_tokens == clamped * n
    assert reply.charged <= 8192


async def test_a_class_ceiling_below_the_pools_applies(lab: Lab) -> None:
    """The smaller of the pool's and the class's max_request_tokens applies."""
    sim = await lab.backend(**SIM, max_model_len=16384)
    classes = {
        **CLASSES,
        "batch": {"weight": 1, "max_request_tokens": 2048},
        "interactive": {"weight": 1, "max_request_tokens": 100_000},
    }
    config = proxy_config([sim.url], slots=SLOTS, classes=classes, pool={"cost": CEILING})
    served = await lab.proxy(config)
    interactive = {"X-Workload-Class": "interactive"}
    with pytest.raises(openai.BadRequestError) as batch:
        await ask(lab, served, "A", "A-0", messages=ASK, max_tokens=4000)
    await ask(lab, served, "A", "A-1", messages=ASK, max_tokens=4000, extra_headers=interactive)
    with pytest.raises(openai.BadRequestError) as pool:
        await ask(lab, served, "A", "A-2", messages=ASK, max_tokens=10_000,
                  extra_headers=interactive)  # fmt: skip
    assert batch.value.body["code"] == pool.value.body["code"] == "tokens_exceed_limit"
    assert "2048" in batch.value.body["message"]
    assert "8192" in pool.value.body["message"]
    assert asked_by(sim, "A") == [{"max_tokens": 4000}]


# --- e. many tiny chats -----------------------------------------------------------------------


def varied_chats(count: int) -> list[list[dict[str, str]]]:
    """Short chats of 1-3 messages of 4-32 characters, in varying mixes: much template, little
    text. Lengths are multiples of 4, so the server's per-message rounding adds nothing."""
    return [
        [{"role": "user", "content": "abcd" * (1 + (i * 3 + k * 5) % 8)} for k in range(1 + i % 3)]
        for i in range(count)
    ]


def same_chat(count: int) -> list[list[dict[str, str]]]:
    """The same one-message chat of 4 characters, again and again: the cheapest way to
    flood the pool's calibration with template tokens (8 tokens for 4 characters)."""
    return [[{"role": "user", "content": "abcd"}]] * count


@pytest.mark.parametrize("chats", [varied_chats, same_chat])
async def test_many_tiny_chats_do_not_make_long_prompts_expensive(
    lab: Lab, chats: Callable[[int], list[list[dict[str, str]]]]
) -> None:
    """A's many tiny chats are mostly chat template (7 tokens a message here). Learnt as
    one chars-per-token ratio, they would teach the pool that text is about one token a
    character, and B's long single-message prompts would then be charged several times
    their tokens. B's charges must stay within 10 % of what its requests really cost.

    With identical chats, the messages and the characters of the pool's traffic are
    proportional, so no fit can tell the template from the text: the proxy must then not
    conclude that text costs a token a character either."""
    sim = await lab.backend(**SIM, tokens_per_message=7)
    config = gaming_config(sim, calibration={"min_org_samples": 20})
    served = await lab.proxy(config)
    await asyncio.gather(
        *(ask(lab, served, "A", f"A-{i}", messages=chat, max_tokens=1)
          for i, chat in enumerate(chats(60)))
    )  # fmt: skip
    long_prompt = [{"role": "user", "content": PROMPT * 2}]  # 3,200 characters
    replies = await asyncio.gather(
        *(ask(lab, served, "B", f"B-{i}", messages=long_prompt, max_tokens=1) for i in range(4))
    )
    for reply in replies:
        assert reply.prompt_tokens == 7 + 800
        assert abs(reply.charged - reply.actual) <= 0.1 * reply.actual, reply


# --- issue 38: charging what was served ---------------------------------------------------------
#
# Since issue 38 a request's charge is trued up when it ends to the cost the backend reports.
# So the estimate orders dispatch, but no request shape can buy more than its share of the
# work the backend says it did: whatever the backend's usage is as a function of the body
# (tests/support/served_cost.py's UsageDouble), a cheater's share of the reported cost over a long
# backlogged run is at most SHARE_LIMIT (55 %) against an honest tenant of equal weight. The
# run is long (each tenant's backlog about WORK tokens, some 30 requests of a context's worth)
# so that what is in flight, dispatched on an estimate and not yet trued up, is within the
# 5 % margin. Before the change (3d85e6e, charged on the estimate alone) the cheater took
# 87-99 % with each of these tricks (bench/gaming.py --issue 38). The shares run without
# timing: the backlogs are queued behind blockers before the first dispatch (``contend``).


class _Draws:
    """served_cost's Chooser over a hypothesis draw."""

    def __init__(self, draw: st.DrawFn) -> None:
        self._draw = draw

    def integer(self, low: int, high: int) -> int:
        return self._draw(st.integers(low, high))

    def number(self, low: float, high: float) -> float:
        return self._draw(st.floats(low, high))


@st.composite
def usages(draw: st.DrawFn) -> Drawn:
    return drawn_usage(_Draws(draw))


@st.composite
def shapes(draw: st.DrawFn) -> Ask:
    return drawn_shape(_Draws(draw))


SERVED = settings(
    max_examples=8,  # some 20 s: each example is several hundred requests
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session that sends a whole backlog at once (aiohttp's default: 100)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        yield client


async def served_by(
    lab: Lab,
    double: UsageDouble,
    session: aiohttp.ClientSession,
    redis_url: str | None = None,
    **more: Any,
) -> Proxies:
    """The proxy in front of ``double`` (4 slots, equal weights): one in memory, or two
    replicas on ``redis_url``."""
    url = f"http://127.0.0.1:{await lab.serve(double.app())}"
    if redis_url is not None:
        more["state"] = {"redis": redis_url, "lease_ttl_s": 30}
    config = proxy_config([url], slots=SERVED_SLOTS, classes=CLASSES, **more)
    replicas = [await lab.proxy(config) for _ in range(1 if redis_url is None else 2)]

    async def queued() -> int:
        if redis_url is None:
            return len(replicas[0].queue())
        return await queued_in_redis(redis_url)

    keys = {org: KEYS[org] for org in "ABC"}
    return Proxies([r.url for r in replicas], keys, queued, session)


async def assert_served_fairly(
    lab: Lab,
    session: aiohttp.ClientSession,
    trick: Trick,
    usage: Usage = vllm_like,
    redis_url: str | None = None,
) -> Contest:
    double = UsageDouble(usage)
    contest = await play(trick, double, await served_by(lab, double, session, redis_url))
    print(contest.describe())  # with -s: the margin left
    assert set(contest.statuses["A"]) == set(contest.statuses["B"]) == {200}, contest.describe()
    share = contest.share("A")
    assert share <= SHARE_LIMIT, contest.describe()
    return contest


@SERVED
@example(usage=PLAIN_USAGE, cheats=[HIDDEN])
@given(usage=usages(), cheats=st.lists(shapes(), min_size=1, max_size=3))
async def test_no_request_shape_buys_more_than_its_share_of_the_reported_work(
    usage: Drawn, cheats: list[Ask]
) -> None:
    """Whatever the backend's usage is as a function of the body (drawn: tokens per byte,
    per message, per prompt of a batch, per character of a field the proxy does not read,
    and a share of the output asked for), and whatever shapes the cheater sends (drawn:
    chats of 1-800 messages, text in refusal or thinking parts, hidden documents,
    completion batches, n, max_tokens or none), its share of the work the backend reported
    stays within 55 % against honest chats. The example is the hidden field: 16,000
    characters of ``documents`` the proxy never counts."""
    async with contextlib.AsyncExitStack() as stack:
        double = UsageDouble(usage)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        stack.push_async_callback(session.close)
        backlogs = {
            "A": backlog(cycle(cheats), usage, WORK, MOST),
            "B": backlog(honest_chats(), usage, WORK, MOST),
        }
        # a run long in work against what is in flight, or no share means anything: a
        # cheater whose requests do next to nothing gets next to nothing anyway
        assume(all(work(usage, asks) >= WORK for asks in backlogs.values()))
        proxies = await served_by(Lab(stack), double, session)
        contest = await contend_served(double, proxies, backlogs)
        print(contest.describe())
        assert set(contest.statuses["B"]) == {200}, contest.describe()
        share = contest.share("A")
        assert share <= SHARE_LIMIT, contest.describe()


async def test_a_batch_of_prompts_with_n_pays_for_every_sequence(
    lab: Lab, session: aiohttp.ClientSession
) -> None:
    """a. /v1/completions with 50 prompts and n=4 generates 200 sequences, not 4."""
    await assert_served_fairly(lab, session, TRICKS["a"])


@pytest.mark.parametrize("part", ["b1", "b2"], ids=["refusal", "thinking"])
async def test_text_in_a_refusal_or_thinking_part_is_paid_for(
    lab: Lab, session: aiohttp.ClientSession, part: str
) -> None:
    """b. 8,000 characters in a ``refusal`` or ``thinking`` part, which the template renders
    (2,000 tokens) and the estimate did not read."""
    await assert_served_fairly(lab, session, TRICKS[part])


async def test_empty_messages_pay_for_their_template(
    lab: Lab, session: aiohttp.ClientSession
) -> None:
    """c. 800 messages with ``content: ""``: the backend reports 4 tokens for each."""
    await assert_served_fairly(lab, session, TRICKS["c"])


async def test_idle_junk_does_not_make_full_answers_cheap(
    lab: Lab, session: aiohttp.ClientSession
) -> None:
    """d. 300 requests with max_tokens 120,000 that stop at once, sent while the pool is
    idle, teach the org (and the pool) an output ratio near 0; then full-length requests
    of max_tokens 2,000."""
    await assert_served_fairly(lab, session, TRICKS["d"])


@pytest.mark.redis
@pytest.mark.parametrize("name", ["a", "d", "g"])
async def test_two_replicas_on_redis_charge_what_was_served(
    lab: Lab, session: aiohttp.ClientSession, redis_url: str, name: str
) -> None:
    """The same through two replicas sharing the pool in Redis (the true-up is in
    dispatch.lua), the requests of each tenant alternating between them."""
    await assert_served_fairly(lab, session, TRICKS[name], redis_url=redis_url)


@pytest.mark.redis
async def test_two_replicas_on_redis_and_a_hidden_field(
    lab: Lab, session: aiohttp.ClientSession, redis_url: str
) -> None:
    """The generic test's example (a field the proxy does not read) through two replicas."""
    await assert_served_fairly(
        lab, session, Trick("hidden", "documents", HIDDEN), PLAIN_USAGE, redis_url=redis_url
    )


async def test_an_org_whose_answers_are_short_is_not_held_back(
    lab: Lab, session: aiohttp.ClientSession
) -> None:
    """g. Found while writing the generic test: an honest org that asks for max_tokens 4,000
    and is answered in one token (a classifier) is charged far more than it is served until
    its requests end; the true-up then refunds it, but a refund stops at the virtual time
    (a meter below it gets none), so what the other org was dispatched meanwhile is never
    given back. Against full-length answers of max_tokens 2,000 it got a fifth of the work
    reported."""
    await assert_served_fairly(lab, session, TRICKS["g"])


# --- issue 38: the budgets' holes -------------------------------------------------------------


def budgeted_keys(**org_a: Any) -> dict[str, Any]:
    """The config's keys (A with a day's BUDGET) and orgs (A's ``org_a``)."""
    budgets = [{"period": "day", "tokens": BUDGET}]
    return {
        "keys": [
            {"key": KEYS["A"], "org": "A", "classes": ["batch"], "budgets": budgets},
            {"key": KEYS["B"], "org": "B", "classes": ["batch"]},
            {"key": KEYS["C"], "org": "C", "classes": ["interactive"]},
        ],
        "orgs": {"A": org_a} if org_a else {},
    }


async def budgeted(
    lab: Lab, session: aiohttp.ClientSession, **org_a: Any
) -> tuple[UsageDouble, Proxies]:
    """The proxy in front of a vLLM-like double, at 01:00 UTC (a day's budget holds)."""
    double = UsageDouble(vllm_like)
    url = f"http://127.0.0.1:{await lab.serve(double.app())}"
    config = proxy_config([url], slots=SERVED_SLOTS, classes=CLASSES, **budgeted_keys(**org_a))
    served = await lab.proxy(config, wall=Wall(DEC_1 + 3600))

    async def queued() -> int:
        return len(served.queue())

    return double, Proxies([served.url], {org: KEYS[org] for org in "ABC"}, queued, session)


async def streams_until_refused(proxies: Proxies, ask: Ask, most: int = 40) -> list[int]:
    """``ask`` (a stream) sent by A one at a time until one is not a 200; the statuses."""
    statuses: list[int] = []
    while len(statuses) < most and set(statuses) <= {200}:
        statuses.append(await proxies.send(proxies.urls[0], "A", f"A-{len(statuses)}", ask))
    return statuses


async def test_a_stream_cannot_turn_its_usage_off_with_a_string(
    lab: Lab, session: aiohttp.ClientSession
) -> None:
    """e. ``"stream_options": {"include_usage": "false"}``: a truthy string to the proxy
    (it did not ask for usage), false to the server (pydantic reads it so), and a stream
    without a usage chunk was billed its token events only: 16 tokens for 4,020 served, so
    a 20,000-token budget let all 40 streams through (8 times itself). It is a 400 now,
    and nothing reaches the backend."""
    double, proxies = await budgeted(lab, session)
    statuses = await streams_until_refused(proxies, USAGE_OFF)
    let_through = double.reported("A")
    assert let_through <= BUDGET + reported(vllm_like, USAGE_OFF), (let_through, statuses)
    assert statuses == [400], statuses


async def test_a_streams_usage_is_billed_in_full_against_a_budget(
    lab: Lab, session: aiohttp.ClientSession
) -> None:
    """e. The same streams without the trick (the proxy asks for the usage chunk and strips
    it): billed their 4,020 tokens each, so the budget stops them once spent; what was let
    through is the budget and at most the one request that started under it."""
    double, proxies = await budgeted(lab, session)
    statuses = await streams_until_refused(proxies, LONG_STREAM)
    let_through = double.reported("A")
    assert statuses[-1] == 429, statuses
    assert BUDGET <= let_through <= BUDGET + reported(vllm_like, LONG_STREAM), (
        let_through,
        statuses,
    )


async def test_a_budget_holds_against_a_hundred_requests_at_once(
    lab: Lab, session: aiohttp.ClientSession
) -> None:
    """f. A key with a 20,000-token day budget, its org capped at one request in flight,
    sends 100 requests at once: all were admitted (the budget was unused) and then served
    one after another, 4x the budget. Now the tokens served exceed the budget by at most
    what was running when it was reached: one request's worth."""
    double, proxies = await budgeted(lab, session, max_in_flight=1)
    statuses = await asyncio.gather(
        *(proxies.send(proxies.urls[0], "A", f"A-{i}", AT_ONCE) for i in range(100))
    )
    let_through = double.reported("A")
    most = BUDGET + reported(vllm_like, AT_ONCE)
    assert let_through <= most, (let_through, sorted(set(statuses)))
    assert set(statuses) == {200, 429}, statuses
