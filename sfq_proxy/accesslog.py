"""One line per finished inference request: JSON lines, or ``key=value`` text on a terminal.

A line says who (org, class, pool), what (model, backend, status, outcome), how much
(estimated cost, tokens used) and how long (queue wait, upstream time) — never a prompt,
never a key.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, fields
from typing import IO, Any

log = logging.getLogger("sfq_proxy.access")
REQUEST_ID_HEADER = "X-Request-Id"


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    org: str | None = None
    cls: str | None = None
    pool: str | None = None
    model: str | None = None
    backend: str | None = None
    status: int | None = None
    outcome: str | None = None
    cost: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    queue_wait_s: float = 0.0
    upstream_s: float | None = None
    retries: int = 0

    @classmethod
    def for_request(cls, headers: Any) -> AccessRecord:
        """Propagate the client's ``X-Request-Id`` (if sane) or make one."""
        given = headers.get(REQUEST_ID_HEADER, "")
        ok = 0 < len(given) <= 128 and given.isprintable()
        return cls(request_id=given if ok else os.urandom(16).hex())

    def emit(self) -> None:
        if log.isEnabledFor(logging.INFO):  # on the hot path: build nothing nobody prints
            fields = {name: getattr(self, attr) for name, attr in _FIELDS}
            log.info("access", extra={"access": fields})


_FIELDS = [(f.name if f.name != "cls" else "class", f.name) for f in fields(AccessRecord)]


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(getattr(record, "access", {"message": record.getMessage()}))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "access", {"message": record.getMessage()})
        return " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


def configure(stream: IO[str] = sys.stdout) -> None:
    """Send access lines to ``stream``: JSON lines, or text when it is a terminal."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_TextFormatter() if stream.isatty() else _JsonFormatter())
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
