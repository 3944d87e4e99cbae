"""The body of an inference request, checked just enough to route and price it.

The proxy forwards the client's bytes, changed only where it must (``upstream_body.py``:
a stream's usage, a vLLM engine's priority, the output bound); it parses them to read ``model``,
``stream``, the text it is priced on and the token fields (docs/design.md §4): of a chat,
a completion, an embedding, a Responses API request, or a request to one of a pool's
extra paths (priced by the pool's rule for it, ``parse_extra``). Those are checked strictly,
because the proxy prices and queues on them and then forwards the bytes: a body it cannot
read exactly as a backend would (not UTF-8, NaN, lone surrogates) or a number it cannot
price is a 400 here, never a surprise upstream or an overflow in the scheduler. Anything
else is the backend's business, and its own 400 passes through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeGuard

import msgspec

from ..config import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_OUTPUT_TOKENS, MAX_TOOLS
from ..config import Kind as Kind  # re-exported: the shell reads a request's kind here
from . import affinity
from .errors import ApiError, cut
from .media import MEDIA_FIELDS, TEXT_TYPES, Media, media_part
from .upstream_body import (
    ENGINE_PRIORITY,
    OUTPUT_FIELDS,
    appended,
    output_fields,
    upstream,
    usage_options,
)

MAX_CHOICES = 128
"""The most ``n`` / ``best_of`` a request may ask for (OpenAI's own limit for ``n``)."""
# Where a JSON text may hold a lone surrogate, read from its bytes alone (a strict UTF-8
# reading refuses an encoded one, so it can only come as an escape): a high half's escape
# not followed by a low half's, a low half's not preceded by a high half's, or a pair
# whose first backslash follows a backslash (the high half may be text: ``\\uD83D``). No
# lone surrogate escapes these three (a property test holds it); a match may be a false
# alarm, which the walk of the values settles. Each alternative starts with ``\u`` and a
# ``d``, so the search skips to those (0.3 ms a MiB; 14 at worst, a body of pairs alone).
_HIGH = rb"[89abAB][0-9a-fA-F]{2}"  # a high half's escape, after its ``\uD``
_MAYBE_LONE_SURROGATE = re.compile(
    rb"\\u[dD](?:" + _HIGH + rb"(?!\\u[dD][c-fC-F])"
    rb"|[c-fC-F](?<!\\u[dD]" + _HIGH + rb"\\u[dD][c-fC-F])"
    rb"|" + _HIGH + rb"\\u[dD][c-fC-F](?<=\\\\u[dD]" + _HIGH + rb"\\u[dD][c-fC-F]))"
)

_INPUT_FIELD = {
    Kind.CHAT: "messages",
    Kind.COMPLETION: "prompt",
    Kind.EMBEDDING: "input",
    Kind.RESPONSES: "input",
}


@dataclass(slots=True)
class InferenceRequest:
    """A request as parsed. Changed by ``dataclasses.replace``, never in place, but for one
    field: the handler drops ``text`` once the request is priced, so that a queued request
    holds its body and not its prompt twice (a copy of its 16 fields would cost ~10 µs)."""

    kind: Kind
    model: str
    stream: bool
    text: str | None  # what input tokens are counted from when it is text
    token_ids: int  # how many input tokens were sent as token ids
    max_tokens: int | None  # as asked, None when the pool's default applies
    raw: bytes  # what the backend is sent: the client's bytes unless changed (upstream_body.py)
    strip_usage: bool = False  # the proxy asked for the usage chunk; the client did not
    # sequences generated, each up to max_tokens: the larger of n and best_of, for each prompt
    # of a /v1/completions batch
    choices: int = 1
    # texts the input is made of (chat messages, prompts, inputs), each with its template's
    # tokens; 0 for token ids only
    messages: int = 0
    names_output: bool = False  # the body has a token field, be it only null
    media: tuple[Media, ...] = ()  # its image, audio, file and video parts, priced apart
    # with its pool's affinity on: digests of its prompt's prefix and of its ``user`` field
    # (core/affinity.py), never their text
    affinity_prefix: str | None = None
    affinity_user: str | None = None
    # input tokens it counts as they are: an extra path's fixed cost (config ``cost.fixed``)
    fixed_tokens: int = 0
    path: str | None = None  # where it goes upstream when not ``kind.value`` (extra paths)

    @property
    def route(self) -> str:
        """The path it is sent to upstream (after the backend's base URL)."""
        return self.path or self.kind.value


class Caps(Protocol):
    """How much structure a request's body may have (config ``limits``): checked as soon as
    it is read, before any of its messages is, so that what a request costs to read is
    bounded by them and by its size (docs/design.md §6, Bounded numbers)."""

    @property
    def max_messages(self) -> int: ...

    @property
    def max_content_parts(self) -> int: ...

    @property
    def max_tools(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CapValues:
    """``Caps`` as plain values, by default the config's defaults."""

    max_messages: int = MAX_MESSAGES
    max_content_parts: int = MAX_CONTENT_PARTS
    max_tools: int = MAX_TOOLS


DEFAULT_CAPS = CapValues()


def _always(_model: str) -> bool:
    return True


def _never(_model: str) -> bool:
    return False


def _no_affinity(_model: str) -> affinity.Settings | None:
    return None


def parse(
    kind: Kind,
    raw: bytes,
    reports_stream_usage: Callable[[str], bool] = _always,
    affinity_of: Callable[[str], affinity.Settings | None] = _no_affinity,
    caps: Caps = DEFAULT_CAPS,
    continuous_usage: Callable[[str], bool] = _never,
    owns_priority: Callable[[str], bool] = _never,
) -> InferenceRequest:
    """Parse and check ``raw``; a body the proxy cannot route or price is a 400, and so is
    one beyond ``caps``. A stream to a model whose server ``reports_stream_usage`` when
    asked is made to ask for it (a Responses API stream always ends with its usage), on
    every chunk where its pool has ``continuous_usage`` (vLLM's). A
    request for a model whose pool has affinity settings (``affinity_of``) gets the
    digests its affinity key is made of. One for a model whose engine's priority is the
    proxy's to set (``owns_priority``: vLLM's) loses the ``priority`` it came with."""
    if kind is Kind.EXTRA:
        raise ValueError("an extra path's request is parsed by parse_extra")
    body, unchecked = _json_object(raw)
    if len(raw) >= _MIN_ITEM_BYTES * min(caps.max_messages, caps.max_content_parts, caps.max_tools):
        _within_caps(kind, body, caps)
    if unchecked:
        _no_lone_surrogate(raw, body)
    model = _model(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean.")
    field = _INPUT_FIELD[kind]
    if field not in body:
        raise ApiError(400, f"'{field}' is required.")
    media: list[Media] = []
    named: list[tuple[str, str]] | None = None  # (role, text) of a Responses API input
    if kind is Kind.RESPONSES:
        named = _responses_input(body, media)
        texts, token_ids = [text for _, text in named], 0
    else:
        texts, token_ids = _inputs(kind, body[field], field, media)
    messages = len(texts)  # each text has its template overhead; tools do not
    generates = kind.generates
    settings = affinity_of(model) if generates else None
    prefix, user = _affinity(kind, body, texts, named, settings) if settings else (None, None)
    texts += _rendered_texts(kind, body)
    fields = output_fields(kind)
    max_tokens = _max_tokens(body, fields)
    choices = 1
    if kind is not Kind.RESPONSES:  # it has no n: one answer
        n, best_of = (
            _bounded_int(body, "n", MAX_CHOICES),
            _bounded_int(body, "best_of", MAX_CHOICES),
        )
        choices = max(n or 1, best_of or 1) * _prompts(kind, body[field])
    asks_usage = kind in (Kind.CHAT, Kind.COMPLETION) and reports_stream_usage(model)
    options, strip_usage = (
        usage_options(body, continuous_usage(model)) if asks_usage else (None, False)
    )
    return InferenceRequest(
        kind=kind,
        model=model,
        stream=stream,
        text="".join(texts),
        token_ids=token_ids,
        max_tokens=max_tokens if generates else None,
        raw=upstream(body, raw, options, owns_priority(model)),
        strip_usage=strip_usage,
        choices=choices if generates else 1,
        messages=messages,
        names_output=not body.keys().isdisjoint(fields),
        media=tuple(media),
        affinity_prefix=prefix,
        affinity_user=user,
    )


class ExtraCost(Protocol):
    """A pool's cost rule for one of its extra paths (``config.ExtraCostSpec``)."""

    @property
    def fixed(self) -> int: ...

    @property
    def input_fields(self) -> Sequence[str]: ...


def parse_extra(
    raw: bytes,
    path: str,
    rule_of: Callable[[str], ExtraCost | None],
    owns_priority: Callable[[str], bool] = _never,
) -> InferenceRequest:
    """A request to an extra path (a pool's ``extra_paths``): a JSON object whose ``model``
    picks the pool, as for every route; ``rule_of(model)`` is that pool's cost rule for
    ``path``, None when the model's pool does not serve it (404). It counts its rule's
    ``fixed`` tokens plus the text of its ``input_fields`` (strings anywhere in them; the
    integers of their arrays as token ids), generates nothing the proxy can bound, and goes
    upstream as it came, but for the ``priority`` of a pool that ``owns_priority``."""
    body, unchecked = _json_object(raw)
    if unchecked:
        _no_lone_surrogate(raw, body)
    model = _model(body)
    rule = rule_of(model)
    if rule is None:
        raise ApiError(404, f"The model '{cut(model)}' is not served at {cut(path)} here.")
    texts: list[str] = []
    token_ids = 0
    for name in rule.input_fields:
        if name in body:
            found, ids = _field_texts(body[name])
            texts += found
            token_ids += ids
    return InferenceRequest(
        kind=Kind.EXTRA,
        model=model,
        stream=body.get("stream") is True,
        text="".join(texts),
        token_ids=token_ids,
        max_tokens=None,
        raw=upstream(body, raw, None, owns_priority(model)),
        messages=len(texts),
        fixed_tokens=rule.fixed,
        path=path,
    )


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string.")
    return model


def _field_texts(value: Any) -> tuple[list[str], int]:
    """The strings anywhere in ``value`` and the integers in its arrays (token ids). A
    loop, not recursion: a body nested as deep as the parser allows is no error."""
    texts: list[str] = []
    token_ids = 0
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, in_array = stack.pop()
        if isinstance(item, str):
            texts.append(item)
        elif in_array and _is_token(item):
            token_ids += 1
        elif isinstance(item, dict):  # [::-1], not reversed(): mypyc fails on that of Any
            stack.extend([(member, False) for member in list(item.values())[::-1]])
        elif isinstance(item, list):
            stack.extend([(element, True) for element in item[::-1]])
    return texts, token_ids


def _affinity(
    kind: Kind,
    body: dict[str, Any],
    texts: list[str],
    named: list[tuple[str, str]] | None,
    settings: affinity.Settings,
) -> tuple[str | None, str | None]:
    """The digests of the prompt's prefix (of a chat: its messages' roles and ``texts``; of
    a Responses API request: its ``named`` input) and, when the pool reads it, of the
    ``user`` field."""
    chars = settings.prefix_chars
    if named is not None:
        prefix = affinity.chat_prefix(named, chars)
    elif kind is Kind.CHAT:
        roles = [m.get("role") for m in body["messages"]]
        pairs = [(r if isinstance(r, str) else "", t) for r, t in zip(roles, texts, strict=True)]
        prefix = affinity.chat_prefix(pairs, chars)
    else:
        prefix = affinity.prompt_prefix(body["prompt"], chars)
    user = body.get("user") if settings.use_user_field else None
    user_key = affinity.digest("u", user) if isinstance(user, str) and user else None
    return affinity.prefix_key(prefix), user_key


def with_priority(request: InferenceRequest, value: int | None) -> InferenceRequest:
    """``request`` as sent to a pool whose engine is given its class's ``engine_priority``
    (``value``; None: none is sent, the engine's default applies). Its body names no
    ``priority`` (parsing took the client's out for such a pool), so the member is
    appended. Not to an extra path's route, which may not take one."""
    if value is None or request.kind is Kind.EXTRA:
        return request
    return replace(request, raw=appended(request.raw, ENGINE_PRIORITY, value))


def _json_object(raw: bytes) -> tuple[dict[str, Any], bool]:
    """``raw`` as a JSON object, read as strictly as RFC 8259 says a backend may read it,
    and whether it may still hold a lone surrogate (``_no_lone_surrogate`` tells).

    msgspec reads it first, at ~4× the stdlib's speed. What it takes, the stdlib's strict
    reading (``_strictly``) takes too, as the same values, and it holds no lone surrogate:
    msgspec refuses one, escaped or encoded (property tests hold it to both). What it
    refuses, that reading decides: it takes some (a huge number, a lone surrogate, which
    the caller refuses once it has checked the caps) and words the 400 of the rest.
    """
    unchecked = False
    try:
        body = _FAST.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        body, unchecked = _strictly(raw), True
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.")
    return body, unchecked


def _no_lone_surrogate(raw: bytes, body: dict[str, Any]) -> None:
    """A 400 when a string of ``body`` (read from ``raw`` by the stdlib) holds a lone
    surrogate. Its values are walked only when the bytes may hold one: a search of ``raw``
    at C speed rules it out for any other body, emoji escaped in pairs included."""
    if _MAYBE_LONE_SURROGATE.search(raw) and _has_lone_surrogate(body):
        raise ApiError(400, "The body holds a lone UTF-16 surrogate, which is not text.")


# the fewest bytes an item of a JSON array takes, its separator included ("1,"): a body
# shorter than this many times a cap cannot hold more items than the cap, so a small body
# (most requests) is not counted at all
_MIN_ITEM_BYTES = 2


def _within_caps(kind: Kind, body: dict[str, Any], caps: Caps) -> None:
    """A 400 naming the limit when the body has more messages (input items), content parts
    (over all of them) or tool definitions than ``caps`` allow. Their counts are read
    before any message is: one pass over the messages, after their number is checked."""
    field = "messages" if kind is Kind.CHAT else "input" if kind is Kind.RESPONSES else None
    items = body.get(field) if field else None
    if isinstance(items, list):
        if len(items) > caps.max_messages:
            raise _beyond(f"'{field}' has", len(items), "items", caps.max_messages, "max_messages")
        parts = 0
        for item in items:
            if isinstance(item, dict):
                content = item.get("content")
                if isinstance(content, list):
                    parts += len(content)
        if parts > caps.max_content_parts:
            raise _beyond(f"'{field}' has", parts, "content parts", caps.max_content_parts,
                          "max_content_parts")  # fmt: skip
    tools = body.get("tools")
    count = len(tools) if isinstance(tools, list) else 0
    if "functions" in body:  # the legacy name
        functions = body["functions"]
        count += len(functions) if isinstance(functions, list) else 0
    if count > caps.max_tools:
        raise _beyond("The request has", count, "tool definitions", caps.max_tools, "max_tools")


def _beyond(subject: str, count: int, what: str, cap: int, name: str) -> ApiError:
    return ApiError(400, f"{subject} {count} {what}; at most {cap} are accepted (limits.{name}).")


def _strictly(raw: bytes) -> Any:
    """``raw`` read by the stdlib, strictly. ``json.loads`` on bytes would guess UTF-16 or
    UTF-32 and pass encoded surrogates, and it takes ``NaN`` and ``Infinity``: a backend
    may read such a body otherwise or not at all, and the proxy edits the bytes of
    streaming bodies, so only UTF-8 is accepted."""
    try:
        text = raw.decode("utf-8")  # strict: no BOM-less UTF-16, no encoded surrogates
        return _DECODER.decode(text)
    except UnicodeDecodeError:
        raise ApiError(400, "The body must be JSON encoded as UTF-8.") from None
    except (ValueError, RecursionError):  # bad syntax, NaN, huge integers, nesting too deep
        raise ApiError(400, "The body is not valid JSON.") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# made once: ``json.loads`` with any option builds a decoder per call (~8 µs a request)
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_FAST = msgspec.json.Decoder()


def _has_lone_surrogate(body: dict[str, Any]) -> bool:
    """Whether a string anywhere in ``body`` cannot be encoded as UTF-8 (a lone surrogate).

    A loop, not recursion: a body nested as deep as the JSON parser allows must be a 400,
    not a RecursionError."""
    stack: list[Any] = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def _inputs(kind: Kind, value: Any, field: str, media: list[Media]) -> tuple[list[str], int]:
    """The texts and the number of token ids in a ``messages``/``prompt``/``input`` value;
    a chat's non-text content parts are added to ``media``."""
    if kind is Kind.CHAT:
        if not isinstance(value, list) or not value:
            raise ApiError(400, "'messages' must be a non-empty array.")
        return [_message_text(m, i, media) for i, m in enumerate(value)], 0
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


def _prompts(kind: Kind, value: Any) -> int:
    """How many prompts a request's input holds: a /v1/completions batch (an array of strings
    or of arrays of token ids) gets n choices for each of them, in vLLM as in OpenAI."""
    if kind is Kind.COMPLETION and isinstance(value, list) and not _is_token(value[0]):
        return len(value)
    return 1


# the roles whose markers are the template's tokens per message; any other is text too
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# what a message holds besides the text of its content, read apart
_READ_APART = frozenset({"role", "content", "tool_calls"})


def _rendered_texts(kind: Kind, body: dict[str, Any]) -> list[str]:
    """What a chat template renders into the prompt besides the messages' content: tool (and
    legacy function) definitions, and the tool calls of a chat's earlier turns, as compact
    JSON (a tenant must not get a 20 KB schema for free; an estimate like any other
    chars/token count); and every string of a message's other fields (its ``name``,
    ``tool_call_id``, ``reasoning_content``, ``refusal``, a legacy ``function_call``…), and
    its role when it is not one of the usual ones: templates render them, and reading every
    field rather than a list of names misses none a new template reads. (A Responses API
    request's earlier calls are input items, counted with its input.)"""
    if kind is Kind.RESPONSES:
        return [_compact(body["tools"])] if body.get("tools") else []
    if kind is not Kind.CHAT:
        return []
    texts = [_compact(body[name]) for name in ("tools", "functions") if body.get(name)]
    for message in body["messages"]:
        role = message.get("role")
        if len(message) == 2 and "content" in message and isinstance(role, str) and role in _ROLES:
            continue  # the usual message: its role is the template's, its content read
        if message.get("tool_calls"):
            texts.append(_compact(message["tool_calls"]))
        if isinstance(role, str) and role not in _ROLES:
            texts.append(role)
        rest = [value for name, value in message.items() if name not in _READ_APART]
        texts += _strings(rest)
    return texts


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _responses_input(body: dict[str, Any], media: list[Media]) -> list[tuple[str, str]]:
    """The (role, text) pairs of a Responses API request's prompt: its ``instructions``
    (the system message they become), then its ``input``, a string (one user message) or
    an array of items. A message item's ``content`` is read as a chat message's (its media
    parts go to ``media``); any other item (a function call, its output, a reasoning
    item…) is rendered into the prompt too, so it counts as its compact JSON, and, being
    an earlier turn's, it ends the affinity prefix as an answer does."""
    named: list[tuple[str, str]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string.")
    if instructions:
        named.append(("system", instructions))
    value = body["input"]
    if isinstance(value, str):
        return [*named, ("user", value)]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty array of input items.")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ApiError(400, f"'input[{i}]' must be an object.")
        if item.get("type", "message") == "message":
            role = item.get("role")
            text = _content_text(item.get("content"), f"input[{i}].content", media)
            named.append((role if isinstance(role, str) else "", text))
        else:
            named.append(("assistant", _compact(item)))
    return named


def _message_text(message: Any, index: int, media: list[Media]) -> str:
    """The text of one message; its image, audio, file and video parts go to ``media``."""
    if not isinstance(message, dict):
        raise ApiError(400, f"'messages[{index}]' must be an object.")
    return _content_text(message.get("content"), f"messages[{index}].content", media)


# the fields of a text part that hold no text: its type, its ids, and any media it carries
# (priced as media by core/media.py, so never read as text)
_NOT_TEXT = frozenset({"type", "id", "uuid", *MEDIA_FIELDS})


def _content_text(content: Any, where: str, media: list[Media]) -> str:
    """The text of a message's ``content`` (named ``where`` in errors): a string, or the
    text of its parts; its image, audio, file and video parts go to ``media``.

    A text part (of no type, or of a text type: ``text``, ``refusal``, ``thinking``…) counts
    every string in it but those of ``_NOT_TEXT``, not only its ``text``: a template renders
    a refusal's ``refusal`` and a thinking part's ``thinking``, and a field not named here
    must not hide text. A part of a media type, or of a type no server knows (priced as a
    file), is media only."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content
    ):  # a text of any part must be a string
        texts: list[str] = []
        for part in content:
            found = media_part(part)
            if found is not None:
                media.append(found)
            kind = part.get("type")
            if kind is None or (isinstance(kind, str) and kind in TEXT_TYPES):
                texts += _strings([v for k, v in part.items() if k not in _NOT_TEXT])
        return "".join(texts)
    raise ApiError(400, f"'{where}' must be a string or an array of parts.")


def _strings(values: list[Any]) -> list[str]:
    """Every string anywhere in ``values``, in order, the names of members not included. A
    loop, not recursion, and each value is visited once: linear in the body's size however
    deep it nests."""
    found: list[str] = []
    stack: list[Any] = values[::-1]  # [::-1], not reversed(): mypyc fails on that of Any
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(list(item.values())[::-1])
        elif isinstance(item, list):
            stack.extend(item[::-1])
    return found


def _max_tokens(body: dict[str, Any], fields: tuple[str, ...] = OUTPUT_FIELDS) -> int | None:
    """The output budget asked for; every token field present is checked, not only the
    one charged, because the backend may read the other."""
    found = None
    for name in fields:
        value = _bounded_int(body, name, MAX_OUTPUT_TOKENS)
        found = value if found is None else found
    return found


def _bounded_int(body: dict[str, Any], name: str, limit: int) -> int | None:
    """``body[name]``: absent or null, or an integer in [1, ``limit``] (else a 400)."""
    value = body.get(name)
    if value is None:
        return None
    if not _is_token(value) or not 1 <= value <= limit:
        raise ApiError(400, f"'{name}' must be an integer from 1 to {limit}.")
    return value


def _is_token(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
