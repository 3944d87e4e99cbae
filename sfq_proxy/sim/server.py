"""A simulated vLLM server: faults, sockets and timing around the engine model
(``engine.py``: its speeds, and its scheduler's batch, queue and KV cache) and the OpenAI API
shapes (``api.py``).

The proxy's demo and end-to-end tests need a backend that looks like vLLM *from a load
balancer's point of view*: same endpoints and JSON shapes, a bounded batch
(``max_num_seqs``) and KV cache (``kv_cache_tokens``) with the engine's own waiting queue
behind them (FCFS, or by the request's ``priority``), preemption when the cache runs out,
vLLM's scheduler metrics on ``/metrics``, prefill and per-token decode latency that grows
with batch size, client disconnects aborting work, and fault knobs.  No GPU, no model: the
"generated" text is a seeded pseudo-random word sequence, one word per token, so a run is
reproducible.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any

from aiohttp import web

from .api import (
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
from .engine import (
    Changes,
    EngineRequest,
    output_tokens,
)
from .settings import (
    MIN_SLEEP_S,
    WORDS,
    Faults,
    Outcome,
    RequestRecord,
    SimConfig,
    SimStats,
)

__all__ = ["SimBackend"]


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
        # the engine's scheduler, and per request in it the event its coroutine waits on
        # for a place in the batch (set while it has one)
        self._engine = self.config.engine.scheduler(self.config.max_num_seqs)
        self._in_batch: dict[EngineRequest, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._busy: set[object] = set()  # aiohttp protocols (connections) handling a request
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._host = "127.0.0.1"
        self._port = 0

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
        self._engine.hold()

    def release(self) -> None:
        """Let the held requests take batch slots, in the engine's order."""
        self._apply(self._engine.release())

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
                web.get("/props", self._props),
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
        """vLLM's scheduler metrics, labelled as vLLM labels them (``engine="0"`` and the
        first served model name): the batch, the engine's queue (every request accepted and
        not in the batch: waiting for room, held, or preempted), the KV cache in use, the
        preemptions, and the prompt and generated tokens. The faults may delay it, or make
        it another status (an engine whose metrics are broken or gone)."""
        if self.faults.metrics_delay_s:
            await asyncio.sleep(self.faults.metrics_delay_s)
        if self.faults.metrics_status != 200:
            return error_response(self.faults.metrics_status, "Injected failure (metrics)")
        if self.config.metrics_format == "llama-server":
            return _exposition(self._llamacpp_series(), "")
        label = f'engine="0",model_name="{self.config.models[0]}"'
        s = self.stats
        series: list[Series] = [
            ("vllm:num_requests_running", "gauge",
             "Number of requests in model execution batches.", [("", s.running)]),
            ("vllm:num_requests_waiting", "gauge",
             "Number of requests waiting to be processed.", [("", s.waiting)]),
            ("vllm:num_requests_waiting_by_reason", "gauge",
             "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
             "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA "
             "budget, KV transfer, blocked status). Sum of all reasons equals "
             "vllm:num_requests_waiting.",
             [(',reason="capacity"', s.waiting), (',reason="deferred"', 0)]),
            ("vllm:kv_cache_usage_perc", "gauge",
             "KV-cache usage. 1 means 100 percent usage.", [("", self._kv_usage())]),
            ("vllm:num_preemptions_total", "counter",
             "Cumulative number of preemption from the engine.", [("", s.preemptions)]),
            ("vllm:prompt_tokens_total", "counter",
             "Number of prefill tokens processed.", [("", s.prompt_tokens)]),
            ("vllm:generation_tokens_total", "counter",
             "Number of generation tokens processed.", [("", s.completion_tokens)]),
        ]  # fmt: skip
        return _exposition(series, label)

    def _llamacpp_series(self) -> list[Series]:
        """llama.cpp ``llama-server --metrics``'s scheduler gauges (tools/server/server.cpp):
        the slots processing a task, and the tasks deferred for want of a free slot."""
        s = self.stats
        return [
            ("llamacpp:requests_processing", "gauge",
             "Number of requests processing.", [("", s.running)]),
            ("llamacpp:requests_deferred", "gauge",
             "Number of requests deferred.", [("", s.waiting)]),
        ]  # fmt: skip

    async def _props(self, request: web.Request) -> web.Response:
        """llama-server's ``/props``: its slot count (``total_slots``), which engine dispatch
        reads as the capacity; a vLLM has no such route (404)."""
        if self.config.metrics_format != "llama-server":
            raise web.HTTPNotFound()
        if self.faults.metrics_delay_s:
            await asyncio.sleep(self.faults.metrics_delay_s)
        if self.faults.metrics_status != 200:
            return error_response(self.faults.metrics_status, "Injected failure (props)")
        return web.json_response(
            {"total_slots": self.config.max_num_seqs, "model_path": self.config.models[0]}
        )

    def _kv_usage(self) -> float:
        """The share of the KV cache in use; with an unlimited cache, of one sized for every
        sequence of the batch at a full context (which indeed never runs out)."""
        cfg = self.config
        return self.stats.kv_used / (cfg.kv_cache_tokens or cfg.max_num_seqs * cfg.max_model_len)

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
        if not self._engine.fits_alone(gen.prompt_tokens, gen.sequences * gen.max_tokens):
            return error_response(
                400,
                f"The {gen.sequences} sequences of this request may need {gen.prompt_tokens} + "
                f"{gen.sequences} x {gen.max_tokens} tokens of KV cache, more than its "
                f"{self.config.kv_cache_tokens} tokens.",
            )
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
            priority=gen.priority,
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
            sequences=tuple(_text(words.choices(WORDS, k=k)) for k in lengths),
        )

    async def _run(
        self, rec: RequestRecord, plan: AnswerPlan, emit: Callable[[int, str], Awaitable[None]]
    ) -> None:
        """Queue in the engine for a place in the batch (one per sequence), prefill (yields
        each sequence's first token), then decode one token of every unfinished sequence per
        step, each token taking KV cache.

        Preempted (the cache ran out, or a request of a smaller priority value needed the
        room), it waits in the queue again, then prefills its prompt and what it had
        generated and goes on where it stopped: its client sees nothing of it but time."""
        cfg = self.config
        lengths = [len(sequence) for sequence in plan.sequences]
        request = EngineRequest(
            rec.index,
            plan.gen.prompt_tokens,
            sum(lengths),
            places=min(len(lengths), cfg.max_num_seqs),
            priority=plan.gen.priority,
        )
        self._in_batch[request] = asyncio.Event()
        try:
            self._apply(self._engine.add(request))
            await self._generate_in_batch(rec, plan, request, emit)
        finally:
            del self._in_batch[request]
            self._apply(self._engine.remove(request))
            rec.preemptions = request.preemptions

    async def _generate_in_batch(
        self,
        rec: RequestRecord,
        plan: AnswerPlan,
        request: EngineRequest,
        emit: Callable[[int, str], Awaitable[None]],
    ) -> None:
        cfg = self.config
        in_batch = self._in_batch[request]
        lengths = [len(sequence) for sequence in plan.sequences]
        step = run = 0  # the next step to emit; the run (admission) it belongs to
        owed = 0.0  # decode time not slept yet: tokens faster than the loop's tick go together

        def preempted() -> bool:
            return not request.running or request.admissions != run

        while step < max(lengths):
            if preempted():  # (again) into the batch: prefill what its cache must hold
                await in_batch.wait()
                run, owed = request.admissions, 0.0
                if rec.started_at is None:
                    rec.started_at = time.monotonic()
                await asyncio.sleep(cfg.prefill_seconds(request.kv_tokens))
                if preempted():
                    continue
            elif step:
                owed += cfg.decode_interval(self.stats.running)
                if owed >= MIN_SLEEP_S:
                    await asyncio.sleep(owed)
                    owed = 0.0
                    if preempted():
                        continue
            if step == self.faults.die_after_tokens:
                raise _InjectedDeath
            self._apply(self._engine.grow(request, sum(step < n for n in lengths)))
            if preempted():  # no cache for this step's tokens: generated again later
                continue
            for index, sequence in enumerate(plan.sequences):
                if step < len(sequence):
                    await emit(index, sequence[step])
                    rec.completion_tokens += 1
                    self.stats.completion_tokens += 1
            step += 1

    def _apply(self, changes: Changes) -> None:
        """Tell the requests the engine moved, and update the gauges from it."""
        for request in changes.preempted:
            self._in_batch[request].clear()
        self.stats.preemptions += len(changes.preempted)
        for request in changes.admitted:
            self._in_batch[request].set()
        stats, engine = self.stats, self._engine
        stats.running, stats.waiting = engine.running_places, engine.waiting_places
        stats.kv_used = engine.kv_used
        stats.max_concurrent = max(stats.max_concurrent, stats.running + stats.waiting)


def _text(words: list[str]) -> tuple[str, ...]:
    """One token per word, each after the first with its leading space."""
    return tuple(w if i == 0 else " " + w for i, w in enumerate(words))


# a metric family as the exposition writes it: name, type, help, (labels, value) samples
Series = tuple[str, str, str, list[tuple[str, float]]]


def _exposition(series: list[Series], label: str) -> web.Response:
    """Prometheus's text format of ``series``, each sample labelled ``label`` and its own."""
    lines = []
    for name, kind, help_text, samples in series:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for extra, value in samples:
            tags = f"{{{label}{extra}}}" if label or extra else ""
            lines.append(f"{name}{tags} {float(value)}")
    return web.Response(
        body=("\n".join(lines) + "\n").encode(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )
