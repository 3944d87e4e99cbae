"""W3C Trace Context (http/trace_context.py): which traceparent goes upstream, and its id."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from sfq_proxy.http.trace_context import trace_context

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
VALID = f"00-{TRACE}-00f067aa0ba902b7-01"


def headers(*pairs: tuple[str, str]) -> CIMultiDict[str]:
    return CIMultiDict(pairs)


def test_a_valid_traceparent_goes_upstream_unchanged_with_its_tracestate() -> None:
    got = trace_context(headers(("traceparent", VALID), ("tracestate", "rojo=00f067aa0ba902b7")))
    assert got == (TRACE, {"traceparent": VALID, "tracestate": "rojo=00f067aa0ba902b7"})
    assert trace_context(headers(("TraceParent", VALID))) == (TRACE, {"traceparent": VALID})


def test_several_tracestate_fields_are_one_list() -> None:
    got = trace_context(
        headers(("traceparent", VALID), ("tracestate", "a=1"), ("tracestate", "b=2"))
    )
    assert got[1]["tracestate"] == "a=1,b=2"


@pytest.mark.parametrize(
    "value",
    [
        f"01-{TRACE}-00f067aa0ba902b7-01-what-comes-later",  # a later version may add fields
        f"cc-{TRACE}-00f067aa0ba902b7-00",
    ],
)
def test_a_later_version_is_passed_on_as_it_is(value: str) -> None:
    assert trace_context(headers(("traceparent", value))) == (TRACE, {"traceparent": value})


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        VALID.upper(),  # hex is lowercase
        f"ff-{TRACE}-00f067aa0ba902b7-01",  # version ff is invalid
        f"00-{TRACE}-00f067aa0ba902b7-01-extra",  # version 00 has four fields exactly
        f"00-{'0' * 32}-00f067aa0ba902b7-01",  # an all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # an all-zero parent id
        f"00-{TRACE[:-1]}-00f067aa0ba902b7-01",
        f"00-{TRACE}-00f067aa0ba902b7-1",
        f" {VALID}x",
    ],
)
def test_an_invalid_traceparent_is_dropped_with_its_tracestate(value: str) -> None:
    assert trace_context(headers(("traceparent", value), ("tracestate", "a=1"))) == (None, {})


def test_two_traceparents_are_none_and_a_tracestate_alone_is_nothing() -> None:
    assert trace_context(headers(("traceparent", VALID), ("traceparent", VALID))) == (None, {})
    assert trace_context(headers(("tracestate", "a=1"))) == (None, {})
    assert trace_context(headers()) == (None, {})


@pytest.mark.parametrize("state", ["a=1\x00", "a=" + "x" * 9000, "a=é"])
def test_a_tracestate_that_is_no_header_text_or_too_long_is_left_out(state: str) -> None:
    assert trace_context(headers(("traceparent", VALID), ("tracestate", state))) == (
        TRACE,
        {"traceparent": VALID},
    )


def test_a_tracestate_of_more_than_32_members_is_left_out() -> None:
    """W3C's limit: past it, OpenTelemetry's parsing of each member would cost the event loop
    (~0.44 ms for 1,000) before the key is even read."""
    thirty_two = ",".join(f"k{i}=v" for i in range(32))
    assert trace_context(headers(("traceparent", VALID), ("tracestate", thirty_two))) == (
        TRACE,
        {"traceparent": VALID, "tracestate": thirty_two},
    )
    for state in [thirty_two + ",k32=v", ",".join(["a=1"] * 1000), "a=1" + "," * 40]:
        assert trace_context(headers(("traceparent", VALID), ("tracestate", state))) == (
            TRACE,
            {"traceparent": VALID},
        )
    split = [("tracestate", f"k{i}=v") for i in range(33)]  # across fields, one list
    assert trace_context(headers(("traceparent", VALID), *split)) == (TRACE, {"traceparent": VALID})
