"""The one toy engine model: what the simulated server sleeps and the lab's simulator counts.

A backend runs at most ``max_num_seqs`` sequences at once. A prompt takes
``input / prefill_tokens_per_s`` seconds (which also yields the first output token); each
further output token takes ``(1 + batch_slowdown × (running − 1)) / decode_tokens_per_s``
seconds, ``running`` being the sequences then decoding on that backend. How many tokens a
request generates is ``output_tokens``. Pure functions of their arguments: no clock, no I/O.

The simulated server (``sim/server.py``) applies the slowdown token by token with the live
batch size; the simulator (``lab/simulator.py``) fixes it when the request starts, from the
batch it joins (``service_seconds``), which keeps it exact and fast; the real-proxy run of
the lab measures the difference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

__all__ = ["OUTPUT_MODES", "EngineModel", "OutputMode", "output_tokens"]

OutputMode = Literal["max", "random", "min_tokens"]
OUTPUT_MODES: tuple[OutputMode, ...] = ("max", "random", "min_tokens")


@dataclass(frozen=True, slots=True)
class EngineModel:
    """The speeds of one backend, in scenario (unscaled) seconds."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    batch_slowdown: float = 0.0

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """A prompt's prefill, which also yields the first output token."""
        return prompt_tokens / self.prefill_tokens_per_s

    def slowdown(self, running: int) -> float:
        return 1.0 + self.batch_slowdown * max(running - 1, 0)

    def decode_interval(self, running: int) -> float:
        """Per-sequence time between two output tokens with ``running`` sequences batched."""
        return self.slowdown(running) / self.decode_tokens_per_s

    def service_seconds(self, prompt_tokens: int, output_tokens: int, running: int) -> float:
        """A request's time in its slot, at the batch size it started with."""
        return (
            self.prefill_seconds(prompt_tokens)
            + output_tokens * self.slowdown(running) / self.decode_tokens_per_s
        )


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
