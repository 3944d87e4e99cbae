"""The body of an inference request, checked just enough to route and price it.

The proxy forwards the client's bytes unchanged; it parses them only to read ``model``,
``stream``, the text it is priced on and ``max_tokens``. Anything else is the backend's
business, and its own 400 passes through.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .errors import ApiError


class Kind(Enum):
    CHAT = "/v1/chat/completions"
    COMPLETION = "/v1/completions"
    EMBEDDING = "/v1/embeddings"


_INPUT_FIELD = {Kind.CHAT: "messages", Kind.COMPLETION: "prompt", Kind.EMBEDDING: "input"}


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    kind: Kind
    model: str
    stream: bool
    text: str | None  # what input tokens are counted from when it is text
    token_ids: int  # how many input tokens were sent as token ids
    max_tokens: int | None  # as asked, None when the pool's default applies
    raw: bytes  # what the backend is sent: the client's bytes, unless usage had to be asked for
    strip_usage: bool = False  # the proxy asked for the usage chunk; the client did not


def _ask_for_usage(body: dict[str, Any], raw: bytes) -> tuple[bytes, bool]:
    """A stream's token counts come in its usage chunk, sent only on request: ask for it,
    and remember to strip it, when the client did not (calibration needs every count)."""
    options = body.get("stream_options")
    if not body.get("stream") or (isinstance(options, dict) and options.get("include_usage")):
        return raw, False
    if options is None:  # the common case: add the member, leave the client's bytes be
        return raw.rstrip()[:-1] + b',"stream_options":{"include_usage":true}}', True
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object.")
    body = {**body, "stream_options": {**options, "include_usage": True}}
    return json.dumps(body, separators=(",", ":")).encode(), True


def parse(kind: Kind, raw: bytes) -> InferenceRequest:
    """Parse and check ``raw``; a body the proxy cannot route or price is a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # bad syntax or encoding, or nesting too deep
        raise ApiError(400, "The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean.")
    field = _INPUT_FIELD[kind]
    if field not in body:
        raise ApiError(400, f"'{field}' is required.")
    texts, token_ids = _inputs(kind, body[field], field)
    upstream, strip_usage = (
        _ask_for_usage(body, raw) if kind is not Kind.EMBEDDING else (raw, False)
    )
    return InferenceRequest(
        kind=kind,
        model=model,
        stream=stream,
        text="".join(texts),
        token_ids=token_ids,
        max_tokens=_max_tokens(body) if kind is not Kind.EMBEDDING else None,
        raw=upstream,
        strip_usage=strip_usage,
    )


def _inputs(kind: Kind, value: Any, field: str) -> tuple[list[str], int]:
    """The texts and the number of token ids in a ``messages``/``prompt``/``input`` value."""
    if kind is Kind.CHAT:
        if not isinstance(value, list) or not value:
            raise ApiError(400, "'messages' must be a non-empty array.")
        return [_message_text(m, i) for i, m in enumerate(value)], 0
    if isinstance(value, str):
        return [value], 0
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return value, 0
        if all(_is_token(x) for x in value):
            return [], len(value)
        if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in value):
            return [], sum(len(x) for x in value)
    raise ApiError(400, f"'{field}' must be a string, an array of strings or of token ids.")


def _message_text(message: Any, index: int) -> str:
    if not isinstance(message, dict):
        raise ApiError(400, f"'messages[{index}]' must be an object.")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise ApiError(400, f"'messages[{index}].content' must be a string or an array of parts.")


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_token(value) or value < 1:
            raise ApiError(400, f"'{name}' must be a positive integer.")
        return value
    return None


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
