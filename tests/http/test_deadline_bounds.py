"""A request's bounds: the smaller of its class's ``max_request_s`` and its client's
``X-Request-Timeout`` bounds its whole life; ``max_queue_age_s`` bounds its wait too."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sfq_proxy.config import ClassSpec
from sfq_proxy.http.handler import _bounds


def test_no_bound_bounds_nothing() -> None:
    bounds = _bounds(100.0, None, None, None)
    assert bounds.queue[0] is None
    assert bounds.life[0] is None


@pytest.mark.parametrize(
    ("max_request_s", "timeout", "at", "said"),
    [
        (10.0, None, 110.0, "max_request_s of 10 s"),
        (None, 5.0, 105.0, "X-Request-Timeout of 5 s"),
        (10.0, 5.0, 105.0, "X-Request-Timeout of 5 s"),  # the client shortens it
        (10.0, 50.0, 110.0, "max_request_s of 10 s"),  # but never lengthens it
    ],
)
def test_the_smaller_of_the_class_and_the_client_bounds_the_whole_life(
    max_request_s: float | None, timeout: float | None, at: float, said: str
) -> None:
    bounds = _bounds(100.0, None, max_request_s, timeout)
    life_at, life_error = bounds.life
    queue_at, queue_error = bounds.queue
    assert life_at == queue_at == at
    assert (life_error.status, life_error.code) == (504, "deadline")
    assert (queue_error.status, queue_error.code) == (504, "deadline")
    assert said in life_error.message
    assert said in queue_error.message
    assert life_error.error().reason == "deadline"


def test_each_expiry_raised_is_a_fresh_error() -> None:
    """The bounds of a class are made once and shared by its requests: what one request
    raises (and the handler adds its headers to) must never be what another raises."""
    first, second = _bounds(100.0, 3.0, 10.0, None), _bounds(200.0, 3.0, 10.0, None)
    assert first.queue[1] is second.queue[1]  # made once…
    raised = first.queue[1].error()
    raised.extra_headers["x-ratelimit-limit-requests"] = "1"
    again = second.queue[1].error()
    assert again is not raised  # …raised afresh
    assert again.extra_headers == {}
    assert (again.status, again.code, again.message) == (raised.status, raised.code, raised.message)


def test_the_queue_age_limit_bounds_the_wait_only() -> None:
    bounds = _bounds(100.0, 3.0, 10.0, None)
    assert bounds.queue[0] == 103.0
    assert bounds.queue[1].code == "queue_age"
    assert bounds.life[0] == 110.0
    later = _bounds(100.0, 30.0, 10.0, None)  # the life bound comes first: it ends the wait
    assert later.queue[0] == 110.0
    assert later.queue[1].code == "deadline"


def test_max_request_s_is_a_positive_duration() -> None:
    assert ClassSpec().max_request_s is None
    assert ClassSpec(max_request_s=600).max_request_s == 600
    for bad in (0, -1, 1e308, float("inf")):
        with pytest.raises(ValidationError):
            ClassSpec(max_request_s=bad)
