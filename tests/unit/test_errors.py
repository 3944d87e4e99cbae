"""Errors as plain data (core/errors.py): what a rejection says, before any HTTP is involved."""

from __future__ import annotations

import pytest

from sfq_proxy.core.errors import ApiError


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [
        (400, "invalid_request_error", "invalid_request"),
        (401, "authentication_error", "invalid_api_key"),
        (413, "invalid_request_error", "request_too_large"),
        (415, "invalid_request_error", "unsupported_encoding"),
        (429, "rate_limit_error", "rate_limit_exceeded"),
        (500, "server_error", "internal_error"),
        (502, "upstream_error", "bad_gateway"),
        (503, "service_unavailable", "no_healthy_backend"),
    ],
)
def test_a_status_has_its_openai_type_and_default_code(status: int, kind: str, code: str) -> None:
    error = ApiError(status, "why")
    assert error.body() == {"error": {"message": "why", "type": kind, "code": code}}


@pytest.mark.parametrize(("status", "retry_after", "header"), [
    (429, None, "1"), (503, None, "1"), (429, 0.2, "1"), (429, 12.0, "12"), (503, 2.5, "3"),
    (400, None, None), (502, None, None), (409, None, None),
])  # fmt: skip
def test_every_429_and_503_says_when_to_come_back(
    status: int, retry_after: float | None, header: str | None
) -> None:
    headers = ApiError(status, "x", retry_after=retry_after).headers()
    assert headers.get("Retry-After") == header


@pytest.mark.parametrize(("status", "code", "reason"), [
    (429, "queue_full", "queue_full"), (429, "queue_age", "queue_age"),
    (429, "rpm", "rate"), (429, "tpm", "rate"), (504, "deadline", "deadline"), (401, None, "auth"),
    (400, "tokens_exceed_limit", "invalid"), (415, None, "invalid"), (503, None, "no_backend"),
    (503, "shutting_down", "shutting_down"),
    (502, None, None), (500, None, None), (504, "upstream_timeout", None),
])  # fmt: skip
def test_a_rejection_has_a_reason_and_a_failure_has_none(
    status: int, code: str | None, reason: str | None
) -> None:
    assert ApiError(status, "x", code=code).reason == reason


def test_an_errors_own_headers_go_with_it_and_retry_after_stays() -> None:
    limits = {"x-ratelimit-limit-requests": "5", "x-ratelimit-reset-requests": "12s"}
    error = ApiError(429, "x", code="rpm", retry_after=12.0, headers=limits)
    assert error.headers() == {**limits, "Retry-After": "12"}
    assert ApiError(404, "x", headers=limits).headers() == limits


def test_an_unknown_route_is_not_found_and_an_unknown_model_model_not_found() -> None:
    assert ApiError(404, "x", code="not_found").body()["error"]["code"] == "not_found"
    assert ApiError(404, "x").code == "model_not_found"
