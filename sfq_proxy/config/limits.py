"""The ``limits:`` section: what a client may send and hold before and while its request is
read and parsed, and the memory the process may spend on requests waiting in its lines
(docs/design.md §6).
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from ..core.inference_request import DEFAULT_CAPS
from ..core.queue_memory import MIB, REQUEST_OVERHEAD_BYTES
from .fields import NonNegativeSeconds, Seconds, StrictModel


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
    max_messages: int = Field(DEFAULT_CAPS.max_messages, gt=0, le=1_000_000)
    max_content_parts: int = Field(DEFAULT_CAPS.max_content_parts, gt=0, le=1_000_000)
    max_tools: int = Field(DEFAULT_CAPS.max_tools, gt=0, le=1_000_000)
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
