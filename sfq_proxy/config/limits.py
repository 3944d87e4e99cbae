"""The ``limits:`` section: what a client may send and hold before and while its request is
read and parsed, and the memory the process may spend on requests waiting in its lines
(docs/design.md §6).

The constants the section's defaults and checks are made of are defined here and used by
the core: the caps on a request's structure and on its ``max_tokens`` (core/inference_request.py
parses within them), and what a waiting request costs the process (core/queue_memory.py
counts it). The config is the lowest layer and needs nothing of the core.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from .fields import NonNegativeSeconds, Seconds, StrictModel

MIB = 1024 * 1024
# What a request waiting in line costs the process besides its body: aiohttp's parsed
# request, connection and handler task (12.9 KiB), the proxy's own frames, ticket and queue
# entry (2 KiB): 15.1 KiB measured (docs/performance.md), rounded up.
REQUEST_OVERHEAD_BYTES = 16 * 1024
MAX_OUTPUT_TOKENS = 10_000_000
"""The most ``max_tokens`` a request may ask for: beyond any model's context, and small
enough that no charge derived from it can overflow the fair queue's meters."""
MAX_MESSAGES = 2_000
"""The most messages (a chat's ``messages``, a Responses API request's ``input`` items) a
request may have by default (config ``limits.max_messages``): 2,000 turns are more than any
context in use holds, and a body of 10 MiB may hold 300,000 (docs/design.md §6)."""
MAX_CONTENT_PARTS = 10_000
"""The most content parts, over all of a request's messages, by default (config
``limits.max_content_parts``): 20 times the 500 images OpenAI takes in one request."""
MAX_TOOLS = 512
"""The most tool definitions (``tools`` and the legacy ``functions`` together) a request
may have by default (config ``limits.max_tools``): 4 times the 128 OpenAI takes."""


class Limits(StrictModel):
    """Request limits enforced before a request is parsed (413 above the body size) and as
    soon as its body is read (400 beyond the caps on its structure), where it is parsed,
    the memory this process may spend on requests waiting in its lines (design.md §6), and
    what a client may hold while its request is read: connections, and the time its head
    and body take (design.md §6, Slow senders)."""

    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0, le=1 << 30)
    queue_memory_mb: int = Field(512, ge=1, le=1 << 20)
    # None: what the file descriptors allow (http/connections.py); per peer, half of that
    max_connections: int | None = Field(None, gt=0, le=1 << 24)
    max_connections_per_peer: int | None = Field(None, gt=0, le=1 << 24)
    header_timeout_s: Seconds = 10.0
    body_timeout_s: Seconds = 30.0
    body_grace_s: NonNegativeSeconds = 5.0
    min_body_kib_per_s: float = Field(32.0, ge=0, le=1 << 20, allow_inf_nan=False)  # 0: off
    max_messages: int = Field(MAX_MESSAGES, gt=0, le=1_000_000)
    max_content_parts: int = Field(MAX_CONTENT_PARTS, gt=0, le=1_000_000)
    max_tools: int = Field(MAX_TOOLS, gt=0, le=1_000_000)
    # the largest body parsed on the event loop; a larger one is parsed in a worker process
    parse_in_loop_bytes: int = Field(16 * 1024, ge=0, le=1 << 30)
    # what the proxy holds of one answer for a client slower than its backend (design.md §5)
    answer_buffer_mb: int = Field(32, ge=1, le=1 << 16)

    @model_validator(mode="after")
    def _one_request_fits(self) -> Self:
        """A body of ``max_body_bytes`` (held twice: as read and as rewritten) must fit, or
        such a request could never wait."""
        fits = -(-(2 * self.max_body_bytes + REQUEST_OVERHEAD_BYTES) // MIB)
        if self.queue_memory_mb < fits:
            raise ValueError(
                f"queue_memory_mb must be at least {fits} to hold one request of "
                "max_body_bytes (counted twice, as read and as rewritten, plus 16 KiB)"
            )
        return self

    @property
    def queue_memory_bytes(self) -> int:
        return self.queue_memory_mb * MIB

    @property
    def answer_buffer_bytes(self) -> int:
        return self.answer_buffer_mb * MIB
