"""One line per finished inference request: JSON lines, or ``key=value`` text on a terminal.

A line says who (org, class, pool), what (model, backend, status, outcome), how much
(estimated cost, tokens used) and how long (queue wait, upstream time) — never a prompt,
never a key.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import dataclass, fields
from typing import IO, Any

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
    # why it was not completed: a rejection's reason (rate, deadline, …), or the code of a
    # failure's error (upstream_timeout, upstream_cut, deadline, bad_gateway, internal_error)
    reason: str | None = None
    cost: float | None = None  # charged (the estimate)
    cost_actual: float | None = None  # the same formula on the usage reported
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
        # an id need not be secret, only unique: no system call for it on the hot path
        return cls(request_id=given if ok else f"{random.getrandbits(128):032x}")

    def emit(self) -> None:
        if _sink is not None:  # on the hot path: build nothing nobody prints
            _sink.write({name: getattr(self, attr) for name, attr in _FIELDS})


_FIELDS = [(f.name if f.name != "cls" else "class", f.name) for f in fields(AccessRecord)]


class _Sink:
    """Lines finished in one turn of the event loop leave in one write.

    Not ``logging``: its records, handler lock and flush per line cost more than the rest
    of the access log on a proxy's hot path. Nothing is held back once the loop turns.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._format = _text if stream.isatty() else _to_json
        self._lines: list[str] = []

    def write(self, fields: dict[str, Any]) -> None:
        if not self._lines:
            asyncio.get_running_loop().call_soon(self.flush)
        self._lines.append(self._format(fields))

    def flush(self) -> None:
        if self._lines:
            self._stream.write("\n".join(self._lines) + "\n")
            self._lines.clear()
            self._stream.flush()


_to_json = json.JSONEncoder(check_circular=False).encode  # flat fields: no cycle to look for


def _text(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


_sink: _Sink | None = None


def configure(stream: IO[str] | None = sys.stdout) -> None:
    """Send access lines to ``stream`` (JSON lines, or text on a terminal); None: nowhere."""
    global _sink
    if _sink is not None:
        _sink.flush()
    _sink = None if stream is None else _Sink(stream)
