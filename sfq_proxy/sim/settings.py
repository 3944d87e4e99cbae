"""What a simulated server is (its settings, ``SimConfig``), what can go wrong with it on
purpose (``Faults``), and what it counts (``RequestRecord``, ``SimStats``): the plain data the
server (``server.py``), its command (``command.py``), the lab and the tests share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from typing import Any, Literal

from .api import (
    DEFAULT_MEDIA_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
)
from .engine import (
    SCHEDULING_POLICIES,
    EngineModel,
    SchedulingPolicy,
)

Outcome = Literal["completed", "aborted", "failed"]
DEFAULT_MODEL = "sim-llama"
# Shorter decode steps are slept together: time-scaled runs would otherwise wake the event
# loop thousands of times a second and slow down the very clock they simulate.
MIN_SLEEP_S = 0.002
HTTP_STATUSES = frozenset(s.value for s in HTTPStatus)
WORDS = (
    "the", "model", "answers", "with", "plain", "words", "so", "that", "tests", "can",
    "count", "tokens", "easily", "while", "fair", "queueing", "keeps", "every", "user",
    "happy", "and", "latency", "stays", "low",
)  # fmt: skip


MEDIA_FIELDS = {kind: f"{kind}_tokens" for kind in DEFAULT_MEDIA_TOKENS}


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

    The engine's scheduler (``engine.EngineScheduler``): at most ``max_num_seqs`` sequences
    in the batch and ``kv_cache_tokens`` tokens of KV cache (None: a cache that never runs
    out, the default; else at least ``max_model_len``, as vLLM refuses to start with less),
    the rest waiting in its queue, in arrival order, or with ``scheduling_policy``
    ``priority`` by the request's ``priority`` (lower first). ``metrics_format`` says whose
    scheduler metrics it serves.
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
    kv_cache_tokens: int | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"
    # whose metrics ``/metrics`` serves: vLLM's, or llama.cpp ``llama-server``'s (then with
    # its ``/props``, whose ``total_slots`` is ``max_num_seqs``)
    metrics_format: Literal["vllm", "llama-server"] = "vllm"

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
        if self.metrics_format not in ("vllm", "llama-server"):
            raise ValueError("metrics_format must be 'vllm' or 'llama-server'")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        kv = self.kv_cache_tokens
        if kv is not None and kv < self.max_model_len:
            raise ValueError(
                "kv_cache_tokens must hold one request of max_model_len, or be None (unlimited)"
            )
        if self.default_max_tokens is not None and self.default_max_tokens <= 0:
            raise ValueError("default_max_tokens must be positive, or None (up to the context)")
        not_negative = ("batch_slowdown", "tokens_per_message", *MEDIA_FIELDS.values())
        for name in not_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def media_tokens(self) -> Mapping[str, int]:
        """What a non-text part whose size is unknown costs, by kind."""
        return {kind: getattr(self, name) for kind, name in MEDIA_FIELDS.items()}

    @property
    def engine(self) -> EngineModel:
        """The engine model (``sim/engine.py``), in unscaled seconds."""
        return EngineModel(
            self.prefill_tokens_per_s,
            self.decode_tokens_per_s,
            self.batch_slowdown,
            self.max_num_seqs,
            self.kv_cache_tokens,
            self.scheduling_policy,
        )

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
    # /metrics (and a llama-server's /props): its status (the engine's answer, or a broken
    # one) and how long it hangs first
    metrics_status: int = 200
    metrics_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("fail_rate must be within [0, 1]")
        for status in (self.fail_status, self.health_status, self.metrics_status):
            if not isinstance(status, int) or status < 200 or status not in HTTP_STATUSES:
                raise ValueError(f"{status!r} is not a final HTTP status code")
        die = self.die_after_tokens
        if die is not None and (not isinstance(die, int) or die < 0):
            raise ValueError("die_after_tokens must be None or an int >= 0")
        if not isinstance(self.refuse_connections, bool):
            raise ValueError("refuse_connections must be a bool")
        delay = self.metrics_delay_s
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay < 3600:
            raise ValueError("metrics_delay_s must be seconds in [0, 3600)")


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
    priority: int = 0  # the body's, as the priority policy orders by it
    started_at: float | None = None  # got a batch slot (None: failed or aborted while waiting)
    preemptions: int = 0  # times its cache was taken back and it waited again
    ended_at: float | None = None
    completion_tokens: int = 0  # generated, every sequence
    outcome: Outcome | None = None  # None while in flight


@dataclass
class SimStats:
    """Counters and per-request log; ``running``/``waiting`` (sequences in the batch, and in
    the engine's queue: accepted, not in the batch) and ``kv_used`` (tokens of KV cache) are
    live gauges."""

    requests_seen: int = 0
    completed: int = 0
    aborted: int = 0
    failed_injected: int = 0
    max_concurrent: int = 0
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    log: list[RequestRecord] = field(default_factory=list)

    def reset(self) -> None:
        """Zero everything but the live gauges; requests still in flight count when they end."""
        fresh = SimStats(
            running=self.running,
            waiting=self.waiting,
            kv_used=self.kv_used,
            max_concurrent=self.running + self.waiting,
        )
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))
