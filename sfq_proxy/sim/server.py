"""A simulated vLLM server: slots, a waiting queue, faults and sockets around the engine
model (``engine.py``) and the OpenAI API shapes (``api.py``).

The proxy's demo and end-to-end tests need a backend that looks like vLLM *from a load
balancer's point of view*: same endpoints and JSON shapes, a bounded batch with a FIFO
waiting queue behind it, prefill and per-token decode latency that grows with batch size,
client disconnects aborting work, and fault knobs.  No GPU, no model: the "generated" text is
a seeded pseudo-random word sequence, one word per token, so a run is reproducible.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from http import HTTPStatus
from typing import Any, Literal

from aiohttp import web

from ..runner.server import run, wait_for_signal
from .api import (
    DEFAULT_MEDIA_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    AnswerPlan,
    GenerationRequest,
    JsonSink,
    Kind,
    RefusedRequest,
    ResponsesSseSink,
    Sink,
    SseSink,
    ceil_tokens,
    error_response,
    estimate_prompt_tokens,
    parse_generation,
)
from .engine import EngineModel, output_tokens

__all__ = [
    "Faults",
    "RequestRecord",
    "SimBackend",
    "SimConfig",
    "SimStats",
    "add_parser",
]

Outcome = Literal["completed", "aborted", "failed"]

DEFAULT_MODEL = "sim-llama"
# Shorter decode steps are slept together: time-scaled runs would otherwise wake the event
# loop thousands of times a second and slow down the very clock they simulate.
MIN_SLEEP_S = 0.002
_HTTP_STATUSES = frozenset(s.value for s in HTTPStatus)
_WORDS = (
    "the", "model", "answers", "with", "plain", "words", "so", "that", "tests", "can",
    "count", "tokens", "easily", "while", "fair", "queueing", "keeps", "every", "user",
    "happy", "and", "latency", "stays", "low",
)  # fmt: skip


_MEDIA_FIELDS = {kind: f"{kind}_tokens" for kind in DEFAULT_MEDIA_TOKENS}


@dataclass(frozen=True)
class SimConfig:
    """Engine model parameters.

    Defaults approximate vLLM serving an 8B bf16 model on one H100-class GPU: 256 sequences
    per batch (vLLM's default ``max_num_seqs``), ~10k prompt tokens/s of prefill and ~80
    tokens/s per sequence when decoding alone, falling off linearly as the batch grows.

    A request without ``max_tokens`` (or ``max_completion_tokens``) generates up to
    ``default_max_tokens``, or, when that is None, up to the rest of the context window as
    vLLM itself does. Its prompt counts ``tokens_per_message`` per chat message (the chat
    template's role markers), its text at ``chars_per_token``, and each non-text part: an
    image by OpenAI's tile rule when its size can be read, else ``{kind}_tokens``.
    """

    models: Sequence[str] = (DEFAULT_MODEL,)
    max_num_seqs: int = 256
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 80.0
    batch_slowdown: float = 0.01
    time_scale: float = 1.0
    max_model_len: int = 8192
    chars_per_token: float = 4.0
    # max: generate max_tokens; random: a seeded draw in [1, max_tokens]; min_tokens: stop at
    # the request's min_tokens (replays a trace's real output lengths), else max_tokens
    output_mode: Literal["max", "random", "min_tokens"] = "max"
    default_max_tokens: int | None = 256
    seed: int = 0
    tokens_per_message: int = MESSAGE_OVERHEAD_TOKENS
    image_tokens: int = DEFAULT_MEDIA_TOKENS["image"]
    audio_tokens: int = DEFAULT_MEDIA_TOKENS["audio"]
    file_tokens: int = DEFAULT_MEDIA_TOKENS["file"]
    video_tokens: int = DEFAULT_MEDIA_TOKENS["video"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if not self.models:
            raise ValueError("at least one model name is required")
        if self.output_mode not in ("max", "random", "min_tokens"):
            raise ValueError("output_mode must be 'max', 'random' or 'min_tokens'")
        positive = (
            "max_num_seqs",
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "time_scale",
            "max_model_len",
            "chars_per_token",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.default_max_tokens is not None and self.default_max_tokens <= 0:
            raise ValueError("default_max_tokens must be positive, or None (up to the context)")
        not_negative = ("batch_slowdown", "tokens_per_message", *_MEDIA_FIELDS.values())
        for name in not_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def media_tokens(self) -> Mapping[str, int]:
        """What a non-text part whose size is unknown costs, by kind."""
        return {kind: getattr(self, name) for kind, name in _MEDIA_FIELDS.items()}

    @property
    def engine(self) -> EngineModel:
        """The engine model (``sim/engine.py``), in unscaled seconds."""
        return EngineModel(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.batch_slowdown)

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Wall time of a prompt's prefill, which also yields the first output token."""
        return self.engine.prefill_seconds(prompt_tokens) / self.time_scale

    def decode_interval(self, running: int) -> float:
        """Per-sequence time between two output tokens when ``running`` sequences share a batch."""
        return self.engine.decode_interval(running) / self.time_scale


@dataclass
class Faults:
    """Fault-injection knobs, read on every request so they can change at runtime.

    Set fields directly (``sim.faults.fail_rate = 1.0``), except ``refuse_connections``, which
    needs socket work: use ``pause_listening``/``resume_listening``, ``update_faults`` or
    ``POST /sim/faults``.
    """

    fail_rate: float = 0.0
    fail_status: int = 503
    die_after_tokens: int | None = None
    refuse_connections: bool = False
    health_status: int = 200

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("fail_rate must be within [0, 1]")
        for status in (self.fail_status, self.health_status):
            if not isinstance(status, int) or status < 200 or status not in _HTTP_STATUSES:
                raise ValueError(f"{status!r} is not a final HTTP status code")
        die = self.die_after_tokens
        if die is not None and (not isinstance(die, int) or die < 0):
            raise ValueError("die_after_tokens must be None or an int >= 0")
        if not isinstance(self.refuse_connections, bool):
            raise ValueError("refuse_connections must be a bool")


@dataclass(slots=True)
class RequestRecord:
    """One valid generation request, as the engine saw it.  Times are time.monotonic()."""

    index: int  # arrival order, == position in SimStats.log
    user: str | None
    model: str
    prompt_tokens: int
    max_tokens: int  # each sequence's budget, as resolved (asked, default, or context)
    stream: bool
    had_authorization: bool
    arrived_at: float
    # the body's max_tokens, max_completion_tokens, n and best_of as they arrived (those
    # present): what a proxy in front sent upstream
    asked: dict[str, Any] = field(default_factory=dict)
    sequences: int = 1  # generated (n, or best_of when larger), each in a batch slot
    started_at: float | None = None  # got a batch slot (None: failed or aborted while waiting)
    ended_at: float | None = None
    completion_tokens: int = 0  # generated, every sequence
    outcome: Outcome | None = None  # None while in flight


@dataclass
class SimStats:
    """Counters and per-request log; ``running``/``waiting`` are live gauges."""

    requests_seen: int = 0
    completed: int = 0
    aborted: int = 0
    failed_injected: int = 0
    max_concurrent: int = 0
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    log: list[RequestRecord] = field(default_factory=list)

    def reset(self) -> None:
        """Zero everything but the live gauges; requests still in flight count when they end."""
        fresh = SimStats(
            running=self.running,
            waiting=self.waiting,
            max_concurrent=self.running + self.waiting,
        )
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))


class _FifoSlots:
    """Counting semaphore granting strictly in arrival order, like vLLM's FCFS scheduler.

    Written out because asyncio.Semaphore's fairness is an implementation detail (it was not
    FIFO before Python 3.11.1), and because a request with ``n`` sequences needs ``n`` slots
    at once: taking them one by one, two such requests could each hold part of the batch
    and wait for the rest forever. The oldest waiter is served first, whole, and nothing
    overtakes it (head-of-line, as vLLM's scheduler admits a sequence group).
    """

    def __init__(self, capacity: int) -> None:
        self._free = capacity
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, count: int = 1) -> None:
        if self._free >= count and not self._waiters:
            self._free -= count
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (count, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(count)  # the slots were handed over just before the cancel landed
            else:
                with contextlib.suppress(ValueError):  # _grant() may have dropped it
                    self._waiters.remove(entry)
                self._grant()  # the head may have left: the next may fit now
            raise

    def release(self, count: int = 1) -> None:
        self._free += count
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            count, waiter = self._waiters[0]
            if waiter.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if self._free < count:
                return
            self._waiters.popleft()
            self._free -= count
            waiter.set_result(None)


class _InjectedDeath(Exception):
    """die_after_tokens was reached: the "server" crashes mid-generation."""


def _drop_connection(request: web.Request) -> web.Response:
    """Close the socket under a request; the returned response can no longer be delivered.

    aiohttp then fails to write it, takes that as a client disconnect and stays quiet.
    """
    if request.transport is not None:
        request.transport.close()
    return web.Response(status=500)


def _listen_socket(host: str, port: int) -> socket.socket:
    """A bound socket; owning it (rather than TCPSite) lets us re-listen on the same port."""
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class SimBackend:
    """The simulated server.  ``start()`` it, or use ``async with SimBackend(cfg) as sim``."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.stats = SimStats()
        self.faults = Faults()
        self._rng = random.Random(self.config.seed)
        self._slots = _FifoSlots(self.config.max_num_seqs)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._busy: set[object] = set()  # aiohttp protocols (connections) handling a request
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._host = "127.0.0.1"
        self._port = 0
        self._engine_running = asyncio.Event()
        self._engine_running.set()

    # ----------------------------------------------------------------- lifecycle

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0 = ephemeral) and return the base URL."""
        sock = _listen_socket(host, port)
        self._host, self._port = host, sock.getsockname()[1]
        # aiohttp (3.9+) cancels a handler when its client goes away only if asked to.  Without
        # it a non-streaming request would hold its batch slot to the end, unlike in vLLM.
        self._runner = web.AppRunner(
            self._make_app(), handler_cancellation=True, shutdown_timeout=1.0, access_log=None
        )
        await self._runner.setup()
        self._site = web.SockSite(self._runner, sock)
        await self._site.start()
        return self.url

    async def stop(self) -> None:
        """Abort every running or waiting sequence, then close sockets and connections."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = self._site = None

    async def __aenter__(self) -> SimBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def pause_listening(self) -> None:
        """Act like a server that went away: refuse new connects and hang up idle keep-alives.

        Requests already in flight still get their answer, then their connection closes.
        Without dropping idle keep-alive connections, a client's pool would hide the fault.
        """
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self._runner is not None and self._runner.server is not None:
            for conn in self._runner.server.connections:
                # close() finishes the current response first, but leaves an idle socket open
                # (aiohttp 3.14), so idle connections need force_close().
                if conn in self._busy:
                    conn.close()
                else:
                    conn.force_close()
        self.faults.refuse_connections = True

    async def resume_listening(self) -> None:
        """Listen again on the same port after pause_listening()."""
        if self._site is None and self._runner is not None:
            self._site = web.SockSite(self._runner, _listen_socket(self._host, self._port))
            await self._site.start()
        self.faults.refuse_connections = False

    def hold(self) -> None:
        """Stall the engine: requests that arrive are accepted and wait for a batch slot (in
        ``waiting``) until release(); those already running go on. A test or bench uses it
        to let a proxy's queue fill up before anything is served, whatever the speed."""
        self._engine_running.clear()

    def release(self) -> None:
        """Let the held requests take batch slots, in arrival order."""
        self._engine_running.set()

    async def update_faults(self, **changes: Any) -> Faults:
        """Validate and apply fault knobs together (ValueError/TypeError if any is bad)."""
        refuse = changes.pop("refuse_connections", self.faults.refuse_connections)
        faults = replace(self.faults, refuse_connections=refuse, **changes)
        self.faults = faults
        await (self.pause_listening() if refuse else self.resume_listening())
        return faults

    # ----------------------------------------------------------------- HTTP surface

    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._track_busy])
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.post("/v1/embeddings", self._embeddings),
                web.post("/v1/responses", self._responses),
                web.post("/tokenize", self._tokenize),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/sim/stats", self._get_stats),
                web.get("/sim/faults", self._get_faults),
                web.post("/sim/faults", self._post_faults),
                web.post("/sim/reset", self._reset),
            ]
        )
        return app

    @web.middleware
    async def _track_busy(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Remember which connections are mid-request, for pause_listening()."""
        self._busy.add(request.protocol)  # HTTP/1.1: one request at a time per connection
        try:
            return await handler(request)
        finally:
            self._busy.discard(request.protocol)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` of a ``prompt`` (or chat ``messages``): the count and the
        token ids (made up: the sim has no vocabulary), computed at once, no batch slot."""
        try:
            body = json.loads(await request.read())
            prompt = {k: body[k] for k in ("messages", "prompt") if k in body}
            if not prompt:
                raise KeyError("prompt")
            count = estimate_prompt_tokens(
                prompt,
                self.config.chars_per_token,
                self.config.tokens_per_message,
                self.config.media_tokens,
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return error_response(400, "'prompt' or 'messages' is required")
        if body.get("model") not in self.config.models:
            return error_response(404, f"The model `{body.get('model')}` does not exist.")
        return web.json_response(
            {
                "count": count,
                "max_model_len": self.config.max_model_len,
                "tokens": [(i * 7919) % 32000 for i in range(count)],
                "token_strs": None,
            }
        )

    async def _embeddings(self, request: web.Request) -> web.Response:
        """Deterministic 8-dimensional vectors, one per input, with a correct ``usage``."""
        try:
            body = json.loads(await request.read())
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            if inputs and all(isinstance(x, int) for x in inputs):
                inputs = [inputs]
            tokens = [
                len(x) if isinstance(x, list) else ceil_tokens(len(x), self.config.chars_per_token)
                for x in inputs
            ]
        except (ValueError, KeyError, TypeError):
            return error_response(400, "'input' must be a string, strings or token ids")
        if body.get("model") not in self.config.models:
            return error_response(404, f"The model `{body.get('model')}` does not exist.")
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": [((i + 1) * k % 7) / 7 for k in range(8)],
            }
            for i in range(len(inputs))
        ]
        usage = {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
        return web.json_response(
            {"object": "list", "data": data, "model": body["model"], "usage": usage}
        )

    async def _models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": m,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": self.config.max_model_len,
            }
            for m in self.config.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.faults.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        """vLLM's scheduler gauges; like vLLM, labelled with the first served model name."""
        label = f'{{model_name="{self.config.models[0]}"}}'
        s = self.stats
        series = [
            ("vllm:num_requests_running", "gauge", "Requests in the running batch.", s.running),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting for a batch slot.", s.waiting),
            ("vllm:prompt_tokens_total", "counter", "Prefilled prompt tokens.", s.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Generated tokens.", s.completion_tokens),
        ]
        lines = []
        for name, kind, help_text, value in series:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} {kind}",
                f"{name}{label} {float(value)}",
            ]
        return web.Response(
            body=("\n".join(lines) + "\n").encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def _get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.stats))

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.faults))

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            faults = await self.update_faults(**body)
        except (ValueError, TypeError) as exc:
            return error_response(400, f"Invalid faults: {exc}")
        return web.json_response(asdict(faults))

    async def _reset(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return web.json_response(asdict(self.stats))

    # ----------------------------------------------------------------- generation

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        """Validate, maybe inject a failure, then run the sequence into a stream or JSON sink."""
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
            return error_response(400, "Request body is not valid JSON")
        try:
            gen = parse_generation(kind, body, self.config)
        except RefusedRequest as exc:
            return exc.response()
        rec = self._admit(request, gen)
        if self._draw_failure():
            self._finish(rec, "failed")
            return error_response(self.faults.fail_status, "Injected failure (fail_rate)")
        plan = self._plan(gen)
        sink: Sink = JsonSink(plan)
        if gen.stream:
            sink = ResponsesSseSink(plan) if kind == "responses" else SseSink(plan)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await sink.start(request)
            await self._run(rec, plan, sink.token)
            response = await sink.finish()
        except _InjectedDeath:
            self._finish(rec, "failed")
            return _drop_connection(request)
        except ConnectionError:  # the peer vanished before aiohttp could cancel us
            self._finish(rec, "aborted")
            return _drop_connection(request)
        except asyncio.CancelledError:  # client disconnect (handler_cancellation) or stop()
            self._finish(rec, "aborted")
            raise
        finally:
            self._tasks.discard(task)
        self._finish(rec, "completed")
        return response

    def _admit(self, request: web.Request, gen: GenerationRequest) -> RequestRecord:
        stats = self.stats
        rec = RequestRecord(
            index=len(stats.log),
            user=gen.user,
            model=gen.model,
            prompt_tokens=gen.prompt_tokens,
            max_tokens=gen.max_tokens,
            stream=gen.stream,
            had_authorization="Authorization" in request.headers,
            arrived_at=time.monotonic(),
            asked=dict(gen.asked),
            sequences=gen.sequences,
        )
        stats.log.append(rec)
        stats.requests_seen += 1
        stats.prompt_tokens += gen.prompt_tokens
        return rec

    def _finish(self, rec: RequestRecord, outcome: Outcome) -> None:
        rec.outcome, rec.ended_at = outcome, time.monotonic()
        if outcome == "completed":
            self.stats.completed += 1
        elif outcome == "aborted":
            self.stats.aborted += 1
        else:
            self.stats.failed_injected += 1

    def _draw_failure(self) -> bool:
        # No draw at rate 0, so enabling the knob is the only thing that shifts the RNG stream.
        rate = self.faults.fail_rate
        return rate > 0 and self._rng.random() < rate

    def _plan(self, gen: GenerationRequest) -> AnswerPlan:
        """Fix the whole answer at arrival, so it depends only on seed and arrival order."""
        mode, rng = self.config.output_mode, self._rng
        lengths = [output_tokens(mode, gen.max_tokens, gen.min_tokens, rng)]
        text_seed = rng.getrandbits(128)  # drawn here, so one sequence draws as it always did
        lengths += [output_tokens(mode, gen.max_tokens, gen.min_tokens, rng)
                    for _ in range(gen.sequences - 1)]  # fmt: skip
        words = random.Random(text_seed)
        prefix = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}[gen.kind]
        return AnswerPlan(
            gen=gen,
            id=f"{prefix}{text_seed:032x}",
            created=int(time.time()),
            sequences=tuple(_text(words.choices(_WORDS, k=k)) for k in lengths),
        )

    async def _run(
        self, rec: RequestRecord, plan: AnswerPlan, emit: Callable[[int, str], Awaitable[None]]
    ) -> None:
        """Wait for batch slots (one per sequence), prefill (yields each sequence's first
        token), then decode one token of every unfinished sequence per step."""
        cfg = self.config
        async with self._batch_slot(rec, len(plan.sequences)):
            await asyncio.sleep(cfg.prefill_seconds(plan.gen.prompt_tokens))
            owed = 0.0  # decode time not slept yet: tokens faster than the loop's tick go together
            for step in range(max(map(len, plan.sequences))):
                if step:
                    owed += cfg.decode_interval(self.stats.running)
                    if owed >= MIN_SLEEP_S:
                        await asyncio.sleep(owed)
                        owed = 0.0
                if step == self.faults.die_after_tokens:
                    raise _InjectedDeath
                for index, sequence in enumerate(plan.sequences):
                    if step < len(sequence):
                        await emit(index, sequence[step])
                        rec.completion_tokens += 1
                        self.stats.completion_tokens += 1

    @contextlib.asynccontextmanager
    async def _batch_slot(self, rec: RequestRecord, sequences: int) -> AsyncIterator[None]:
        """Hold a place of max_num_seqs per sequence (at most all of them), queueing FIFO for
        them; keeps the gauges, which count sequences, exact."""
        stats = self.stats
        places = min(sequences, self.config.max_num_seqs)
        stats.waiting += places
        stats.max_concurrent = max(stats.max_concurrent, stats.waiting + stats.running)
        try:
            await self._engine_running.wait()
            await self._slots.acquire(places)
        finally:
            stats.waiting -= places
        stats.running += places
        rec.started_at = time.monotonic()
        try:
            yield
        finally:
            stats.running -= places
            self._slots.release(places)


def _text(words: list[str]) -> tuple[str, ...]:
    """One token per word, each after the first with its leading space."""
    return tuple(w if i == 0 else " " + w for i, w in enumerate(words))


# --------------------------------------------------------------------- CLI


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``sim-backend``: run a simulated vLLM server until SIGINT/SIGTERM."""
    d = SimConfig()
    p = subparsers.add_parser(
        "sim-backend",
        help="run a simulated vLLM (OpenAI-compatible) server",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--model",
        dest="models",
        action="append",
        help=f"served model name, repeatable (default: {DEFAULT_MODEL})",
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    p.add_argument("--decode-tokens-per-s", type=float, default=d.decode_tokens_per_s)
    p.add_argument("--batch-slowdown", type=float, default=d.batch_slowdown)
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--output-mode", choices=("max", "random", "min_tokens"), default=d.output_mode)
    p.add_argument(
        "--default-max-tokens",
        type=_max_tokens_arg,
        default=d.default_max_tokens,
        help="output of a request that sets no max_tokens: a number, or 'context' for the rest "
        "of the context window, as vLLM does",
    )
    p.add_argument(
        "--tokens-per-message",
        type=int,
        default=d.tokens_per_message,
        help="prompt tokens the chat template adds per message",
    )
    for kind, name in _MEDIA_FIELDS.items():
        p.add_argument(
            f"--{kind}-tokens",
            dest=name,
            type=int,
            default=getattr(d, name),
            help=f"prompt tokens of a {kind} part whose size cannot be read",
        )
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=run_from_args)


def _max_tokens_arg(value: str) -> int | None:
    """``--default-max-tokens``: a positive number, or ``context`` (None)."""
    if value == "context":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number or 'context'") from None


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``sim-backend``; blocks until SIGINT/SIGTERM, returns the exit code."""
    config = SimConfig(
        models=args.models or (DEFAULT_MODEL,),
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        batch_slowdown=args.batch_slowdown,
        time_scale=args.time_scale,
        output_mode=args.output_mode,
        seed=args.seed,
        default_max_tokens=args.default_max_tokens,
        tokens_per_message=args.tokens_per_message,
        **{name: getattr(args, name) for name in _MEDIA_FIELDS.values()},
    )
    run(lambda: _serve_until_signal(config, args.host, args.port))
    return 0


async def _serve_until_signal(config: SimConfig, host: str, port: int) -> None:
    sim = SimBackend(config)
    url = await sim.start(host, port)
    print(f"sim-backend serving {', '.join(config.models)} at {url}", flush=True)
    try:
        await wait_for_signal()
    finally:
        await sim.stop()
