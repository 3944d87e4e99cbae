"""The body a backend is sent: the client's bytes, changed only where the proxy must
(docs/design.md §5 Relay). No I/O.

- A stream is made to ask for its usage chunk (``stream_options``) when the client did not:
  calibration and the bill need its counts (§4).
- A vLLM pool's ``priority`` orders its engine's queue, and a request of a lower value may
  preempt running ones: it is the proxy's to set, from the request's class
  (``classes.<c>.engine_priority``), so a client's own is taken out as the body is read.
- Its output is bounded to what it was charged for (``max_tokens``, §4).

Each is done in the cheapest way the body allows. In the common case a member is appended
to the client's bytes (no JSON written again); the body is written again, once, from what
parsing read, only where a member it already has must change. Never is a member sent twice:
servers differ on which of two of the same name wins.
"""

from __future__ import annotations

import json
from typing import Any

from ..config import Kind
from .errors import ApiError

ENGINE_PRIORITY = "priority"  # vLLM's request field (an int64; lower is served first)
OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens")  # the first one set is charged
RESPONSES_OUTPUT_FIELD = "max_output_tokens"  # the Responses API's only one
_USAGE = b'{"include_usage":true}'
_CONTINUOUS_USAGE = b'{"include_usage":true,"continuous_usage_stats":true}'


def output_fields(kind: Kind) -> tuple[str, ...]:
    """The body's fields that bound a request's output, the one charged first."""
    return (RESPONSES_OUTPUT_FIELD,) if kind is Kind.RESPONSES else OUTPUT_FIELDS


def usage_options(
    body: dict[str, Any], continuous: bool = False
) -> tuple[dict[str, Any] | None, bool]:
    """The ``stream_options`` a stream must be sent with to get its usage chunk (None: the
    body's own do), and whether that chunk is to be taken out of what the client gets (it
    did not ask for it). ``continuous``: ask for vLLM's usage on every chunk too
    (``continuous_usage_stats``), the counts so far of a stream whose client leaves; those
    chunks reach the client."""
    if not body.get("stream"):
        return None, False
    options = stream_options(body) or {}
    asked = options.get("include_usage") is True
    if asked and (not continuous or options.get("continuous_usage_stats") is True):
        return None, False
    added: dict[str, bool] = {"include_usage": True}
    if continuous:
        added["continuous_usage_stats"] = True
    return {**options, **added}, not asked


def stream_options(body: dict[str, Any]) -> dict[str, Any] | None:
    """A stream's ``stream_options``, which must be an object whose ``include_usage`` is a
    boolean (or null): a server reads the string "false" as false (pydantic's lax mode) and
    sends no usage chunk, while a truthy string would pass here for one asked for, and the
    stream would be billed no tokens."""
    options = body.get("stream_options")
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object.")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):  # 0 == False: test the type
        raise ApiError(400, "'stream_options.include_usage' must be a boolean.")
    return options


def upstream(
    body: dict[str, Any], raw: bytes, options: dict[str, Any] | None, own_priority: bool
) -> bytes:
    """``raw`` (read as ``body``) as a backend is sent it before its class is known: with
    the ``stream_options`` of :func:`usage_options` (None: unchanged), and without the
    client's ``priority`` when the pool's engine takes it (``own_priority``)."""
    if own_priority and ENGINE_PRIORITY in body:  # a client that tried: written once more
        body = {name: value for name, value in body.items() if name != ENGINE_PRIORITY}
        return dumps(body if options is None else {**body, "stream_options": options})
    if options is None:
        return raw
    if "stream_options" not in body:  # the common case: add the member, leave the bytes be
        member = _CONTINUOUS_USAGE if options.get("continuous_usage_stats") else _USAGE
        return raw.rstrip()[:-1] + b',"stream_options":' + member + b"}"
    return dumps({**body, "stream_options": options})


def appended(raw: bytes, name: str, value: int) -> bytes:
    """``raw``, a JSON object that has no member ``name``, with ``"name": value`` added at
    its end: the client's bytes stay as they were."""
    return raw.rstrip()[:-1] + f',"{name}":{value}}}'.encode()


def output_limited(raw: bytes, per_choice: int, field: str, fields: tuple[str, ...]) -> bytes:
    """``raw`` with every token field of ``fields`` it sets (else ``field``) at
    ``per_choice``, and those it sends as null left out: null means unset, and a server that
    reads both names as one field (TGI) refuses a body naming it twice."""
    body = json.loads(raw)
    names = [name for name in fields if body.get(name) is not None] or [field]
    for name in fields:
        if name in body and body[name] is None:
            del body[name]
    return dumps({**body, **dict.fromkeys(names, per_choice)})


def dumps(body: dict[str, Any]) -> bytes:
    """A body the proxy had to change, as compact JSON text."""
    try:  # 1e400 was read as infinity, which JSON cannot write back
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise ApiError(400, "The body holds a number out of range.") from None
    return text.encode()
