"""OpenAI-style errors: every rejection the proxy makes is one of these (docs/design.md §6).

Plain data: the HTTP shell renders them (``sfq_proxy.http.error_response``).

A message may quote what the client sent (its model, its class header, a path), and a
client can send megabytes: :func:`cut` is what every quotation of a client's value goes
through, in an error and in a log line alike, so that nothing a client sends comes back or
reaches a log unbounded (docs/design.md §6, Errors). A message is also bounded as a whole
(``MAX_MESSAGE_CHARS``), for a quotation that did not go through it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_encoding"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    502: ("upstream_error", "bad_gateway"),
    503: ("service_unavailable", "no_healthy_backend"),
    504: ("timeout_error", "deadline_exceeded"),
}

CUT_CHARS = 256  # what is kept of a value a client sent, when it is quoted
MAX_MESSAGE_CHARS = 4096  # an error's whole message: the proxy's own run to a few hundred


def cut(value: str, limit: int = CUT_CHARS) -> str:
    """``value`` as it may be quoted: whole up to ``limit`` characters, else its first
    ``limit`` and how long it was, ``…(cut, 5242880 chars)``. A short value is returned as
    it is (one ``len``): it runs on every access line."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}…(cut, {len(value)} chars)"


# The code of a 429 names the limit that refused it (docs/design.md §6, Errors): the org's
# or the pool's requests (``rpm``) or tokens (``tpm``) per minute, the flow's queue
# (``queue_full``), the class's wait (``queue_age``), an org's or key's spend budget
# (``budget_exceeded``, docs/usage-and-budgets.md).
LIMIT_CODES = ("rpm", "tpm", "queue_full", "queue_age", "budget_exceeded")

# Why a request was refused, for the metrics; an error without one is a failure to serve.
_REASONS = {400: "invalid", 401: "auth", 403: "auth", 404: "invalid", 405: "invalid",
            409: "invalid", 413: "invalid", 415: "invalid", 503: "no_backend"}  # fmt: skip
_REASONS_BY_CODE = {"rpm": "rate", "tpm": "rate", "queue_full": "queue_full",
                    "queue_age": "queue_age", "deadline": "deadline", "budget_exceeded": "budget",
                    "shutting_down": "shutting_down", "request_timeout": "slow_client"}  # fmt: skip


class ApiError(Exception):
    """A rejection with its HTTP status; ``code`` refines the reason (e.g. ``queue_full``);
    ``headers`` are sent with it (a 429's ``x-ratelimit-*``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type, default_code = _TYPES.get(status, ("api_error", "error"))
        self.code = code or default_code
        self.retry_after = retry_after
        self.extra_headers: dict[str, str] = dict(headers or {})

    @property
    def reason(self) -> str | None:
        """The rejection reason (auth, rate, queue_full, …), or None for a failure."""
        return _REASONS_BY_CODE.get(self.code) or _REASONS.get(self.status)

    def headers(self) -> dict[str, str]:
        """Its own headers; every 429 and 503 also says when to come back: 1 s unless the
        wait is known."""
        headers = dict(self.extra_headers)
        retry_after = self.retry_after
        if retry_after is None and self.status in (429, 503):
            retry_after = 1.0
        if retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        return headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


@dataclass(frozen=True, slots=True)
class Expiry:
    """What a request is answered when one of its time bounds passes. Made once per bound
    (a class's limit, a client's timeout), the error itself only when it is raised: most
    requests never expire, and an exception made for each of their bounds costs more than
    the rest of their bookkeeping."""

    status: int
    message: str
    code: str | None = None

    def error(self) -> ApiError:
        """A fresh error to raise (an exception raised is changed: traceback, headers)."""
        return ApiError(self.status, self.message, code=self.code)
