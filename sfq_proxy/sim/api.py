"""The OpenAI API as the simulated server speaks it: requests checked as vLLM checks them
before scheduling, and the answers' shapes (JSON, or one SSE event per token).

Separate from the engine (``engine.py``: how long a request takes) and from the server
(``server.py``: slots, faults, sockets), so each can be read on its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, Protocol

from aiohttp import web

__all__ = [
    "AnswerPlan",
    "GenerationRequest",
    "JsonSink",
    "Kind",
    "RefusedRequest",
    "Sink",
    "SseSink",
    "ceil_tokens",
    "error_response",
    "estimate_prompt_tokens",
    "parse_generation",
]


class ApiLimits(Protocol):
    """What request validation needs of the server's configuration."""

    @property
    def models(self) -> Sequence[str]: ...
    @property
    def chars_per_token(self) -> float: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def default_max_tokens(self) -> int: ...


Kind = Literal["chat", "completions"]


# Chat templates wrap every message in role markers; vLLM's Llama-3 template adds about four.
MESSAGE_OVERHEAD_TOKENS = 4


def estimate_prompt_tokens(body: Mapping[str, Any], chars_per_token: float = 4.0) -> int:
    """Token count of a request's prompt, from characters alone (no tokenizer).

    Uses ``messages`` (chat) if present, else ``prompt`` (completions).  The proxy estimates
    with the same rule, so both sides agree on request sizes.  Raises ValueError on a shape
    vLLM would reject.
    """
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        return sum(
            MESSAGE_OVERHEAD_TOKENS + ceil_tokens(_message_chars(m), chars_per_token)
            for m in messages
        )
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return ceil_tokens(len(prompt), chars_per_token)
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(ceil_tokens(len(p), chars_per_token) for p in prompt)
    raise ValueError("'prompt' must be a string, a list of strings or a list of token ids")


def ceil_tokens(chars: int, chars_per_token: float) -> int:
    return math.ceil(chars / chars_per_token)


def _message_chars(message: object) -> int:
    """Characters of a chat message's text; non-text parts (images, …) count as nothing."""
    if not isinstance(message, dict):
        raise ValueError("each message must be an object")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return len(content or "")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(t, str) for t in texts):
            return sum(len(t) for t in texts if isinstance(t, str))
    raise ValueError("message 'content' must be a string or a list of content parts")


class RefusedRequest(Exception):
    """A request vLLM would refuse before scheduling it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> web.Response:
        return error_response(self.status, self.message)


def error_response(status: int, message: str) -> web.Response:
    """OpenAI-style error body, with vLLM's exception-class-like ``type``."""
    err_type = {400: "BadRequestError", 404: "NotFoundError"}.get(status)
    if err_type is None:
        phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
        err_type = phrase if phrase.endswith("Error") else phrase + "Error"
    error = {"message": message, "type": err_type, "param": None, "code": status}
    return web.json_response({"error": error}, status=status)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request, reduced to what the engine and the log need."""

    kind: Kind
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    user: str | None
    min_tokens: int | None = None  # vLLM's sampling parameter; see output_mode "min_tokens"


def parse_generation(kind: Kind, body: object, cfg: ApiLimits) -> GenerationRequest:
    """Validate like vLLM does before scheduling; raises RefusedRequest (400/404)."""
    if not isinstance(body, dict):
        raise RefusedRequest(400, "Request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise RefusedRequest(400, "Field 'model' is required and must be a string")
    prompt_field = "messages" if kind == "chat" else "prompt"
    if prompt_field not in body:
        raise RefusedRequest(400, f"Field '{prompt_field}' is required")
    if model not in cfg.models:
        raise RefusedRequest(404, f"The model `{model}` does not exist.")
    try:
        prompt_tokens = estimate_prompt_tokens(
            {prompt_field: body[prompt_field]}, cfg.chars_per_token
        )
    except ValueError as exc:
        raise RefusedRequest(400, str(exc)) from exc
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RefusedRequest(400, "'stream' must be a boolean")
    options = body.get("stream_options") or {}
    user = body.get("user")
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=_resolve_max_tokens(body, prompt_tokens, prompt_field, cfg),
        stream=stream,
        include_usage=stream and isinstance(options, dict) and bool(options.get("include_usage")),
        user=user if isinstance(user, str) else None,
        min_tokens=_min_tokens(body),
    )


def _min_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("min_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RefusedRequest(400, "'min_tokens' must be a non-negative integer")
    return value


def _resolve_max_tokens(
    body: dict[str, Any], prompt_tokens: int, prompt_field: str, cfg: ApiLimits
) -> int:
    """The output budget, checked against the context window as vLLM does."""
    requested = body.get("max_completion_tokens")
    if requested is None:
        requested = body.get("max_tokens")
    room = cfg.max_model_len - prompt_tokens
    if requested is None:
        if room < 1:
            raise RefusedRequest(
                400,
                f"This model's maximum context length is {cfg.max_model_len} "
                f"tokens, but the {prompt_field} use {prompt_tokens} tokens.",
            )
        return min(cfg.default_max_tokens, room)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise RefusedRequest(400, f"max_tokens must be a positive integer, got {requested!r}")
    if requested > room:
        raise RefusedRequest(
            400,
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
            f"{prompt_field}, {requested} in the completion). Please reduce the length of the "
            f"{prompt_field} or completion.",
        )
    return requested


@dataclass(frozen=True)
class AnswerPlan:
    """A request's predetermined answer plus the OpenAI/vLLM response shapes for it."""

    gen: GenerationRequest
    id: str
    created: int
    tokens: tuple[str, ...]

    @property
    def finish_reason(self) -> str:
        return "length" if len(self.tokens) == self.gen.max_tokens else "stop"

    def usage(self) -> dict[str, int]:
        prompt, completion = self.gen.prompt_tokens, len(self.tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def choice(
        self, text: str, finish: str | None, *, chunk: bool, role: bool = False
    ) -> dict[str, Any]:
        if self.gen.kind == "completions":
            body: dict[str, Any] = {"text": text}
        elif chunk:
            body = {"delta": {"role": "assistant", "content": text} if role else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

    def envelope(
        self, choices: list[dict[str, Any]], *, chunk: bool, usage: bool = False
    ) -> dict[str, Any]:
        if self.gen.kind == "completions":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        out: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.gen.model,
            "choices": choices,
        }
        if usage:
            out["usage"] = self.usage()
        return out


class Sink(Protocol):
    """Where a sequence's tokens go: an SSE stream, or a buffer for one JSON answer."""

    async def start(self, request: web.Request) -> None: ...
    async def token(self, text: str) -> None: ...
    async def finish(self) -> web.StreamResponse: ...


class SseSink:
    """Sends each token as its own SSE event the moment it exists, so TTFT is real."""

    def __init__(self, plan: AnswerPlan) -> None:
        self._plan = plan
        self._sent = 0
        self._response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )

    async def start(self, request: web.Request) -> None:
        # Headers go out before queueing, as with vLLM, whose response starts on admission.
        await self._response.prepare(request)

    async def token(self, text: str) -> None:
        plan = self._plan
        if self._sent == 0 and plan.gen.kind == "chat":
            await self._send(
                plan.envelope([plan.choice("", None, chunk=True, role=True)], chunk=True)
            )
        self._sent += 1
        finish = plan.finish_reason if self._sent == len(plan.tokens) else None
        await self._send(plan.envelope([plan.choice(text, finish, chunk=True)], chunk=True))

    async def finish(self) -> web.StreamResponse:
        if self._plan.gen.include_usage:
            await self._send(self._plan.envelope([], chunk=True, usage=True))
        await self._response.write(b"data: [DONE]\n\n")
        return self._response

    async def _send(self, event: dict[str, Any]) -> None:
        data = json.dumps(event, separators=(",", ":"))
        await self._response.write(f"data: {data}\n\n".encode())


class JsonSink:
    """Collects the tokens and answers with one completion object at the end."""

    def __init__(self, plan: AnswerPlan) -> None:
        self._plan = plan
        self._parts: list[str] = []

    async def start(self, request: web.Request) -> None:
        pass

    async def token(self, text: str) -> None:
        self._parts.append(text)

    async def finish(self) -> web.StreamResponse:
        plan = self._plan
        choice = plan.choice("".join(self._parts), plan.finish_reason, chunk=False)
        return web.json_response(plan.envelope([choice], chunk=False, usage=True))
