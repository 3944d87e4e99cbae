"""Errors as plain data (core/errors.py): what a rejection says, before any HTTP is involved."""

from __future__ import annotations

import pytest

from sfq_proxy.core.errors import CUT_CHARS, MAX_MESSAGE_CHARS, ApiError, cut


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


def test_cut_keeps_a_short_value_and_says_how_long_a_long_one_was() -> None:
    assert cut("gpt-4o") == "gpt-4o"
    assert cut("m" * CUT_CHARS) == "m" * CUT_CHARS
    assert cut("m" * (CUT_CHARS + 1)) == f"{'m' * CUT_CHARS}…(cut, {CUT_CHARS + 1} chars)"
    assert cut("abcdef", 2) == "ab…(cut, 6 chars)"


def test_an_error_message_is_bounded_whatever_it_quotes() -> None:
    """For a quotation that did not go through ``cut``: the message as a whole is."""
    quoting = f"The model '{'m' * 5_000_000}' is not served at /v1/rerank here."
    message = ApiError(404, quoting).body()["error"]["message"]
    assert message.startswith("The model 'mmm")
    assert message.endswith(f"…(cut, {len(quoting)} chars)")
    assert len(message) <= MAX_MESSAGE_CHARS + 30
    assert ApiError(400, "x" * MAX_MESSAGE_CHARS).message == "x" * MAX_MESSAGE_CHARS
