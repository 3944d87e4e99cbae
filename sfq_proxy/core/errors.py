"""OpenAI-style errors: every rejection the proxy makes is one of these (docs/design.md §6).

Plain data: the HTTP shell renders them (``sfq_proxy.http.error_response``).
"""

from __future__ import annotations

import math
from typing import Any

_TYPES = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_encoding"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    502: ("upstream_error", "bad_gateway"),
    503: ("service_unavailable", "no_healthy_backend"),
    504: ("timeout_error", "deadline_exceeded"),
}


# Why a request was refused, for the metrics; an error without one is a failure to serve.
_REASONS = {400: "invalid", 401: "auth", 403: "auth", 404: "invalid", 405: "invalid",
            409: "invalid", 413: "invalid", 415: "invalid", 503: "no_backend"}  # fmt: skip
_REASONS_BY_CODE = {"rate_limited": "rate", "queue_full": "queue_full",
                    "queue_age": "queue_age", "deadline": "deadline"}  # fmt: skip


class ApiError(Exception):
    """A rejection with its HTTP status; ``code`` refines the reason (e.g. ``queue_full``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type, default_code = _TYPES.get(status, ("api_error", "error"))
        self.code = code or default_code
        self.retry_after = retry_after

    @property
    def reason(self) -> str | None:
        """The rejection reason (auth, rate, queue_full, …), or None for a failure."""
        return _REASONS_BY_CODE.get(self.code) or _REASONS.get(self.status)

    def headers(self) -> dict[str, str]:
        """Every 429 and 503 says when to come back: 1 s unless the wait is known."""
        retry_after = self.retry_after
        if retry_after is None and self.status in (429, 503):
            retry_after = 1.0
        if retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(retry_after)))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}
