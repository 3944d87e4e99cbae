"""Charging what was served (issue 38): a backend that reports whatever usage a function of
the request body says, and a contention that measures who got the work it reported.

SFQ orders dispatch on an estimate made at admission; since issue 38 each request's charge is
trued up when it ends to the cost the backend reports (prompt + completion tokens, by the
pool's formula). So whatever a tenant does to the estimate, what decides its share is what
the backend says it did. The tests and ``bench/gaming.py`` check it with:

- :class:`UsageDouble`, an OpenAI-compatible backend (``/v1/chat/completions``,
  ``/v1/completions``, streamed or not) whose reported ``usage`` is any function of the body
  it receives (:data:`Usage`), and which takes time in proportion to that work, so that a
  request that does more holds its slot longer. :func:`vllm_like` is what a vLLM does (a
  chat template's tokens per message, every string a template renders, ``n`` sequences for
  each prompt of a batch); :class:`Drawn` is an arbitrary linear function of the body's
  features, capped at a context's worth per request.
- :func:`contend`: two tenants' backlogs queued in the proxy (one or more replicas) behind
  blockers that hold every slot, then served; returns the backend's records in dispatch
  order, whose :func:`share` is taken over the :func:`window` in which both were backlogged.

Nothing here imports ``sfq_proxy``: the bench runs these scenarios against the proxy of
another checkout (one from before the change), as a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

MODEL = "sim-llama"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SLOTS = 4
TEMPLATE = 4  # tokens a chat template renders around each message (role markers)
BOS = 1  # a completion prompt's start token
# a prompt that makes the model answer one token and stop (the idle-time junk of trick d)
STOP_AT_ONCE = "Reply with one word."
CONTEXT = 4096  # what one request may report at most, prompt and output (Drawn)
DEFAULT_MAX_TOKENS = 512  # the pool's cost.default_max_tokens (the proxy's default)
TOKENS_PER_S = 40_000.0  # how fast the double works through a request's tokens
SHARE_LIMIT = 0.55  # the cheater's share of the reported cost over the backlogged window
# A stream's token events, one per token: a few thousand at most, as a real server's
MAX_EVENTS = 4096
# pydantic's lax booleans, as a server built on it (vLLM, TGI's Python clients) reads them
_LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_LAX_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


# --- what the backend reports -----------------------------------------------------------------

# (path, body as received, its size in bytes) -> (prompt_tokens, completion_tokens)
Usage = Callable[[str, dict[str, Any], int], tuple[int, int]]


def strings(value: Any) -> Iterator[str]:
    """Every string anywhere in ``value`` but a part's ``type`` (not the names of members)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(v for k, v in item.items() if k != "type")
        elif isinstance(item, list):
            stack.extend(item)


def chars(value: Any) -> int:
    return sum(len(s) for s in strings(value))


def tokens(characters: int) -> int:
    return -(-characters // 4)


@dataclass(frozen=True)
class Features:
    """What a body is made of, as a backend could weigh it."""

    size: int  # bytes
    messages: int  # a chat's messages
    prompts: int  # a completion's prompts (1 for a string)
    choices: int  # n (or best_of, when larger)
    max_tokens: int  # per sequence, as the body says (the default when it does not)
    hidden: int  # characters of the top-level ``documents``, which a template renders


def features(path: str, body: dict[str, Any], size: int) -> Features:
    prompt = body.get("prompt")
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    return Features(
        size=size,
        messages=len(body.get("messages") or []) if path == CHAT else 0,
        prompts=len(prompt) if path == COMPLETIONS and isinstance(prompt, list) else 1,
        choices=max(body.get("n") or 1, body.get("best_of") or 1),
        max_tokens=asked if isinstance(asked, int) else DEFAULT_MAX_TOKENS,
        hidden=chars(body.get("documents")),
    )


def vllm_like(path: str, body: dict[str, Any], size: int) -> tuple[int, int]:
    """What a vLLM reports: a chat's messages each ``TEMPLATE`` tokens plus the text of every
    string the template renders of it (a ``refusal`` or ``thinking`` part's, a name…) at 4
    characters a token, and its ``documents``; a completion's prompts each ``BOS`` + its
    text. Each sequence (``n`` of them for each prompt) generates its ``max_tokens``, or one
    token when the prompt says ``STOP_AT_ONCE``."""
    f = features(path, body, size)
    if path == CHAT:
        rendered = [
            TEMPLATE + tokens(chars({k: v for k, v in m.items() if k != "role"}))
            for m in body["messages"]
        ]
        prompt = sum(rendered) + tokens(f.hidden)
        text = "".join(strings(body["messages"]))
    else:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        prompt = sum(BOS + tokens(len(p)) for p in prompts)
        text = "".join(prompts)
    each = 1 if STOP_AT_ONCE in text else f.max_tokens
    return prompt, each * f.choices * f.prompts


@dataclass(frozen=True)
class Drawn:
    """An arbitrary usage: a prompt of so many tokens per byte of body, per message, per
    prompt of a batch and per character of the hidden field, an output of ``output`` times
    what the sequences could generate, both capped at ``CONTEXT`` tokens a request."""

    per_byte: float
    per_message: float
    per_prompt: float
    per_hidden: float
    output: float

    def __call__(self, path: str, body: dict[str, Any], size: int) -> tuple[int, int]:
        f = features(path, body, size)
        prompt = 1 + round(
            self.per_byte * f.size
            + self.per_message * f.messages
            + self.per_prompt * f.prompts
            + self.per_hidden * f.hidden
        )
        completion = round(self.output * f.max_tokens * f.choices * f.prompts)
        prompt = min(prompt, CONTEXT)
        return prompt, min(completion, CONTEXT - prompt)


# --- the backend ------------------------------------------------------------------------------


@dataclass
class Record:
    """One request as the backend served it, in the order it arrived (dispatch order)."""

    user: str
    path: str
    prompt_tokens: int
    completion_tokens: int
    stream: bool
    outcome: str | None = None  # "completed", "aborted"; None while running

    @property
    def org(self) -> str:
        return self.user.split("-", 1)[0]

    @property
    def actual(self) -> int:
        """The cost it reported: input and output weights are 1."""
        return self.prompt_tokens + self.completion_tokens


class UsageDouble:
    """An OpenAI-compatible backend whose ``usage`` is ``usage(path, body, size)``.

    A request waits while the double is held (``hold``/``release``), then works through its
    reported tokens at ``tokens_per_s`` (a sleep), then answers: a JSON body with its usage, or a
    stream of one event per completion token, and its usage chunk when
    ``stream_options.include_usage`` is true as pydantic reads it (the string "false" is
    false; a value pydantic refuses is a 400, as vLLM's). ``log`` keeps every request in
    arrival order.
    """

    def __init__(self, usage: Usage = vllm_like, tokens_per_s: float = TOKENS_PER_S) -> None:
        self.usage = usage
        self.tokens_per_s = tokens_per_s
        self.log: list[Record] = []
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(CHAT, self._generate)
        app.router.add_post(COMPLETIONS, self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        """Served on a free loopback port until the block ends (the bench's way): its URL."""
        runner = web.AppRunner(self.app())
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()

    def reported(self, org: str) -> int:
        """The tokens the backend reported for the requests of ``org`` it received."""
        return sum(r.actual for r in self.log if r.org == org)

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        include_usage = _lax_bool((body.get("stream_options") or {}).get("include_usage"))
        if isinstance(include_usage, str):
            error = {"message": include_usage, "type": "BadRequestError", "code": 400}
            return web.json_response({"error": error}, status=400)
        path = request.path
        prompt, completion = self.usage(path, body, len(raw))
        stream = bool(body.get("stream"))
        record = Record(str(body.get("user", "")), path, prompt, completion, stream)
        self.log.append(record)
        try:
            await self._open.wait()
            await asyncio.sleep((prompt + completion) / self.tokens_per_s)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            if stream:
                answer = await self._stream(request, path, completion, usage, include_usage)
            else:
                answer = web.json_response(_answer(path, _choices(path, body), usage))
        except asyncio.CancelledError:
            record.outcome = "aborted"
            raise
        record.outcome = "completed"
        return answer

    async def _stream(
        self,
        request: web.Request,
        path: str,
        completion: int,
        usage: dict[str, int],
        include_usage: bool | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if path == CHAT else "text_completion"
        events: list[dict[str, Any]] = []
        for i in range(min(completion, MAX_EVENTS)):
            last = i == min(completion, MAX_EVENTS) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if last else None}
            if path == CHAT:
                choice["delta"] = {"content": " ok"}
            else:
                choice["text"] = " ok"
            events.append({"id": "x", "object": kind, "model": MODEL, "choices": [choice]})
        if include_usage:
            events.append({"id": "x", "object": kind, "model": MODEL, "choices": [],
                           "usage": usage})  # fmt: skip
        data = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
        await response.write(data + b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _lax_bool(value: Any) -> bool | str | None:
    """``include_usage`` as pydantic's lax mode reads it; a string: why it refuses it."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _LAX_TRUE | _LAX_FALSE:
        return value.lower() in _LAX_TRUE
    return "stream_options.include_usage: Input should be a valid boolean"


def _choices(path: str, body: dict[str, Any]) -> int:
    f = features(path, body, 0)
    return f.choices * f.prompts


def _answer(path: str, choices: int, usage: dict[str, int]) -> dict[str, Any]:
    if path == CHAT:
        message = {"role": "assistant", "content": "ok"}
        made = [{"index": i, "message": message, "finish_reason": "stop"} for i in range(choices)]
        kind = "chat.completion"
    else:
        made = [{"index": i, "text": "ok", "finish_reason": "stop"} for i in range(choices)]
        kind = "text_completion"
    return {"id": "x", "object": kind, "created": 0, "model": MODEL, "choices": made,
            "usage": usage}  # fmt: skip


# --- what the tenants send --------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One request of a backlog: its path and body (``model`` and ``user`` are added)."""

    path: str
    body: dict[str, Any]

    def __repr__(self) -> str:  # in hypothesis's reports: long strings elided
        def short(value: Any) -> Any:
            if isinstance(value, str) and len(value) > 40:
                return f"{value[:20]}…({len(value)} chars)"
            if isinstance(value, dict):
                return {k: short(v) for k, v in value.items()}
            if isinstance(value, list):
                return [short(v) for v in value[:3]] + (
                    [f"…({len(value)})"] if len(value) > 3 else []
                )
            return value

        return f"Ask({self.path!r}, {short(self.body)!r})"


def chat(*messages: dict[str, Any], max_tokens: int) -> Ask:
    return Ask(CHAT, {"messages": list(messages), "max_tokens": max_tokens})


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def with_fields(ask: Ask, **fields: Any) -> Ask:
    return Ask(ask.path, {**ask.body, **fields})


def honest_chats() -> Iterator[Ask]:
    """Ordinary chats: one to three user messages of 200-1,200 characters, max_tokens
    100-400, in a fixed cycle (about 400-900 tokens each, prompt and output)."""
    words = "Summarise the quarterly report for the board and list the risks. "
    for i in itertools.count():
        messages = [
            {"role": "user", "content": (words * 20)[: 200 + (i * 37 + k * 101) % 1000]}
            for k in range(1 + i % 3)
        ]
        yield Ask(CHAT, {"messages": messages, "max_tokens": 100 + (i * 53) % 300})


def classifications() -> Iterator[Ask]:
    """Honest requests that ask for far more than they use: a ticket of 800-1,200
    characters to classify, max_tokens 4,000 (a client's habit), answered in one token."""
    words = "The customer cannot log in since the update and asks for a refund. "
    for i in itertools.count():
        ticket = (words * 20)[: 800 + (i * 37) % 400]
        yield chat(user(f"{ticket} {STOP_AT_ONCE}"), max_tokens=4000)


def reported(usage: Usage, ask: Ask) -> int:
    """What the backend will report for ``ask`` (near enough: before the proxy's changes)."""
    body = {"model": MODEL, **ask.body, "user": "x-0"}
    return sum(usage(ask.path, body, len(json.dumps(body))))


def work(usage: Usage, asks: Sequence[Ask]) -> int:
    return sum(reported(usage, ask) for ask in asks)


def backlog(asks: Iterator[Ask], usage: Usage, most_work: int, most: int) -> list[Ask]:
    """Requests from ``asks`` until their usage adds up to ``most_work`` tokens, or ``most``
    of them: both tenants get backlogs of about equal work, so that in a fair run neither
    runs out long before the other."""
    taken: list[Ask] = []
    total = 0
    for ask in asks:
        if total >= most_work or len(taken) >= most:
            break
        total += reported(usage, ask)
        taken.append(ask)
    return taken


# --- the contention ---------------------------------------------------------------------------


@dataclass
class Proxies:
    """The proxy (or replicas of it) under test: their URLs, the keys of the tenants, and
    how many requests wait in the pool's queue (all replicas together)."""

    urls: list[str]
    keys: dict[str, str]  # org -> key: "A" the cheater, "B" the honest one, "C" the blockers
    queued: Callable[[], Awaitable[int]]
    session: aiohttp.ClientSession

    async def send(self, url: str, org: str, user: str, ask: Ask) -> int:
        """``ask`` as ``org``, read to its end; its status."""
        body = {"model": MODEL, **ask.body, "user": user}
        headers = {"Authorization": f"Bearer {self.keys[org]}"}
        async with self.session.post(f"{url}{ask.path}", json=body, headers=headers) as r:
            await r.read()
            return r.status


@dataclass
class Contest:
    """What a contention found: the backend's records of the two tenants in dispatch order,
    and the status of every request they sent."""

    records: list[Record]
    statuses: dict[str, list[int]]

    def window(self) -> list[Record]:
        return window(self.records)

    def share(self, org: str = "A") -> float:
        return share(self.window(), org)

    def describe(self, org: str = "A") -> str:
        """For an assertion's message: the share, the window and who was refused what."""
        w = self.window()
        counts = {o: sum(r.org == o for r in w) for o in ("A", "B")}
        actual = {o: sum(r.actual for r in w if r.org == o) for o in ("A", "B")}
        refused = {o: sorted({s for s in ss if s != 200}) for o, ss in self.statuses.items()}
        return (
            f"{org} got {self.share(org):.1%} of the reported cost over {len(w)} dispatches "
            f"{counts}, reported {actual}; refused: {refused}"
        )


async def contend(
    double: UsageDouble, proxies: Proxies, backlogs: Mapping[str, Sequence[Ask]]
) -> Contest:
    """Queue every tenant's backlog (A's and B's) in the proxy before anything is served,
    then serve it all: the order is then the scheduler's alone.

    The double is held while ``SLOTS`` blockers of org C take every slot (on the first
    replica), the backlogs are sent (request i to replica i mod replicas) and wait; then
    it is let go."""
    start = len(double.log)
    double.hold()
    blocker = Ask(CHAT, {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 1})
    blockers = [
        asyncio.create_task(proxies.send(proxies.urls[0], "C", f"C-{i}", blocker))
        for i in range(SLOTS)
    ]
    sends: dict[str, list[asyncio.Task[int]]] = {}
    try:
        await until(lambda: len(double.log) == start + SLOTS, "the blockers never ran")
        sends = {
            org: [
                asyncio.create_task(
                    proxies.send(proxies.urls[i % len(proxies.urls)], org, f"{org}-{i}", ask)
                )
                for i, ask in enumerate(asks)
            ]
            for org, asks in backlogs.items()
        }
        everything = sum(len(tasks) for tasks in sends.values())

        async def all_wait() -> bool:  # a request refused at admission never waits
            done = sum(t.done() for tasks in sends.values() for t in tasks)
            return await proxies.queued() + done >= everything

        await until(all_wait, "the backlogs never all waited", within=60)
    finally:
        double.release()
    statuses = {org: list(await asyncio.gather(*tasks)) for org, tasks in sends.items()}
    await asyncio.gather(*blockers)
    users = {f"{org}-{i}" for org, asks in backlogs.items() for i in range(len(asks))}
    return Contest([r for r in double.log[start:] if r.user in users], statuses)


def window(records: list[Record]) -> list[Record]:
    """The dispatches made while both tenants had requests queued: up to and including the
    last of the one that ran out first (all were queued before the first)."""
    last = {r.org: i for i, r in enumerate(records)}
    if len(last) < 2:
        return []
    return records[: min(last.values()) + 1]


def share(records: list[Record], org: str) -> float:
    """``org``'s share of the reported cost of ``records`` (0 for none)."""
    total = sum(r.actual for r in records)
    return sum(r.actual for r in records if r.org == org) / total if total else 0.0


async def until(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, within: float = 20
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = predicate()
        if await result if isinstance(result, Awaitable) else result:
            return
        if loop.time() > deadline:
            raise AssertionError(what)
        await asyncio.sleep(0.02)


# --- the tricks -------------------------------------------------------------------------------


class Chooser(Protocol):
    """Where a drawn case's choices come from: hypothesis in the tests, a seeded
    ``random.Random`` in the bench."""

    def integer(self, low: int, high: int) -> int: ...

    def number(self, low: float, high: float) -> float: ...


def drawn_usage(choose: Chooser) -> Drawn:
    """A usage function whose weights may be anything from nothing to a lot, but for two
    floors: a token per 5 bytes of body and a quarter of the output asked for. Below them
    an honest chat reports so little work that what the estimates hold in flight (a few
    slots' worth) outweighs a whole backlog, and no share of it means anything; how the
    proxy treats requests that do far less than estimated is trick g's."""
    return Drawn(
        per_byte=choose.number(0.2, 1.0),
        per_message=choose.number(0.0, 16.0),
        per_prompt=choose.number(0.0, 64.0),
        per_hidden=choose.number(0.0, 1.0),
        output=choose.number(0.25, 1.0),
    )


def drawn_shape(choose: Chooser) -> Ask:
    """One request shape of a cheater who has read the source: a chat of few or very many
    messages, short or long, of plain, refusal or thinking parts, with or without a hidden
    ``documents`` field; or a completion of one prompt or a batch; n; max_tokens or none.
    Within the proxy's ceiling (131,072 tokens a request) whatever it counts."""
    n = choose.integer(1, 8)
    if choose.integer(0, 1):  # a completion
        count = choose.integer(1, 64)
        length = choose.integer(0, 200)
        prompt: Any = ["p" * length] * count if choose.integer(0, 1) else "p" * length
        prompts = count if isinstance(prompt, list) else 1
        body: dict[str, Any] = {"prompt": prompt}
    else:
        count = choose.integer(1, 8) if choose.integer(0, 2) else choose.integer(100, 800)
        length = choose.integer(0, 4000 // count)
        kind = ("text", "refusal", "thinking", None)[choose.integer(0, 3)]
        content: Any = "c" * length if kind is None else [{"type": kind, kind: "c" * length}]
        body = {"messages": [{"role": "user", "content": content}] * count}
        if choose.integer(0, 1):
            body["documents"] = [{"title": "t", "text": "d" * choose.integer(0, 16000)}]
        prompts = 1
    if choose.integer(0, 3):  # mostly set, at most what the ceiling lets through
        body["max_tokens"] = choose.integer(1, max(1, min(2000, 100_000 // (n * prompts))))
    if n > 1:
        body["n"] = n
    return Ask(COMPLETIONS if "prompt" in body else CHAT, body)


def cycle(asks: Sequence[Ask]) -> Iterator[Ask]:
    return itertools.cycle(asks)


def repeat(ask: Ask) -> Iterator[Ask]:
    return itertools.repeat(ask)


@dataclass(frozen=True)
class Trick:
    """One of issue 38's tricks: the cheater's requests (and, for d, what it sends first,
    while the pool is idle), under a vLLM's usage."""

    name: str
    what: str
    cheater: Ask
    warm_up: tuple[Ask, int] | None = None  # (request, how many), sent before contending
    honest: Callable[[], Iterator[Ask]] = lambda: honest_chats()


REFUSAL = {"role": "assistant", "content": [{"type": "refusal", "refusal": "r" * 8000}]}
THINKING = user([{"type": "thinking", "thinking": "t" * 8000}])
TRICKS = {
    t.name: t
    for t in (
        Trick(
            "a",
            "/v1/completions: 50 prompts, n=4",
            Ask(COMPLETIONS, {"prompt": ["c" * 20] * 50, "n": 4, "max_tokens": 8}),
        ),
        Trick("b1", "the prompt in a refusal part", chat(REFUSAL, user("Go on."), max_tokens=16)),
        Trick("b2", "the prompt in a thinking part", chat(THINKING, max_tokens=16)),
        Trick("c", "800 empty messages", chat(*[user("")] * 800, max_tokens=16)),
        Trick(
            "d",
            "300 idle max_tokens 120000, then full",
            chat(user("Write it all."), max_tokens=2000),
            warm_up=(chat(user(STOP_AT_ONCE), max_tokens=120_000), 300),
        ),
        Trick(
            "g",
            "full answers vs short ones",
            chat(user("Write it all."), max_tokens=2000),
            honest=lambda: classifications(),
        ),
    )
}
# the generic test's example: a field a vLLM chat template renders and the proxy does not read
HIDDEN = with_fields(
    chat(user("Use the documents."), max_tokens=16), documents=[{"title": "t", "text": "d" * 16000}]
)
PLAIN_USAGE = Drawn(per_byte=0.25, per_message=4, per_prompt=1, per_hidden=0.25, output=1.0)
# the budget holes (e, f): a day's budget on the cheater's key, and what it sends
BUDGET = 20_000
LONG_STREAM = with_fields(chat(user("x" * 16_000), max_tokens=16), stream=True)  # 4,020 tokens
USAGE_OFF = with_fields(LONG_STREAM, stream_options={"include_usage": "false"})
AT_ONCE = chat(user("y" * 1600), max_tokens=400)  # 804 tokens
WORK = 120_000  # tokens of reported work in each tenant's backlog
MOST = 400  # requests in a backlog at most


async def play(
    trick: Trick, double: UsageDouble, proxies: Proxies, work: int = WORK, most: int = MOST
) -> Contest:
    """``trick`` against honest chats: the warm-up (every request at once, on an idle pool),
    then both backlogs contending."""
    if trick.warm_up is not None:
        ask, count = trick.warm_up
        urls = proxies.urls
        statuses = await asyncio.gather(
            *(proxies.send(urls[i % len(urls)], "A", f"warm-{i}", ask) for i in range(count))
        )
        assert set(statuses) == {200}, statuses
    backlogs = {
        "A": backlog(repeat(trick.cheater), double.usage, work, most),
        "B": backlog(trick.honest(), double.usage, work, most),
    }
    return await contend(double, proxies, backlogs)
