"""The OpenAI API as the simulated server speaks it: requests checked as vLLM checks them
before scheduling, and the answers' shapes (JSON, or one SSE event per token): Chat
Completions, Completions, and the Responses API as vLLM serves it (``/v1/responses``: the
input as chat messages under the chat template, ``response.*`` events each with its
``event:`` line, the usage in the final ``response.completed`` event, no ``[DONE]``).

Separate from the engine (``engine.py``: how long a request takes) and from the server
(``server.py``: slots, faults, sockets), so each can be read on its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal, Protocol

from aiohttp import web

from ..core.media import media_part
from .engine import INT64_MAX, INT64_MIN

__all__ = [
    "DEFAULT_MEDIA_TOKENS",
    "OUTPUT_FIELDS",
    "AnswerPlan",
    "GenerationRequest",
    "JsonSink",
    "Kind",
    "RefusedRequest",
    "ResponsesSseSink",
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
    def default_max_tokens(self) -> int | None: ...
    @property
    def tokens_per_message(self) -> int: ...
    @property
    def media_tokens(self) -> Mapping[str, int]: ...


Kind = Literal["chat", "completions", "responses"]


# Chat templates wrap every message in role markers; vLLM's Llama-3 template adds about four.
MESSAGE_OVERHEAD_TOKENS = 4
# What a non-text content part costs when the part itself does not tell (a remote image, any
# audio, file or video), by kind: OpenAI's price of a 1024 × 1024 image at high detail, and
# round figures for the others (the proxy's `cost.media_tokens` defaults are the same).
DEFAULT_MEDIA_TOKENS: Mapping[str, int] = {
    "image": 765,
    "audio": 1500,
    "file": 3000,
    "video": 10000,
}
# the parameters of a request's output, recorded as the server received them
OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of")
_PROMPT_FIELDS: Mapping[str, str] = {
    "chat": "messages",
    "completions": "prompt",
    "responses": "input",
}


def estimate_prompt_tokens(
    body: Mapping[str, Any],
    chars_per_token: float = 4.0,
    tokens_per_message: int = MESSAGE_OVERHEAD_TOKENS,
    media_tokens: Mapping[str, int] = DEFAULT_MEDIA_TOKENS,
) -> int:
    """Token count of a request's prompt, from characters alone (no tokenizer).

    Uses ``messages`` (chat) if present, else ``prompt`` (completions). A chat prompt is
    what a chat template makes of it: ``tokens_per_message`` per message (role markers),
    plus each message's text at ``chars_per_token``, plus its non-text parts — an image by
    OpenAI's tile rule when its size can be read from an inline ``data:`` URL, any other
    part at ``media_tokens[kind]`` (``sfq_proxy.core.media`` says which kind a part is, as
    the proxy prices it). Raises ValueError on a shape vLLM would reject.
    """
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        return sum(
            tokens_per_message + _message_tokens(m, chars_per_token, media_tokens) for m in messages
        )
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return ceil_tokens(len(prompt), chars_per_token)
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(ceil_tokens(len(p), chars_per_token) for p in prompt)
    raise ValueError("'prompt' must be a string, a list of strings or a list of token ids")


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A Responses API request's prompt as the chat messages vLLM renders with the chat
    template: ``instructions`` as a system message, then ``input`` (a string is one user
    message; a message item is a message; any other item, a function call or its output,
    is rendered as a message of its JSON here). Raises ValueError on a shape vLLM would
    reject."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError("'instructions' must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError("'input' must be a string or a non-empty list of input items")
    for item in value:
        if not isinstance(item, dict):
            raise ValueError("each input item must be an object")
        if item.get("type", "message") == "message":
            messages.append({"role": item.get("role", "user"), "content": item.get("content")})
        else:
            messages.append({"role": "assistant", "content": json.dumps(item)})
    return messages


def ceil_tokens(chars: int, chars_per_token: float) -> int:
    return math.ceil(chars / chars_per_token)


def _message_tokens(
    message: object, chars_per_token: float, media_tokens: Mapping[str, int]
) -> int:
    """Tokens of a chat message's content: its text by characters, and its media parts."""
    if not isinstance(message, dict):
        raise ValueError("each message must be an object")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return ceil_tokens(len(content or ""), chars_per_token)
    if not isinstance(content, list) or not all(isinstance(p, dict | str) for p in content):
        raise ValueError("message 'content' must be a string or a list of content parts")
    chars = media = 0
    for part in content:
        found = media_part(part)
        if found is not None:
            media += found.tokens if found.tokens is not None else media_tokens[found.kind]
            continue
        if isinstance(part, str):  # vLLM reads a bare string part as text
            chars += len(part)
            continue
        text = part.get("text")
        if part.get("type") == "text" and not isinstance(text, str):
            raise ValueError("message 'content' must be a string or a list of content parts")
        chars += len(text) if isinstance(text, str) else 0
    return ceil_tokens(chars, chars_per_token) + media


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
    # vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): usage on
    # every chunk, the completion tokens so far
    continuous_usage: bool = False
    min_tokens: int | None = None  # vLLM's sampling parameter; see output_mode "min_tokens"
    instructions: str | None = None  # a Responses API request's, echoed in its answer
    n: int = 1  # choices returned
    sequences: int = 1  # sequences generated, each up to max_tokens: best_of if larger than n
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower is served first
    # the output fields of the body as received (OUTPUT_FIELDS), for tests to check what a
    # proxy sent upstream
    asked: Mapping[str, Any] = field(default_factory=dict)


def parse_generation(kind: Kind, body: object, cfg: ApiLimits) -> GenerationRequest:
    """Validate like vLLM does before scheduling; raises RefusedRequest (400/404)."""
    if not isinstance(body, dict):
        raise RefusedRequest(400, "Request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise RefusedRequest(400, "Field 'model' is required and must be a string")
    prompt_field = _PROMPT_FIELDS[kind]
    if prompt_field not in body:
        raise RefusedRequest(400, f"Field '{prompt_field}' is required")
    if model not in cfg.models:
        raise RefusedRequest(404, f"The model `{model}` does not exist.")
    try:
        prompt = (
            {"messages": responses_messages(body)}
            if kind == "responses"
            else {prompt_field: body[prompt_field]}
        )
        prompt_tokens = estimate_prompt_tokens(
            prompt, cfg.chars_per_token, cfg.tokens_per_message, cfg.media_tokens
        )
    except ValueError as exc:
        raise RefusedRequest(400, str(exc)) from exc
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RefusedRequest(400, "'stream' must be a boolean")
    n, sequences = _choices(kind, body)
    # as vLLM (and OpenAI): when best_of exceeds n the answer is not streamed
    stream = stream and sequences == n
    options = body.get("stream_options") or {}
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    user = body.get("user")
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=_resolve_max_tokens(body, prompt_tokens, prompt_field, cfg),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options.get("continuous_usage_stats")),
        user=user if isinstance(user, str) else None,
        min_tokens=_min_tokens(body),
        instructions=body.get("instructions") if kind == "responses" else None,
        n=n,
        sequences=sequences,
        priority=_priority(body),
        asked={name: body[name] for name in OUTPUT_FIELDS if name in body},
    )


def _choices(kind: Kind, body: dict[str, Any]) -> tuple[int, int]:
    """(choices returned, sequences generated): ``n``, and for completions ``best_of``
    sequences of which the first ``n`` are returned; checked as vLLM's SamplingParams does.
    A Responses API request has one answer."""
    if kind == "responses":
        return 1, 1
    n = _positive(body, "n")
    best_of = _positive(body, "best_of") if kind == "completions" else None
    if best_of is not None and best_of < n:
        raise RefusedRequest(
            400, f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}."
        )
    return n, best_of or n


def _positive(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RefusedRequest(400, f"{name} must be at least 1, got {value!r}.")
    return value


def _priority(body: dict[str, Any]) -> int:
    """vLLM's ``priority``: an integer in the int64 range (its pydantic field), 0 if absent.
    Accepted whatever the scheduling policy, as vLLM 0.32 does (FCFS ignores it). Stricter
    than pydantic's lax mode, which would also take ``"3"``, ``3.0`` or ``true``."""
    if "priority" not in body:
        return 0
    value = body["priority"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise RefusedRequest(400, "priority: Input should be a valid integer")
    if value < INT64_MIN:
        raise RefusedRequest(400, f"priority: Input should be greater than or equal to {INT64_MIN}")
    if value > INT64_MAX:
        raise RefusedRequest(400, f"priority: Input should be less than or equal to {INT64_MAX}")
    return value


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
    if prompt_field == "input":  # the Responses API's one field
        requested = body.get("max_output_tokens")
    else:
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
        # vLLM's own default is the rest of the context window (default_max_tokens None)
        default = cfg.default_max_tokens
        return room if default is None else min(default, room)
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
    """A request's predetermined answer plus the OpenAI/vLLM response shapes for it.

    ``sequences`` holds every sequence generated (``gen.sequences`` of them); the first
    ``gen.n`` are the choices returned, with index 0..n-1. Usage counts the tokens of the
    returned choices, as vLLM does (with ``best_of`` the others were generated too).
    """

    gen: GenerationRequest
    id: str
    created: int
    sequences: tuple[tuple[str, ...], ...]

    @property
    def returned(self) -> tuple[tuple[str, ...], ...]:
        return self.sequences[: self.gen.n]

    def finish_reason(self, index: int) -> str:
        return "length" if len(self.sequences[index]) == self.gen.max_tokens else "stop"

    def usage(self, completion: int | None = None) -> dict[str, int]:
        """The answer's usage; a chunk's so far with ``completion`` (continuous usage)."""
        prompt = self.gen.prompt_tokens
        if completion is None:
            completion = sum(len(s) for s in self.returned)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def choice(
        self, index: int, text: str, finish: str | None, *, chunk: bool, role: bool = False
    ) -> dict[str, Any]:
        if self.gen.kind == "completions":
            body: dict[str, Any] = {"text": text}
        elif chunk:
            body = {"delta": {"role": "assistant", "content": text} if role else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": index, **body, "logprobs": None, "finish_reason": finish}

    # -- the Responses API (vLLM's ResponsesResponse and its events) --

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    def output_text(self, text: str) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}

    def output_message(self, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    def response(self, text: str | None) -> dict[str, Any]:
        """The response object: in progress (``text`` None: no output, no usage yet), else
        completed, or incomplete when it stopped at ``max_output_tokens`` (as vLLM says)."""
        gen = self.gen
        if text is None:
            status, output, usage = "in_progress", [], None
        else:
            status = "incomplete" if self.finish_reason(0) == "length" else "completed"
            output = [self.output_message([self.output_text(text)], "completed")]
            prompt, completion = gen.prompt_tokens, len(self.returned[0])
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": incomplete,
            "instructions": gen.instructions,
            "metadata": None,
            "model": gen.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "background": False,
            "max_output_tokens": gen.max_tokens,
            "max_tool_calls": None,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": status,
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": usage,
            "user": gen.user,
        }

    def envelope(
        self,
        choices: list[dict[str, Any]],
        *,
        chunk: bool,
        usage: bool = False,
        so_far: int | None = None,
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
            out["usage"] = self.usage(so_far)
        return out


class Sink(Protocol):
    """Where a request's tokens go: an SSE stream, or a buffer for one JSON answer. Each
    token comes with the index of the sequence it belongs to."""

    async def start(self, request: web.Request) -> None: ...
    async def token(self, index: int, text: str) -> None: ...
    async def finish(self) -> web.StreamResponse: ...


class SseSink:
    """Sends each token as its own SSE event the moment it exists, so TTFT is real.

    As vLLM streams a chat: first one role chunk per choice, then one chunk per token, each
    carrying the one choice it belongs to; a choice's last token carries its finish reason.
    (Only used when every sequence is returned: best_of > n is never streamed.) With
    continuous usage, each chunk carries the usage so far: the prompt, and the tokens sent
    (of all choices; vLLM counts each choice's own).
    """

    def __init__(self, plan: AnswerPlan) -> None:
        self._plan = plan
        self._sent = [0] * len(plan.sequences)
        self._response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )

    async def start(self, request: web.Request) -> None:
        # Headers go out before queueing, as with vLLM, whose response starts on admission.
        await self._response.prepare(request)

    async def token(self, index: int, text: str) -> None:
        plan = self._plan
        if not any(self._sent) and plan.gen.kind == "chat":
            roles = [plan.choice(i, "", None, chunk=True, role=True) for i in range(plan.gen.n)]
            for role in roles:
                await self._send(plan.envelope([role], chunk=True, **self._usage()))
        self._sent[index] += 1
        last = self._sent[index] == len(plan.sequences[index])
        finish = plan.finish_reason(index) if last else None
        choice = plan.choice(index, text, finish, chunk=True)
        await self._send(plan.envelope([choice], chunk=True, **self._usage()))

    def _usage(self) -> dict[str, Any]:
        """A chunk's usage so far, if continuous usage was asked for."""
        if not self._plan.gen.continuous_usage:
            return {}
        return {"usage": True, "so_far": sum(self._sent)}

    async def finish(self) -> web.StreamResponse:
        if self._plan.gen.include_usage:
            await self._send(self._plan.envelope([], chunk=True, usage=True))
        await self._response.write(b"data: [DONE]\n\n")
        return self._response

    async def _send(self, event: dict[str, Any]) -> None:
        data = json.dumps(event, separators=(",", ":"))
        await self._response.write(f"data: {data}\n\n".encode())


class ResponsesSseSink:
    """A Responses API stream as vLLM sends it: ``response.created`` and
    ``response.in_progress`` once the request is accepted, the message and its text part
    opened at the first token, one ``response.output_text.delta`` per token, then the
    part, the message and the response closed, the last event ``response.completed``
    with the whole response and its usage. Each event has its ``event:`` line and a
    ``sequence_number``; there is no ``[DONE]``."""

    def __init__(self, plan: AnswerPlan) -> None:
        self._plan = plan
        self._text: list[str] = []
        self._sequence = 0
        self._response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )

    async def start(self, request: web.Request) -> None:
        await self._response.prepare(request)
        pending = self._plan.response(None)
        await self._send("response.created", response=pending)
        await self._send("response.in_progress", response=pending)

    async def token(self, index: int, text: str) -> None:
        plan = self._plan
        at = {"output_index": 0, "item_id": plan.message_id, "content_index": 0}
        if not self._text:
            await self._send(
                "response.output_item.added",
                output_index=0,
                item=plan.output_message([], "in_progress"),
            )
            await self._send(
                "response.content_part.added", **at, part={**plan.output_text(""), "logprobs": []}
            )
        self._text.append(text)
        await self._send("response.output_text.delta", **at, delta=text, logprobs=[])

    async def finish(self) -> web.StreamResponse:
        plan = self._plan
        text = "".join(self._text)
        at = {"output_index": 0, "item_id": plan.message_id, "content_index": 0}
        if self._text:
            part = plan.output_text(text)
            await self._send("response.output_text.done", **at, text=text, logprobs=[])
            await self._send("response.content_part.done", **at, part=part)
            await self._send(
                "response.output_item.done",
                output_index=0,
                item=plan.output_message([part], "completed"),
            )
        await self._send("response.completed", response=plan.response(text))
        return self._response

    async def _send(self, kind: str, **fields: Any) -> None:
        event = {**fields, "sequence_number": self._sequence, "type": kind}
        self._sequence += 1
        data = json.dumps(event, separators=(",", ":"))
        await self._response.write(f"event: {kind}\ndata: {data}\n\n".encode())


class JsonSink:
    """Collects the tokens and answers with one completion object (a response object, for
    the Responses API) at the end."""

    def __init__(self, plan: AnswerPlan) -> None:
        self._plan = plan
        self._parts: list[list[str]] = [[] for _ in plan.sequences]

    async def start(self, request: web.Request) -> None:
        pass

    async def token(self, index: int, text: str) -> None:
        self._parts[index].append(text)

    async def finish(self) -> web.StreamResponse:
        plan = self._plan
        if plan.gen.kind == "responses":
            return web.json_response(plan.response("".join(self._parts[0])))
        choices = [
            plan.choice(i, "".join(self._parts[i]), plan.finish_reason(i), chunk=False)
            for i in range(plan.gen.n)
        ]
        return web.json_response(plan.envelope(choices, chunk=False, usage=True))
