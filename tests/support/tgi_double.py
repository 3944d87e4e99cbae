"""Hugging Face Text Generation Inference (TGI), as its documents and router code describe it:
a contract double for the end-to-end tests (TGI needs a GPU or Docker; neither runs here).

Sources (read from the stored snapshot of github.com/huggingface/text-generation-inference
at commit db931fcf42da018a3657580c64bf2720f167f9ab, 2026-01-08, version 3.3.6-dev0):

- docs/source/reference/api_reference.md ("OpenAI Messages API"; it replaced
  docs/source/messages_api.md in 53729b74): ``POST /v1/chat/completions``, streamed and not,
  with the official openai SDK (``base_url=".../v1"``, any ``api_key``, ``model="tgi"``).
- docs/source/conceptual/streaming.md: streams are Server-Sent Events; "too many requests"
  is an error of type ``overloaded``.
- docs/openapi.json and the ``#[utoipa::path]`` blocks of router/src/server.rs (the
  documented contract): ``GET /health`` is 200 "Everything is working fine", or 503 with
  ``{"error": "unhealthy", "error_type": "healthcheck"}``; the chat route answers 422
  ``{"error": ..., "error_type": "validation"}``, 424 ``generation``, 429 ``overloaded``,
  500 ``incomplete_generation``.
- router/src/server.rs: routes (``/health``, ``/ping`` and ``/`` GET are the health check;
  ``/info``; ``/v1/models``; ``/v1/chat/completions``; ``--api-key`` guards only the
  generation routes, with a bare 401); ``chat_completions``: ``try_into_generate`` runs
  before the stream starts (its errors are 422 JSON even for a stream), but validation runs
  inside the stream, so a streamed request that fails validation is a 200
  ``text/event-stream`` with one event ``{"error": {"message": ..., "http_status_code":
  422}}`` then ``[DONE]`` (``InferError::into_openai_event``, router/src/infer/mod.rs);
  ``impl From<InferError> for (StatusCode, Json<ErrorResponse>)``: the status per error.
- router/src/lib.rs: ``ChatRequest`` (``max_tokens`` with the alias
  ``max_completion_tokens``; ``n`` "UNUSED", never read; ``model`` used only as a LoRA
  adapter id unless "tgi", and echoed back; ``stream_options`` a struct with
  ``#[serde(default)]``, so a ``null`` is a deserialisation error), ``ChatCompletion``,
  ``ChatCompletionChunk`` (every chunk has ``"usage": null`` but the usage one; ``id`` is
  ``""``; ``object`` first, as an internally tagged enum), ``FinishReason::format(true)``
  (``eos_token`` is reported as ``stop``), ``ErrorResponse``, ``Info``.
- router/src/chat.rs ``ChatState::push``: each token is a chunk whose delta is
  ``{"role": "assistant", "content": token}`` (a special token, the EOS, has content
  ``""``); the last token's chunk carries ``finish_reason``; with
  ``stream_options.include_usage`` a chunk with ``"choices": []`` and the usage follows it.
- router/src/validation.rs: the checks and their messages, in their order; ``max_tokens``
  absent means ``max_total_tokens - input_length`` ("auto max_new_tokens", 8c3669b2); a
  ``max_tokens`` above 1024 (``DEFAULT_GENERATION_LENGTH``) is checked as 1024 (8a211dc7),
  so only ``input + min(max_tokens, 1024) > max_total_tokens`` is refused.
- axum 0.7.9 (router/Cargo.toml, Cargo.lock), tag axum-v0.7.9 = commit
  9983bc1da460becd3a0f08c513d610411e84dd43: ``Sse`` sends ``content-type:
  text/event-stream`` and ``cache-control: no-cache``; each event is ``data: <json>\\n\\n``
  (LF only, a space after the colon); ``KeepAlive::default()`` sends ``:\\n\\n`` every
  15 s; the ``Json`` extractor's rejections are plain text: 400 "Failed to parse the
  request body as JSON: …", 415 "Expected request with `Content-Type: application/json`",
  422 "Failed to deserialize the JSON body into the target type: …" (serde's derive also
  refuses a field given twice, an alias included: "duplicate field `max_tokens`").

What is the double's own: the tokenizer and chat template (3 tokens per message, plus one
per word of its content, plus 1 for the assistant's turn), the model (it answers the same
five words then an EOS token, which counts as generated), and the timings in the headers.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what ``--model-id`` would be
VERSION = "3.3.6-dev0"
FINGERPRINT = f"{VERSION}-native"  # ``{info.version}-{docker_label or "native"}``
WORDS = ("Fair", " queues", " for", " all", ".")
DEFAULT_GENERATION_LENGTH = 1024  # router/src/validation.rs
CHAT_PATH = "/v1/chat/completions"
# the ``ChatRequest`` fields serde knows, by every name it accepts (lib.rs); a name given
# twice in one body is refused, even under its alias
_FIELD_OF = {
    "model": "model", "messages": "messages", "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias", "logprobs": "logprobs", "top_logprobs": "top_logprobs",
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "n": "n",
    "presence_penalty": "presence_penalty", "stop": "stop", "stream": "stream", "seed": "seed",
    "temperature": "temperature", "top_p": "top_p", "tools": "tools",
    "tool_prompt": "tool_prompt", "tool_choice": "tool_choice",
    "response_format": "response_format", "stream_options": "stream_options",
}  # fmt: skip


class _Rejected(Exception):
    """The answer axum's extractor or ``try_into_generate`` gives instead of a generation."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response


class _ValidationError(Exception):
    """``InferError::ValidationError``: "Input validation error: {0}", type "validation"."""


@dataclass
class TgiDouble:
    """The stand-in; ``app()`` is its aiohttp application (serve it with ``Lab.serve``).

    The limits are the launcher's (``--max-total-tokens`` and so on). ``healthy`` False
    makes ``/health`` a 503, as when the shards do not answer. ``token_delay`` spaces the
    streamed tokens. It records every request's path and body.
    """

    max_total_tokens: int = 4096
    max_input_tokens: int = 4095
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_concurrent_requests: int = 128
    api_key: str | None = None
    healthy: bool = True
    token_delay: float = 0.0
    received: list[tuple[str, str, bytes]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)  # per request received
    in_flight: int = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        for path in ("/health", "/ping", "/"):
            app.router.add_get(path, self._health)
        app.router.add_get("/info", self._info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post(CHAT_PATH, self._chat)
        return app

    def chats(self) -> list[dict[str, Any]]:
        """The chat bodies received, parsed (the last of a name given twice)."""
        return [json.loads(body) for _, path, body in self.received if path == CHAT_PATH]

    def probes(self) -> list[str]:
        return [path for method, path, _ in self.received if method == "GET"]

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.received.append((request.method, request.path, await request.read()))
        self.authorizations.append(request.headers.get("Authorization"))
        return await handler(request)

    # -- the info routes (never behind the key) ------------------------------------------

    async def _health(self, _: web.Request) -> web.Response:
        if self.healthy:
            return web.Response(status=200)  # ``Ok(())``: an empty body
        return _error(503, "unhealthy", "healthcheck")

    async def _info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_id": MODEL_ID,
                "model_sha": None,
                "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": self.max_concurrent_requests,
                "max_best_of": 2,
                "max_stop_sequences": self.max_stop_sequences,
                "max_input_tokens": self.max_input_tokens,
                "max_total_tokens": self.max_total_tokens,
                "validation_workers": 2,
                "max_client_batch_size": 4,
                "router": "text-generation-router",
                "version": VERSION,
                "sha": None,
                "docker_label": None,
            }
        )

    async def _models(self, _: web.Request) -> web.Response:
        model = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": MODEL_ID}
        return web.json_response({"object": "list", "data": [model]})

    # -- POST /v1/chat/completions ---------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").lower()
        if self.api_key is not None and given != f"bearer {self.api_key}".lower():
            return web.Response(status=401)  # the auth layer: a bare 401, no body
        try:
            chat = await _chat_request(request)
            prompt = self._template(chat)  # try_into_generate: before any stream
        except _Rejected as rejected:
            return rejected.response
        if chat.get("stream"):
            return await self._stream(request, chat, prompt)
        if self.in_flight >= self.max_concurrent_requests:
            return _error(429, "Model is overloaded", "overloaded")
        try:
            input_length, max_new = self._validate(chat, prompt)
        except _ValidationError as err:
            return _error(422, f"Input validation error: {err}", "validation")
        self.in_flight += 1
        try:
            tokens = list(self._generate(max_new))
        finally:
            self.in_flight -= 1
        finish = "stop" if tokens[-1] is None else "length"
        answer = {
            "object": "chat.completion",
            "id": "",
            "created": int(time.time()),
            "model": _model_id(chat),
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(t for t in tokens if t)},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": _usage(input_length, len(tokens)),
        }
        headers = {
            "x-compute-type": "gpu+optimized",
            "x-compute-characters": str(len(prompt)),
            "x-prompt-tokens": str(input_length),
            "x-generated-tokens": str(len(tokens)),
        }
        return web.json_response(answer, headers=headers, dumps=_compact)

    async def _stream(
        self, request: web.Request, chat: dict[str, Any], prompt: str
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-compute-type": "gpu+optimized",
                "x-compute-characters": str(len(prompt)),
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)  # axum's Sse: the 200 goes out before validation

        async def send(data: Any) -> None:
            text = data if isinstance(data, str) else _compact(data)
            await response.write(b"data: " + text.encode() + b"\n\n")

        if self.in_flight >= self.max_concurrent_requests:
            await send(_openai_error("Model is overloaded"))
        else:
            try:
                input_length, max_new = self._validate(chat, prompt)
            except _ValidationError as err:
                await send(_openai_error(f"Input validation error: {err}"))
            else:
                self.in_flight += 1
                try:
                    await self._stream_tokens(send, chat, input_length, max_new)
                finally:
                    self.in_flight -= 1
        await send("[DONE]")
        await response.write_eof()
        return response

    async def _stream_tokens(
        self, send: Any, chat: dict[str, Any], input_length: int, max_new: int
    ) -> None:
        include_usage = bool(chat.get("stream_options", {}).get("include_usage"))
        tokens = list(self._generate(max_new))
        for n, token in enumerate(tokens, 1):
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            last = n == len(tokens)
            finish = ("stop" if token is None else "length") if last else None
            delta = {"role": "assistant", "content": token or ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            await send(_chunk(chat, [choice]))
        if include_usage:  # ChatState::push, after the last token's chunk
            await send(_chunk(chat, [], _usage(input_length, len(tokens))))

    # -- the model, the template, the validation ------------------------------------------

    def _template(self, chat: dict[str, Any]) -> str:
        """``try_into_generate``: the mutually exclusive options, then the chat template."""
        if chat.get("response_format") is not None and chat.get("tools") is not None:
            raise _Rejected(_error(422, "Tool error: Grammar and tools are mutually exclusive",
                                   "tool_error"))  # fmt: skip
        parts = []
        for message in chat["messages"]:
            content = message.get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<|{message.get('role')}|> {content} <|end|>")
        return " ".join(parts) + " <|assistant|>"

    def _validate(self, chat: dict[str, Any], prompt: str) -> tuple[int, int]:
        """``Validation::validate`` on what ``try_into_generate`` made of ``chat``: returns
        (input_length, max_new_tokens), raises with TGI's message."""
        temperature = chat.get("temperature")
        if temperature is not None and temperature != 0.0 and temperature <= 0.0:
            raise _ValidationError("`temperature` must be strictly positive")
        presence = chat.get("presence_penalty")
        if presence is not None and presence + 2.0 <= 0.0:  # repetition_penalty = p + 2
            raise _ValidationError("`repetition_penalty` must be strictly positive")
        frequency = chat.get("frequency_penalty")
        if frequency is not None and not -2.0 <= frequency <= 2.0:
            raise _ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
        top_p = chat.get("top_p")
        if top_p is not None and not 0.0 < top_p < 1.0:
            raise _ValidationError("`top_p` must be > 0.0 and < 1.0")
        max_tokens = chat.get("max_tokens", chat.get("max_completion_tokens"))
        if max_tokens == 0:
            raise _ValidationError("`max_new_tokens` must be strictly positive")
        stop = chat.get("stop") or []
        if len(stop) > self.max_stop_sequences:
            raise _ValidationError(
                f"`stop` supports up to {self.max_stop_sequences} stop sequences. "
                f"Given: {len(stop)}"
            )
        top_n = chat.get("top_logprobs")
        if top_n is not None and top_n > self.max_top_n_tokens:
            raise _ValidationError(
                f"`top_n_tokens` must be >= 0 and <= {self.max_top_n_tokens}. Given: {top_n}"
            )
        input_length = _count_tokens(chat["messages"])
        if max_tokens is not None:
            checked, max_new = min(max_tokens, DEFAULT_GENERATION_LENGTH), max_tokens
        else:  # auto: all the room the context leaves
            room = max(self.max_total_tokens - input_length, 0)
            checked, max_new = min(room, DEFAULT_GENERATION_LENGTH), room
        if input_length + checked > self.max_total_tokens:
            raise _ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.max_total_tokens}. "
                f"Given: {input_length} `inputs` tokens and {checked} `max_new_tokens`"
            )
        if input_length > self.max_input_tokens:
            raise _ValidationError(
                f"`inputs` must have less than {self.max_input_tokens} tokens. "
                f"Given: {input_length}"
            )
        return input_length, max_new

    @staticmethod
    def _generate(max_new: int) -> list[str | None]:
        """The tokens generated: the words, then the EOS (None, a special token), cut at
        ``max_new``; the EOS is generated, so it counts."""
        return [*WORDS, None][:max_new]


async def _chat_request(request: web.Request) -> dict[str, Any]:
    """axum's ``Json<ChatRequest>`` extractor: its rejections, as plain text."""
    if request.content_type != "application/json":
        raise _Rejected(
            web.Response(status=415, text="Expected request with `Content-Type: application/json`")
        )
    raw = await request.read()
    try:
        pairs_seen: list[list[tuple[str, Any]]] = []
        body = json.loads(raw, object_pairs_hook=lambda p: pairs_seen.append(p) or dict(p))
    except ValueError as err:
        raise _Rejected(_plain(400, f"Failed to parse the request body as JSON: {err}")) from None
    problem = None
    if not isinstance(body, dict):
        problem = "invalid type: expected struct ChatRequest"
    else:
        names = [_FIELD_OF.get(name) for name, _ in pairs_seen[-1]]
        twice = next((n for n in names if n is not None and names.count(n) > 1), None)
        if twice is not None:
            problem = f"duplicate field `{twice}`"
        elif "messages" not in body:
            problem = "missing field `messages`"
        elif "stream_options" in body and not isinstance(body["stream_options"], dict):
            problem = "stream_options: invalid type: expected struct StreamOptions"
    if problem is not None:
        raise _Rejected(
            _plain(422, f"Failed to deserialize the JSON body into the target type: {problem}")
        )
    return body


def _count_tokens(messages: list[dict[str, Any]]) -> int:
    """The double's tokenizer on its template: 3 per message and 1 per word, 1 to answer."""
    words = 0
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        words += len(content.split())
    return 3 * len(messages) + words + 1


def _model_id(chat: dict[str, Any]) -> str:
    model = chat.get("model")
    return MODEL_ID if model in (None, "tgi") else model


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _chunk(
    chat: dict[str, Any], choices: list[dict[str, Any]], usage: dict[str, int] | None = None
) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "id": "",
        "created": int(time.time()),
        "model": _model_id(chat),
        "system_fingerprint": FINGERPRINT,
        "choices": choices,
        "usage": usage,
    }


def _openai_error(message: str) -> dict[str, Any]:
    """``InferError::into_openai_event``: always 422, whatever the error."""
    return {"error": {"message": message, "http_status_code": 422}}


def _error(status: int, error: str, error_type: str) -> web.Response:
    return web.json_response({"error": error, "error_type": error_type}, status=status,
                             dumps=_compact)  # fmt: skip


def _plain(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text)  # text/plain; charset=utf-8, as axum


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)
