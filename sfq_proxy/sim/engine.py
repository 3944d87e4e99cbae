"""The one toy engine model: what the simulated server sleeps and the lab's simulator counts.

Two parts, both pure (no clock, no I/O), so the server and the simulator cannot drift apart:

* ``EngineModel``: how long things take. A prompt takes ``input / prefill_tokens_per_s``
  seconds (which also yields the first output token); each further output token takes
  ``(1 + batch_slowdown × (running − 1)) / decode_tokens_per_s`` seconds, ``running`` being
  the sequences then decoding on that backend. How many tokens a request generates is
  ``output_tokens``.
* ``EngineScheduler``: who runs. vLLM's scheduler as a load balancer sees it: continuous
  batching of at most ``max_num_seqs`` sequences and ``kv_cache_tokens`` tokens of KV
  cache, the rest waiting in the engine's own queue, FCFS or by ``priority``, and
  preemption (recompute) when the cache runs out. A proxy that sends more than the batch
  holds only moves its queue into the engine's, where no fair queue orders it: the lab
  needs this to compare static slots with engine-gated dispatch.

The simulated server (``sim/server.py``) applies the slowdown token by token with the live
batch size; the simulator (``lab/simulator.py``) fixes it when the request starts, from the
batch it joins (``service_seconds``), which keeps it exact and fast; the real-proxy run of
the lab measures the difference. Both ask the same ``EngineScheduler`` who may run.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "OUTPUT_MODES",
    "SCHEDULING_POLICIES",
    "Changes",
    "EngineModel",
    "EngineRequest",
    "EngineScheduler",
    "OutputMode",
    "SchedulingPolicy",
    "output_tokens",
]

OutputMode = Literal["max", "random", "min_tokens"]
OUTPUT_MODES: tuple[OutputMode, ...] = ("max", "random", "min_tokens")
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
# vLLM's bounds of a request's ``priority`` (its pydantic field: ge/le the int64 range)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class EngineModel:
    """One backend's engine, in scenario (unscaled) seconds: its speeds, and its scheduler's
    limits (``scheduler()``). ``max_num_seqs`` None: as many as the proxy sends (the lab's
    default: the proxy's slots); ``kv_cache_tokens`` None: a cache that never runs out."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    batch_slowdown: float = 0.0
    max_num_seqs: int | None = None
    kv_cache_tokens: int | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """A prompt's prefill, which also yields the first output token."""
        return prompt_tokens / self.prefill_tokens_per_s

    def slowdown(self, running: int) -> float:
        return 1.0 + self.batch_slowdown * max(running - 1, 0)

    def decode_interval(self, running: int) -> float:
        """Per-sequence time between two output tokens with ``running`` sequences batched."""
        return self.slowdown(running) / self.decode_tokens_per_s

    def service_seconds(self, prompt_tokens: int, output_tokens: int, running: int) -> float:
        """A request's time in the batch, at the batch size it started with."""
        return (
            self.prefill_seconds(prompt_tokens)
            + output_tokens * self.slowdown(running) / self.decode_tokens_per_s
        )

    def scheduler(self, default_max_num_seqs: int) -> EngineScheduler:
        """A fresh, empty scheduler with this engine's limits (``default_max_num_seqs`` when
        it sets no ``max_num_seqs``)."""
        return EngineScheduler(
            self.max_num_seqs or default_max_num_seqs,
            self.kv_cache_tokens,
            self.scheduling_policy,
        )


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request as the engine's scheduler holds it.

    ``output_tokens``: what it will generate in all (every sequence), known up front in the
    simulation: a request whose prompt and output cannot fit in the cache even alone is
    refused (vLLM refuses to start with a cache smaller than one full context). ``places``:
    the sequences it runs at once (``n``, or ``best_of``), each one of ``max_num_seqs``.
    ``priority``: with the priority policy, lower is served first (vLLM's field). The rest
    is the scheduler's: ``generated`` tokens so far (in the cache while running; prefilled
    again, with the prompt, after a preemption), ``admissions`` (a new run each time: a
    caller compares it to know whether the run it started is still the one going on).
    """

    key: Hashable
    prompt_tokens: int
    output_tokens: int
    places: int = 1
    priority: int = 0
    order: int = field(default=0, init=False)  # arrival rank, set by EngineScheduler.add
    generated: int = field(default=0, init=False)
    running: bool = field(default=False, init=False)
    admissions: int = field(default=0, init=False)
    preemptions: int = field(default=0, init=False)

    @property
    def kv_tokens(self) -> int:
        """Its KV cache: the prompt and the tokens generated so far."""
        return self.prompt_tokens + self.generated


@dataclass(frozen=True, slots=True)
class Changes:
    """What a scheduler call did: the requests preempted (back to the queue), then the
    requests admitted into the batch, each in order. A request can be in both (preempted,
    then admitted again by the same call); never admitted and then preempted by one call."""

    preempted: tuple[EngineRequest, ...] = ()
    admitted: tuple[EngineRequest, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.preempted or self.admitted)


class EngineScheduler:
    """vLLM's scheduler (v1, ``--max-num-seqs``, the KV cache, ``--scheduling-policy``) as far
    as what leaves a load balancer's hands matters: who is in the batch, who waits, when.

    * A request arriving (``add``) waits in the engine's own queue: FCFS (arrival order), or
      with the priority policy by ``(priority, arrival)``. The head is admitted while the
      batch has room for its ``places`` (``max_num_seqs``) and the cache for its prompt and
      what it generated before (``kv_cache_tokens``); if the head does not fit, nothing
      behind it is admitted (head-of-line, as vLLM's scheduler breaks out of its waiting
      loop).
    * Each token generated takes one more token of cache (``grow``). When the cache is full,
      the newest running request (priority: the largest ``(priority, arrival)``) is
      preempted: its cache freed, it goes back to the queue (in its place: its arrival
      order or priority) and later prefills its prompt and the tokens it had generated
      again (vLLM's recompute). It may be the growing request itself. A preemption admits
      nothing (vLLM skips its waiting queue in a step that preempted).
    * With the priority policy, a head that does not fit preempts running requests of a
      larger priority value, the largest first, when that makes room for it (as vLLM's v0
      scheduler did, ``_schedule_priority_preemption``; v1 only preempts for the cache of
      a running request).
    * A request ends (``remove``: finished or aborted, running or waiting): its places and
      cache are freed and the queue's head admitted while it fits.
    * ``hold`` admits nothing until ``release`` (a test or bench stalling the engine).

    Cache is counted in tokens, not vLLM's 16-token blocks. ``kv_cache_tokens`` None: a
    cache that never runs out (the scheduler is then the FIFO of ``max_num_seqs`` slots the
    simulated server always had).
    """

    def __init__(
        self,
        max_num_seqs: int,
        kv_cache_tokens: int | None = None,
        policy: SchedulingPolicy = "fcfs",
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if kv_cache_tokens is not None and kv_cache_tokens < 1:
            raise ValueError("kv_cache_tokens must be positive, or None (unlimited)")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.policy: SchedulingPolicy = policy
        self.running_places = 0  # sequences in the batch
        self.waiting_places = 0  # sequences in the queue
        self.kv_used = 0  # tokens of cache held by the batch
        self.preemptions = 0  # since it started
        self.held = False
        self._running: list[EngineRequest] = []  # in admission order: the newest last
        self._waiting: list[EngineRequest] = []  # in service order: the head first
        self._orders = itertools.count()

    # -- what it holds

    @property
    def running(self) -> tuple[EngineRequest, ...]:
        """The batch, in admission order."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[EngineRequest, ...]:
        """The queue, head first."""
        return tuple(self._waiting)

    @property
    def kv_usage(self) -> float:
        """The share of the cache in use (vLLM's ``kv_cache_usage_perc``: 1.0 is full); 0.0
        for a cache that never runs out."""
        return self.kv_used / self.kv_cache_tokens if self.kv_cache_tokens else 0.0

    def fits_alone(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Whether a request of this size fits in the cache with nothing else running."""
        cap = self.kv_cache_tokens
        return cap is None or prompt_tokens + output_tokens <= cap

    # -- what happens to it

    def add(self, request: EngineRequest) -> Changes:
        """A request arrives: it queues, and whatever now fits is admitted."""
        if request.running or request in self._waiting:
            raise ValueError(f"request {request.key!r} is already in the engine")
        if not self.fits_alone(request.prompt_tokens, request.output_tokens):
            raise ValueError(
                f"request {request.key!r} needs {request.prompt_tokens + request.output_tokens}"
                f" tokens of KV cache, more than the {self.kv_cache_tokens} there are"
            )
        request.order = next(self._orders)
        self._enqueue(request)
        return self._admit()

    def grow(self, request: EngineRequest, tokens: int = 1) -> Changes:
        """``request`` (running) generated ``tokens`` more; they take cache. If the cache is
        full, running requests are preempted until they fit, or until ``request`` itself is
        (then its tokens were not generated: it generates them again after its re-prefill)."""
        if not request.running:
            raise ValueError(f"request {request.key!r} is not running")
        preempted = []
        cap = self.kv_cache_tokens
        while cap is not None and self.kv_used + tokens > cap:
            victim = self._victim(self._running)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return Changes(preempted=tuple(preempted))
        request.generated += tokens
        self.kv_used += tokens
        return Changes(preempted=tuple(preempted))

    def remove(self, request: EngineRequest) -> Changes:
        """``request`` ended (finished, or aborted while running or waiting): its places and
        cache are freed, and what now fits is admitted. A request not in the engine is
        ignored."""
        if request.running:
            self._running.remove(request)
            request.running = False
            self.running_places -= request.places
            self.kv_used -= request.kv_tokens
        elif request in self._waiting:
            self._waiting.remove(request)
            self.waiting_places -= request.places
        else:
            return Changes()
        return self._admit()

    def hold(self) -> None:
        """Admit nothing until ``release()``."""
        self.held = True

    def release(self) -> Changes:
        """Admit again, starting with what now fits."""
        self.held = False
        return self._admit()

    # -- how

    def _key(self, request: EngineRequest) -> tuple[int, int]:
        if self.policy == "priority":
            return (request.priority, request.order)
        return (0, request.order)

    def _enqueue(self, request: EngineRequest) -> None:
        """Into the queue in its place. FCFS: by arrival, so a preempted request goes back to
        the front (it arrived before everything that never ran: vLLM prepends it)."""
        bisect.insort(self._waiting, request, key=self._key)
        self.waiting_places += request.places

    def _victim(self, among: Iterable[EngineRequest]) -> EngineRequest:
        """Who is preempted first: the newest admitted, or the largest ``(priority,
        arrival)`` with the priority policy (vLLM's choices)."""
        if self.policy == "priority":
            return max(among, key=self._key)
        return list(among)[-1]

    def _preempt(self, request: EngineRequest) -> None:
        self._running.remove(request)
        request.running = False
        request.preemptions += 1
        self.preemptions += 1
        self.running_places -= request.places
        self.kv_used -= request.kv_tokens
        self._enqueue(request)

    def _fits(self, request: EngineRequest, places: int = 0, kv: int = 0) -> bool:
        """Whether ``request`` fits, with ``places`` and ``kv`` freed besides."""
        cap = self.kv_cache_tokens
        room = self.running_places - places + request.places <= self.max_num_seqs
        return room and (cap is None or self.kv_used - kv + request.kv_tokens <= cap)

    def _admit(self) -> Changes:
        preempted: list[EngineRequest] = []
        admitted: list[EngineRequest] = []
        while self._waiting and not self.held:
            head = self._waiting[0]
            if not self._fits(head) and not self._make_room(head, preempted):
                break
            self._waiting.pop(0)
            self.waiting_places -= head.places
            self._running.append(head)
            head.running = True
            head.admissions += 1
            self.running_places += head.places
            self.kv_used += head.kv_tokens
            admitted.append(head)
        return Changes(tuple(preempted), tuple(admitted))

    def _make_room(self, head: EngineRequest, preempted: list[EngineRequest]) -> bool:
        """With the priority policy, preempt running requests of a larger priority value than
        ``head``'s, the largest first, until ``head`` fits; only if preempting all of them
        would make it fit."""
        if self.policy != "priority":
            return False
        lower = [r for r in self._running if r.priority > head.priority]
        places = sum(r.places for r in lower)
        if not lower or not self._fits(head, places, sum(r.kv_tokens for r in lower)):
            return False
        while not self._fits(head):
            victim = self._victim(lower)
            lower.remove(victim)
            self._preempt(victim)
            preempted.append(victim)
        return True


def output_tokens(
    mode: OutputMode, max_tokens: int, min_tokens: int | None, rng: random.Random
) -> int:
    """How many tokens a request generates: ``max``: its ``max_tokens``; ``random``: a seeded
    draw in [1, max_tokens]; ``min_tokens``: its ``min_tokens`` if set (a model that stops
    right there; replays a scenario's or a trace's output lengths), else ``max_tokens``."""
    if mode == "random":
        return rng.randint(1, max_tokens)
    if mode == "min_tokens" and min_tokens:
        return min(min_tokens, max_tokens)
    return max_tokens
