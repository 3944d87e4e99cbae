"""W3C Trace Context (https://www.w3.org/TR/trace-context/): a client's ``traceparent`` and
``tracestate`` go upstream unchanged when the ``traceparent`` is valid, so that a trace
spans the proxy's hop; an invalid one is dropped with its ``tracestate``, as the standard
says a vendor must not guess at a header it cannot parse. The access log records the trace
id (docs/design.md §8, §9). With tracing on, the proxy's own span continues this context,
and its context goes upstream in the client's place (observability/tracing.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from multidict import MultiMapping

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# version-traceid-parentid-flags, lowercase hex; a later version may add fields after a "-"
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_INVALID_TRACE = "0" * 32
_INVALID_PARENT = "0" * 16
# a tracestate holds at most 32 list members of printable ASCII; more than this is no
# tracestate a vendor is bound to pass on (it must pass 512 characters). Past 32 members
# OpenTelemetry's parsing would cost the event loop per member (~0.44 ms for 1,000), before
# the key is read: a list of more elements than 32 (empty ones counted) is dropped unparsed
_MAX_TRACESTATE = 8192
_MAX_MEMBERS = 32
_TRACESTATE = re.compile(r"[\x20-\x7e\t]*")


NO_TRACE: tuple[str | None, Mapping[str, str]] = (None, {})


def trace_context(headers: MultiMapping[str]) -> tuple[str | None, Mapping[str, str]]:
    """The trace id (32 hex digits) of the request's valid ``traceparent``, and the headers
    to send upstream (``traceparent``, and ``tracestate`` when there is a sane one); None
    and nothing when there is no valid ``traceparent``."""
    if headers.get(TRACEPARENT) is None:  # the common case: one lookup
        return NO_TRACE
    values = headers.getall(TRACEPARENT, [])
    if len(values) != 1:  # two traceparents: which one is meant cannot be known
        return NO_TRACE
    value = values[0]
    found = _TRACEPARENT.fullmatch(value)
    if found is None:
        return NO_TRACE
    version, trace_id, parent_id, _flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return NO_TRACE
    if trace_id == _INVALID_TRACE or parent_id == _INVALID_PARENT:
        return NO_TRACE
    upstream = {TRACEPARENT: value}
    states = headers.getall(TRACESTATE, [])
    if states:
        state = ",".join(states)  # several tracestate fields are one list (RFC 9110 §5.3)
        if (
            len(state) <= _MAX_TRACESTATE
            and state.count(",") < _MAX_MEMBERS
            and _TRACESTATE.fullmatch(state)
        ):
            upstream[TRACESTATE] = state
    return trace_id, upstream
