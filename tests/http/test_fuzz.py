"""Fuzzing through the real proxy: hypothesis makes HTTP requests, a recording backend keeps
every body the proxy forwards to it.

The requests are mostly well-formed ones with one or two things wrong (token fields, content
parts, encodings, headers, sizes), plus random bytes and random JSON. After every example:

- every body that reached the backend keeps the forwarding contract
  (:func:`forwarding_problem`, written over raw bytes, independent of the proxy's parser);
- the answer is the backend's 200 relayed, or the proxy's own OpenAI-style JSON error with a
  4xx status (429/503 with ``Retry-After``), or a 504 ``deadline`` for a request that sent
  ``X-Request-Timeout``; never another 5xx (the backend here always answers well);
- the pool is whole: nothing queued or running, no slot held, no live idempotency key, and
  a well-formed probe is served at once (the only slot would otherwise stay taken).

Requests are written on a raw socket, so header values can hold any bytes HTTP allows and a
header can come twice. ``SFQ_FUZZ_EXAMPLES`` sets the examples per test; ``make fuzz`` runs
many more than ``make test``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import os
import re
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from proxy_lab import KEYS, MODEL, Lab, Served, leftovers, proxy_config
from yarl import URL

# examples per fuzz test: a bounded number in `make test`, many more in `make fuzz`
EXAMPLES = int(os.environ.get("SFQ_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    # one proxy per test, not per example, is the point; big or slow examples are meant
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

CHAT, COMPLETION, EMBEDDING = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
PATHS = (CHAT, COMPLETION, EMBEDDING)
# the Responses API, and an extra path of the Rig's pool (its fields priced as input)
RESPONSES, RERANK = "/v1/responses", "/v1/rerank"
RERANK_FIELDS = ["query", "documents"]
SURFACE = (RESPONSES, RERANK)
INPUT_FIELD = {
    CHAT: "messages",
    COMPLETION: "prompt",
    EMBEDDING: "input",
    RESPONSES: "input",
    RERANK: "query",
}
MAX_TOKENS = 10_000_000
MAX_CHOICES = 128  # n, best_of
# the Rig's ceiling per request (its highest allowed value), and the most a well-formed
# request asks per choice: 128 choices of it for each of up to 3 prompts of a batch, and a
# short input, stay under the ceiling
CEILING = 100_000_000
WELL_FORMED_MAX_TOKENS = 250_000
DEFAULT_MAX_TOKENS = 512  # what the proxy writes upstream for a request that sets none
TOKEN_FIELDS = {
    "max_tokens": MAX_TOKENS,
    "max_completion_tokens": MAX_TOKENS,
    "n": MAX_CHOICES,
    "best_of": MAX_CHOICES,
}
KEY_CLASSES = {  # as tests/support/proxy_lab.py's config grants them
    KEYS["A"]: ("batch", "interactive"),
    KEYS["B"]: ("batch",),
    KEYS["C"]: ("interactive",),
    KEYS["OPS"]: ("interactive",),  # not system: the Rig's 1-slot pool cannot have a band
}
AUTH_A = ((b"Authorization", f"Bearer {KEYS['A']}".encode()),)
USAGE_ASKED = '"stream_options":{"include_usage":true}'
WAIT_S = 10.0  # for what should take milliseconds: slack for a stalled shared machine


# --- the forwarding contract, over raw bytes -------------------------------------------


class Malformed(ValueError):
    """Why a body must never reach the backend."""


def forwarding_problem(path: str, raw: bytes) -> str | None:
    """Why ``raw``, forwarded on ``path``, breaks the contract; None when it keeps it."""
    try:
        _check_fields(path, strict_json(raw))
    except Malformed as err:
        return str(err)
    return None


def strict_json(raw: bytes) -> Any:
    """``raw`` as JSON, refusing what lenient parsers let through: any encoding but UTF-8,
    a BOM, encoded surrogates, NaN/Infinity, lone surrogate escapes."""
    try:
        text = raw.decode("utf-8")  # strict: encoded surrogates (ED A0 80) fail here
    except UnicodeDecodeError as err:
        raise Malformed(f"not UTF-8 ({err.reason} at byte {err.start})") from None
    if text.startswith("\ufeff"):
        raise Malformed("starts with a byte order mark")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_int=_parse_int)
    except Malformed:
        raise
    except RecursionError:
        raise Malformed("nested too deep to parse") from None
    except ValueError as err:
        raise Malformed(f"not JSON: {err}") from None
    if _has_lone_surrogate(value):
        raise Malformed("a string holds a lone surrogate")
    return value


def _no_constant(name: str) -> Any:
    raise Malformed(f"the literal {name} is not JSON")


def _parse_int(digits: str) -> int:
    """Any integer literal, however long (``int()`` refuses more than 4300 digits)."""
    sign, digits = (-1, digits[1:]) if digits.startswith("-") else (1, digits)
    value = 0
    for start in range(0, len(digits), 1000):
        chunk = digits[start : start + 1000]
        value = value * 10 ** len(chunk) + int(chunk)
    return sign * value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    """A valid escaped pair decodes to one astral character; only a lone half remains a
    surrogate code point. Walked without recursion: the nesting may be deep."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _check_fields(path: str, body: Any) -> None:
    if not isinstance(body, dict):
        raise Malformed(f"not a JSON object but {type(body).__name__}")
    if body.get("model") != MODEL:
        raise Malformed(f"'model' is {body.get('model')!r}, not the pool's {MODEL!r}")
    if path == RERANK:  # an extra path: routed by its model, priced, sent as it came
        return
    if "stream" in body and not isinstance(body["stream"], bool):
        raise Malformed(f"'stream' is {body['stream']!r}")
    if path == RESPONSES:
        _check_responses(body)
        return
    for name, top in TOKEN_FIELDS.items():
        value = body.get(name)
        if value is not None and not (_is_int(value) and 1 <= value <= top):
            raise Malformed(f"{name!r} is {_short(value)}, not an integer in [1, {top}]")
    field = INPUT_FIELD[path]
    if field not in body:
        raise Malformed(f"no {field!r}")
    if path == CHAT:
        _check_messages(body["messages"])
    elif not _is_prompt(body[field]):
        raise Malformed(f"{field!r} is {_short(body[field])}")


def _check_responses(body: dict[str, Any]) -> None:
    """The Responses API's fields the proxy prices on: its one token field, its
    instructions, and its input (a string, or input items whose messages are as a chat's)."""
    value = body.get("max_output_tokens")
    if value is not None and not (_is_int(value) and 1 <= value <= MAX_TOKENS):
        raise Malformed(f"'max_output_tokens' is {_short(value)}")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise Malformed(f"'instructions' is {_short(body['instructions'])}")
    if "input" not in body:
        raise Malformed("no 'input'")
    items = body["input"]
    if isinstance(items, str):
        return
    if not isinstance(items, list) or not items:
        raise Malformed(f"'input' is {_short(items)}")
    if not all(isinstance(item, dict) for item in items):
        raise Malformed(f"'input' is {_short(items)}, not an array of objects")
    messages = [item for item in items if item.get("type", "message") == "message"]
    if messages:
        _check_messages(messages)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise Malformed(f"'messages' is {_short(messages)}, not a non-empty array")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Malformed(f"messages[{i}] is {_short(message)}, not an object")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise Malformed(f"messages[{i}].content is {_short(content)}")
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise Malformed(f"messages[{i}].content[{j}] is {_short(part)}, not an object")
            if "text" in part and not isinstance(part["text"], str):
                raise Malformed(f"messages[{i}].content[{j}].text is {_short(part['text'])}")


def _is_prompt(value: Any) -> bool:
    """A string, or an array of strings, of token ids, or of arrays of token ids."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list):
        return False
    return (
        all(isinstance(x, str) for x in value)
        or all(_is_token_id(x) for x in value)
        or all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in value)
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _short(value: Any) -> str:
    big = _is_int(value) and abs(value) >= 10**30  # repr() refuses beyond 4300 digits
    text = f"an integer of {value.bit_length()} bits" if big else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- the recording backend ---------------------------------------------------------------


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


HOLDER_BODY = _json_bytes(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hold"}],
        "user": "sfq-fuzz-hold",
        "max_tokens": 1,  # set, so that the proxy forwards these very bytes
    }
)
PROBE_BODY = _json_bytes(
    {"model": MODEL, "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1}
)
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


RESPONSE = {"id": "resp_fuzz", "object": "response", "created_at": 0, "model": MODEL,
            "status": "completed", "output": [], "usage": {"input_tokens": 3, "output_tokens": 2,
            "total_tokens": 5}}  # fmt: skip


def _answer(path: str) -> dict[str, Any]:
    """A valid non-streamed answer for ``path``."""
    if path == RESPONSES:
        return RESPONSE
    if path == RERANK:
        return {"id": "rerank-fuzz", "results": [{"index": 0, "relevance_score": 0.5}]}
    if path == EMBEDDING:
        return {
            "object": "list",
            "model": MODEL,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
            "usage": {"prompt_tokens": 3, "total_tokens": 3},
        }
    if path == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
        kind = "chat.completion"
    else:
        choice, kind = {"index": 0, "text": "ok"}, "text_completion"
    choice["finish_reason"] = "stop"
    return {"id": "fuzz", "object": kind, "created": 0, "model": MODEL, "choices": [choice],
            "usage": USAGE}  # fmt: skip


def _events(path: str) -> list[bytes]:
    """A short valid stream for ``path``: a token, the finish, the usage chunk, [DONE]; or
    the Responses API's events, the usage in the last, no [DONE]."""
    if path == RESPONSES:

        def event(kind: str, **data: Any) -> bytes:
            payload = _json_bytes({"type": kind, **data})
            return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

        return [
            event("response.created"),
            event("response.output_text.delta", delta="ok"),
            event("response.completed", response=RESPONSE),
        ]
    kind = "chat.completion.chunk" if path == CHAT else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": "fuzz", "object": kind, "created": 0, "model": MODEL, "choices": choices}
        return b"data: " + _json_bytes({**data, **extra}) + b"\n\n"

    def choice(text: str, finish: str | None) -> dict[str, Any]:
        token = {"delta": {"content": text}} if path == CHAT else {"text": text}
        return {"index": 0, **token, "finish_reason": finish}

    return [
        chunk([choice("ok", None)]),
        chunk([choice("", "stop")]),
        chunk([], usage=USAGE),
        b"data: [DONE]\n\n",
    ]


class Recorder:
    """The backend: keeps every body it is sent and answers each well, streamed when the
    body asks for it. The holder's body waits for :attr:`release`, keeping the only slot."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, bytes]] = []
        self.release = asyncio.Event()
        self.release.set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in PATHS + SURFACE:
            app.router.add_post(path, self._answer)
        app.router.add_get("/health", self._health)
        return app

    def forwarded(self) -> list[tuple[str, bytes]]:
        """What reached the backend, but the holder's request."""
        return [(path, raw) for path, raw in self.bodies if raw != HOLDER_BODY]

    @property
    def holding(self) -> bool:
        return any(raw == HOLDER_BODY for _, raw in self.bodies)

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append((request.path, raw))
        if raw == HOLDER_BODY:
            await self.release.wait()
        if request.path in (EMBEDDING, RERANK) or not _asks_to_stream(raw):
            return web.json_response(_answer(request.path))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _events(request.path):
            await response.write(event)
        await response.write_eof()
        return response


def _asks_to_stream(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(body, dict) and body.get("stream") is True


# --- requests on a raw socket ----------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One request: its path, body bytes and header lines. With ``hold`` (seconds), another
    request holds the pool's only slot when it is sent, so that it queues, and keeps it that
    long once it waits."""

    path: str
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = AUTH_A
    hold: float | None = None

    def sends(self, name: str) -> list[bytes]:
        """The values of header ``name`` it sends."""
        return [value for key, value in self.headers if key.lower() == name.lower().encode()]


@dataclass(frozen=True)
class Answer:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def error_code(self) -> Any:
        with contextlib.suppress(ValueError, LookupError, TypeError):
            return json.loads(self.body)["error"]["code"]
        return None


def request_bytes(case: Case) -> bytes:
    head = [
        f"POST {case.path} HTTP/1.1".encode(),
        b"Host: 127.0.0.1",
        b"Connection: close",
        b"Content-Length: %d" % len(case.body),
        *(name + b": " + value for name, value in case.headers),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + case.body


async def send(port: int, case: Case) -> Answer:
    """Send ``case`` on a new connection and read the answer to its end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(case))
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    return parse_answer(data)


def parse_answer(data: bytes) -> Answer:
    head, separator, body = data.partition(b"\r\n\r\n")
    assert separator, f"the connection closed without an answer: {data[:200]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    if headers.get("Transfer-Encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return Answer(int(status_line.split()[1]), headers, body)


def _dechunk(data: bytes) -> bytes:
    out, position = [], 0
    while True:
        end = data.index(b"\r\n", position)
        size = int(data[position:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2 : end + 2 + size])
        position = end + 2 + size + 2


# --- the rig: one proxy and one recording backend per test function --------------------


@dataclass(repr=False)
class Rig:
    """A proxy with a single slot in front of a recording backend: a slot held by mistake
    stops every later request, which the probe after each example notices."""

    lab: Lab
    recorder: Recorder
    backend_url: str
    served: Served = field(init=False)

    async def start(self) -> Rig:
        """A fresh proxy: after a broken pool, so that later examples are not failed by
        an earlier one's leftovers (the old proxy runs on, unused, until the test ends)."""
        pool = {
            "cost": {"max_request_tokens": CEILING},
            "extra_paths": [{"path": RERANK, "cost": {"fixed": 5, "input_fields": RERANK_FIELDS}}],
        }
        self.served = await self.lab.proxy(proxy_config([self.backend_url], slots=1, pool=pool))
        return self

    def __repr__(self) -> str:  # in hypothesis's report of a failing example
        return f"Rig({self.served.url})"

    @property
    def port(self) -> int:
        port = URL(self.served.url).port
        assert port is not None
        return port

    @property
    def queued(self) -> int:
        return self.served.state.pools["sim"].scheduler.queued()


@pytest.fixture
async def rig(lab: Lab) -> Rig:
    recorder = Recorder()
    port = await lab.serve(recorder.app())
    rig = await Rig(lab, recorder, f"http://127.0.0.1:{port}").start()
    await assert_whole(rig)
    return rig


async def until(predicate: Callable[[], bool], within: float = WAIT_S) -> bool:
    """Poll ``predicate`` (state the proxy changes as it runs); whether it came to hold."""
    for _ in range(round(within / 0.005)):
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return predicate()


@contextlib.asynccontextmanager
async def holding(rig: Rig, hold: bool) -> AsyncIterator[None]:
    """With ``hold``, a well-formed request keeps the only slot for the block's duration."""
    if not hold:
        yield
        return
    rig.recorder.release.clear()
    holder = asyncio.create_task(send(rig.port, Case(CHAT, HOLDER_BODY)))
    try:
        assert await until(lambda: rig.recorder.holding), "the holder was not dispatched"
        yield
    finally:
        rig.recorder.release.set()
        answer = await asyncio.wait_for(holder, WAIT_S)
    assert answer.status == 200, f"the holder got {answer.status}: {answer.body[:300]!r}"


async def exchange(rig: Rig, case: Case) -> tuple[Answer, list[tuple[str, bytes]]]:
    """Send ``case`` and check everything the fuzz suite promises about it; the answer,
    and what reached the backend."""
    rig.recorder.bodies.clear()
    reply: asyncio.Task[Answer] | None = None
    try:
        async with holding(rig, case.hold is not None):
            reply = asyncio.create_task(send(rig.port, case))
            if case.hold is not None:  # the request waits (or was answered) for a while
                await until(lambda: reply.done() or rig.queued > 0)
                await asyncio.sleep(case.hold)
        answer = await asyncio.wait_for(reply, WAIT_S * 3)
        forwarded = rig.recorder.forwarded()
        for path, raw in forwarded:
            assert_forwardable(path, raw)
        assert_answer(case, answer, len(forwarded))
    finally:  # whatever failed may have broken the pool too: that is told first
        if reply is not None:
            reply.cancel()
        await assert_whole(rig)
    return answer, forwarded


# --- what is asserted -------------------------------------------------------------------


def assert_forwardable(path: str, raw: bytes) -> None:
    problem = forwarding_problem(path, raw)
    assert problem is None, f"forwarded to the backend on {path}: {problem}\n  {raw[:400]!r}"


def assert_answer(case: Case, answer: Answer, forwarded: int) -> None:
    """The backend's 200 relayed, or an error of the proxy's own of the documented shape."""
    said = f"{answer.status} {answer.headers.get('Content-Type')}: {answer.body[:400]!r}"
    if answer.status == 200:
        assert forwarded == 1, f"a 200 after {forwarded} bodies reached the backend"
        problem = _relayed_problem(case.path, answer)
        assert problem is None, f"the 200 is not the backend's answer ({problem}): {said}"
        return
    deadline = answer.status == 504 and answer.error_code() == "deadline"
    assert 400 <= answer.status < 500 or deadline, f"the proxy's own {answer.status}: {said}"
    assert not deadline or case.sends("X-Request-Timeout"), f"a deadline nobody set: {said}"
    problem = _error_problem(answer)
    assert problem is None, f"not an OpenAI-style error ({problem}): {said}"
    # the client's bound covers the upstream exchange too: a deadline may pass after dispatch
    assert forwarded <= (1 if deadline else 0), f"a {answer.status} after {forwarded} bodies"


def _error_problem(answer: Answer) -> str | None:
    if not answer.headers.get("Content-Type", "").startswith("application/json"):
        return "not JSON"
    try:
        error = json.loads(answer.body)["error"]
    except (ValueError, KeyError, TypeError):
        return "no 'error' object"
    if not isinstance(error, dict) or set(error) != {"message", "type", "code"}:
        return "'error' is not {message, type, code}"
    if not all(isinstance(error[k], str) for k in ("message", "type", "code")):
        return "a member of 'error' is not a string"
    if answer.status in (429, 503) and not answer.headers.get("Retry-After", "").isdigit():
        return "no Retry-After"
    return None


def _relayed_problem(path: str, answer: Answer) -> str | None:
    if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
        if path == RESPONSES:
            return None if answer.body == b"".join(_events(path)) else "not the events sent"
        events = [e for e in answer.body.split(b"\n\n") if e.strip()]
        if not events or events[-1] != b"data: [DONE]":
            return "the stream does not end with data: [DONE]"
        for event in events[:-1]:
            with contextlib.suppress(ValueError):
                if event.startswith(b"data: ") and isinstance(json.loads(event[6:]), dict):
                    continue
            return f"a bad event {event[:100]!r}"
        return None
    try:
        relayed = json.loads(answer.body)
    except ValueError:
        return "not JSON"
    return None if relayed == _answer(path) else "not what the backend answered"


async def assert_whole(rig: Rig) -> None:
    """Nothing left behind, and a well-formed probe dispatched at once: with one slot, a
    slot held or a phantom entry ahead of it would keep it waiting. A broken pool is
    replaced by a fresh proxy once noticed."""
    await until(lambda: not leftovers(rig.served))
    left = leftovers(rig.served)
    if left:
        await rig.start()
    assert not left, f"the pool is not whole: {left}"
    rig.recorder.bodies.clear()
    try:
        probe = await asyncio.wait_for(send(rig.port, Case(CHAT, PROBE_BODY)), WAIT_S)
    except TimeoutError:
        probe = None
    rig.recorder.bodies.clear()
    if probe is None or probe.status != 200:
        await rig.start()
    assert probe is not None, f"the probe was not served within {WAIT_S:g} s"
    assert probe.status == 200, f"the probe got {probe.status}: {probe.body[:300]!r}"


# --- strategies -------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text written verbatim: what ``json.dumps`` will not write (a 300-digit literal,
    a lone surrogate escape, deep nesting, a duplicate key)."""

    text: str


def render(value: Any) -> str:
    """``value`` as JSON text, :class:`Raw` parts as they are; NaN floats as ``NaN``."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        members = (
            f"{render(k if isinstance(k, Raw) else str(k))}:{render(v)}" for k, v in value.items()
        )
        return "{" + ",".join(members) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def encode(value: Any) -> bytes:
    return render(value).encode("utf-8", "surrogatepass")


texts = st.text(max_size=24)
token_ids = st.lists(st.integers(0, 150_000), min_size=1, max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=12,
)

ODD_LITERALS = [
    "0", "-0", "-1", "10000001", "129", str(2**63), str(2**64), "1" + "0" * 300,
    "-1" + "0" * 40, "1.0", "1.5", "1e3", "1E400", "-1e400", "1e-400", "0.0",
    "NaN", "Infinity", "-Infinity", "true", "false", "null", '"5"', '""', "[]", "{}", "[5]",
    '{"n":1}', '"\\ud800"', '"\\udfff"', '"x\\ud83d"', '"\\ude00x"', '"\\ud83d\\ude00"',
    "9" * 5000,
]  # fmt: skip
odd_numbers = st.one_of(
    st.sampled_from(ODD_LITERALS).map(Raw),
    st.integers(0, 400).map(lambda zeros: Raw("1" + "0" * zeros)),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN and ±Infinity included: json.dumps writes them as literals
    st.booleans(),
    st.none(),
    texts,
    st.lists(st.integers(-2, 5), max_size=2),
)
odd_values = odd_numbers | st.dictionaries(texts, st.integers(), max_size=2) | json_values
odd_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": odd_values}),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["image_url", "input_audio", "video_url", "x-unknown", ""])},
            optional={"image_url": odd_values, "text": texts},
        ),
        st.fixed_dictionaries({}, optional={"type": odd_values, "text": odd_values}),
        texts,
        st.integers(),
        st.none(),
        st.lists(texts, max_size=2),
    ),
    max_size=4,
)
odd_messages = st.one_of(
    odd_values,
    st.just([]),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"role": st.just("user")}, optional={"content": odd_values}),
            st.fixed_dictionaries({"role": st.just("user"), "content": odd_parts}),
            texts,
            st.integers(),
            st.none(),
            st.lists(texts, max_size=2),
        ),
        min_size=1,
        max_size=3,
    ),
)
odd_prompts = st.one_of(
    odd_values,
    st.sampled_from([[], [[]], [[], [1]], {}, [-1], [True], [1.5], [1, "a"], [[1, "a"]], [["a"]]]),
    st.lists(odd_numbers, min_size=1, max_size=3),
    st.lists(st.lists(odd_numbers, min_size=1, max_size=2), min_size=1, max_size=2),
    st.lists(st.one_of(texts, st.integers(-3, 3), st.none(), st.lists(st.integers(-3, 3))),
             min_size=1, max_size=4),
)  # fmt: skip


def _parts() -> st.SearchStrategy[list[dict[str, Any]]]:
    text = st.builds(lambda t: {"type": "text", "text": t}, texts)
    image = st.builds(
        lambda url: {"type": "image_url", "image_url": {"url": url}},
        st.just("data:image/png;base64,iVBORw0KGgo="),
    )
    return st.lists(text | image, min_size=1, max_size=3)


messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"])},
        optional={"content": texts | st.none() | _parts()},
    ),
    min_size=1,
    max_size=3,
)
prompts = st.one_of(
    texts,
    st.lists(texts, min_size=1, max_size=3),
    token_ids,
    st.lists(token_ids, min_size=1, max_size=3),
)
INPUTS = {CHAT: messages, COMPLETION: prompts, EMBEDDING: prompts}
GENERATION_OPTIONS = {
    "stream": st.booleans(),
    "max_tokens": st.none() | st.integers(1, WELL_FORMED_MAX_TOKENS),
    "max_completion_tokens": st.none() | st.integers(1, WELL_FORMED_MAX_TOKENS),
    "n": st.integers(1, MAX_CHOICES),
    "temperature": st.floats(0, 2),
    "user": texts,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
EMBEDDING_OPTIONS = {"user": texts, "encoding_format": st.just("float")}


@st.composite
def well_formed(draw: st.DrawFn, paths: tuple[str, ...] = PATHS) -> tuple[str, dict[Any, Any]]:
    """A request the contract lets through: (path, body)."""
    path = draw(st.sampled_from(paths))
    options = EMBEDDING_OPTIONS if path == EMBEDDING else GENERATION_OPTIONS
    if path == COMPLETION:
        options = {**options, "best_of": st.integers(1, MAX_CHOICES)}
    body = {"model": MODEL, INPUT_FIELD[path]: draw(INPUTS[path])}
    body.update(draw(st.fixed_dictionaries({}, optional=options)))
    return path, body


Mutation = Callable[[st.DrawFn, str, dict[Any, Any]], Any]


def _odd_token_field(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    body[draw(st.sampled_from(list(TOKEN_FIELDS)))] = draw(odd_numbers)
    return body


def _one_good_one_bad(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    """max_tokens and max_completion_tokens both, one of them valid, in either order."""
    names = draw(st.permutations(["max_tokens", "max_completion_tokens"]))
    good = draw(st.sampled_from(names))
    for name in names:
        body.pop(name, None)
        body[name] = draw(st.integers(1, MAX_TOKENS)) if name == good else draw(odd_numbers)
    return body


def _odd_model(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    if draw(st.booleans()):
        body.pop("model", None)
    else:
        names = st.sampled_from(["", "other-model", MODEL.upper(), " " + MODEL])
        body["model"] = draw(names | odd_values)
    return body


def _odd_stream(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    body["stream"] = draw(odd_values)
    return body


def _odd_stream_options(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    body["stream"] = True
    body["stream_options"] = draw(odd_values | st.fixed_dictionaries({"include_usage": odd_values}))
    return body


def _odd_input(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    field = INPUT_FIELD[path]
    if draw(st.integers(0, 5)) == 0:
        body.pop(field, None)
    else:
        body[field] = draw(odd_messages if path == CHAT else odd_prompts)
    return body


def _odd_parts(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    if path != CHAT or not isinstance(body.get("messages"), list) or not body["messages"]:
        return _odd_input(draw, path, body)
    index = draw(st.integers(0, len(body["messages"]) - 1))
    body["messages"][index] = {"role": "user", "content": draw(odd_parts)}
    return body


SURROGATES = ['"\\ud800"', '"\\udc00"', '"a\\udbff"', '"\\udfffz"', '"\\ud83d\\ude00"']


def _lone_surrogate(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    """A surrogate escape (mostly lone, sometimes a valid pair) as a value, key or text."""
    escape = Raw(draw(st.sampled_from(SURROGATES)))
    where = draw(st.sampled_from(["user", "key", "input", "model"]))
    if where == "key":
        body[escape] = 1
    elif where == "input" and path == CHAT:
        body["messages"] = [{"role": "user", "content": escape}]
    elif where == "input":
        body[INPUT_FIELD[path]] = draw(st.sampled_from([escape, [escape]]))
    else:
        body[where] = escape
    return body


def _non_finite(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    literal = Raw(draw(st.sampled_from(["NaN", "Infinity", "-Infinity"])))
    where = draw(st.sampled_from(["temperature", "top_p", "seed", "logit_bias", "max_tokens"]))
    body[where] = {"50256": literal} if where == "logit_bias" else literal
    return body


def _deep(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    depth = draw(st.sampled_from([10, 100, 999, 1001, 3000, 10_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = Raw(opener * depth + ("1" if opener != "[" else "") + closer * depth)
    where = draw(st.sampled_from(["metadata", INPUT_FIELD[path]]))
    body[where] = nested
    return body


def _duplicate_key(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    """The same key twice: a parser that keeps the first and one that keeps the last must
    not disagree on what is forwarded."""
    name = draw(st.sampled_from(["model", "stream", "max_tokens", INPUT_FIELD[path]]))
    body[Raw(json.dumps(name))] = draw(odd_values)
    return body


def _large(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    """A big input (up to some 60 KiB), well-formed itself: long text, many messages, parts
    or token ids."""
    size = draw(st.sampled_from([1_000, 20_000, 60_000]))
    if path == CHAT:
        body["messages"] = draw(
            st.sampled_from([
                [{"role": "user", "content": "x" * size}],
                [{"role": "user", "content": "é"}] * (size // 40),
                [{"role": "user", "content": [{"type": "text", "text": "y"}] * (size // 30)}],
            ])
        )  # fmt: skip
    else:
        body[INPUT_FIELD[path]] = draw(
            st.sampled_from(["x" * size, [7] * (size // 2), [[1, 2]] * (size // 6)])
        )
    return body


def _not_an_object(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    return draw(st.one_of(st.just([body]), json_values, st.just(Raw(""))))


def _extra_field(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    body[draw(texts)] = draw(json_values)
    return body


MUTATIONS: list[Mutation] = [
    _odd_token_field, _one_good_one_bad, _odd_model, _odd_stream, _odd_stream_options,
    _odd_input, _odd_parts, _lone_surrogate, _non_finite, _deep, _duplicate_key, _large,
    _not_an_object, _extra_field,
]  # fmt: skip


def _twist(draw: st.DrawFn, text: str) -> str:
    """Mostly nothing; sometimes the text is cut, padded, or has junk around it."""
    how = draw(st.sampled_from(["as is"] * 6 + ["cut", "junk after", "spaces", "junk before"]))
    if how == "cut" and text:
        return text[: draw(st.integers(0, len(text) - 1))]
    if how == "junk after":
        return text + draw(st.sampled_from(["}", "]", ",", "x", " {}", "\x00", "\n\n{}"]))
    if how == "spaces":
        return draw(st.sampled_from([" ", "\n", "\t\r\n"])) + text + " \n"
    if how == "junk before":
        return draw(st.sampled_from(["\x00", ",", "x", "\u00a0", "\u2028"])) + text
    return text


@st.composite
def near_valid(draw: st.DrawFn) -> Case:
    """A well-formed request with one or two things wrong, then maybe cut or padded."""
    mutations = draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=2))
    path, body = draw(well_formed(paths=(CHAT,) if _odd_parts in mutations else PATHS))
    body = copy.deepcopy(body)
    for mutate in mutations:
        if isinstance(body, dict):
            body = mutate(draw, path, body)
    text = _twist(draw, render(body))
    return Case(path, text.encode("utf-8", "surrogatepass"))


@st.composite
def random_bodies(draw: st.DrawFn) -> Case:
    """Anything: bytes, any JSON, or an object with the right model and a random input."""
    path = draw(st.sampled_from(PATHS))
    body = draw(
        st.one_of(
            st.binary(max_size=512),
            json_values.map(encode),
            st.builds(
                lambda value, extra: encode({"model": MODEL, INPUT_FIELD[path]: value, **extra}),
                json_values,
                st.dictionaries(texts, json_values, max_size=3),
            ),
        )
    )
    return Case(path, body)


# --- the Responses API and an extra path ---------------------------------------------------

input_parts = st.lists(
    st.one_of(
        st.builds(lambda t: {"type": "input_text", "text": t}, texts),
        st.builds(lambda t: {"type": "output_text", "text": t, "annotations": []}, texts),
        st.just({"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}),
        st.just({"type": "input_file", "file_id": "file-1"}),
    ),
    min_size=1,
    max_size=3,
)
ROLES = st.sampled_from(["user", "system", "developer", "assistant"])
input_items = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": ROLES, "content": texts | input_parts}),
        st.fixed_dictionaries({"type": st.just("message"), "role": ROLES, "content": input_parts}),
        st.fixed_dictionaries(
            {"type": st.just("function_call"), "call_id": texts, "name": texts, "arguments": texts}
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": texts, "output": texts}
        ),
        st.fixed_dictionaries({"type": st.just("item_reference"), "id": texts}),
    ),
    min_size=1,
    max_size=4,
)
tools = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "name": texts, "parameters": st.just({"type": "object"})}
    ),
    max_size=2,
)
RESPONSES_OPTIONS = {
    "stream": st.booleans(),
    "max_output_tokens": st.none() | st.integers(1, WELL_FORMED_MAX_TOKENS),
    "instructions": st.none() | texts,
    "temperature": st.floats(0, 2),
    "user": texts,
    "tools": tools,
}
RERANK_OPTIONS = {"top_n": st.integers(1, 5), "return_documents": st.booleans()}


@st.composite
def well_formed_surface(draw: st.DrawFn) -> tuple[str, dict[Any, Any]]:
    """A Responses API request, or one to the Rig's extra path, that the contract lets
    through: (path, body)."""
    path = draw(st.sampled_from(SURFACE))
    if path == RERANK:
        documents = st.lists(texts | st.fixed_dictionaries({"text": texts}), max_size=4)
        body = {"model": MODEL, "query": draw(texts), "documents": draw(documents)}
        body.update(draw(st.fixed_dictionaries({}, optional=RERANK_OPTIONS)))
        return path, body
    body = {"model": MODEL, "input": draw(texts | input_items)}
    body.update(draw(st.fixed_dictionaries({}, optional=RESPONSES_OPTIONS)))
    return path, body


def _odd_surface_field(draw: st.DrawFn, path: str, body: dict[Any, Any]) -> Any:
    """A field the proxy prices on, odd: the Responses API's input, one of its items or
    their content, its instructions or max_output_tokens; a priced field of the extra path."""
    if path == RERANK:
        body[draw(st.sampled_from(RERANK_FIELDS))] = draw(odd_values | odd_prompts | odd_messages)
        return body
    where = draw(st.sampled_from(["input", "item", "content", "instructions", "max_output_tokens"]))
    if where == "input":
        body["input"] = draw(odd_messages | odd_prompts)
    elif where == "item":
        body["input"] = [{"role": "user", "content": "x"}, draw(odd_values)]
    elif where == "content":
        body["input"] = [
            {"type": "message", "role": "user", "content": draw(odd_parts | odd_values)}
        ]
    elif where == "instructions":
        body["instructions"] = draw(odd_values)
    else:
        body["max_output_tokens"] = draw(odd_numbers)
    return body


SURFACE_MUTATIONS: list[Mutation] = [
    _odd_surface_field, _odd_surface_field, _odd_model, _odd_stream, _lone_surrogate,
    _non_finite, _deep, _duplicate_key, _large, _not_an_object, _extra_field,
]  # fmt: skip


@st.composite
def near_valid_surface(draw: st.DrawFn) -> Case:
    """A well-formed Responses API or extra path request with one or two things wrong."""
    mutations = draw(st.lists(st.sampled_from(SURFACE_MUTATIONS), min_size=1, max_size=2))
    path, body = draw(well_formed_surface())
    body = copy.deepcopy(body)
    for mutate in mutations:
        if isinstance(body, dict):
            body = mutate(draw, path, body)
    return Case(path, _twist(draw, render(body)).encode("utf-8", "surrogatepass"))


MARK = "\ue000"  # in the text of a body, where a byte-level flaw is put
BAD_UTF8 = [
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80", b"\xc0\xaf", b"\xe0\x80\xaf",
    b"\x80", b"\xff", b"\xfe", b"\xf0\x9f\x98", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",
]  # fmt: skip
TEXT_ENCODINGS = [
    "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le",
    "utf-32-be", "latin-1", "cp1252",
]  # fmt: skip
CONTENT_TYPES = [
    b"application/json", b"application/json; charset=utf-16", b"text/plain; charset=latin-1",
    b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b"",
]  # fmt: skip


@cache
def _gzip_bomb() -> bytes:
    """A valid body padded with 24 MiB of spaces, gzipped to some 24 KiB: larger than the
    proxy's body limit only once inflated."""
    body = encode({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    return gzip.compress(body + b" " * (24 * 1024 * 1024), compresslevel=9)


def _content_encoding(draw: st.DrawFn, body: bytes) -> tuple[bytes, tuple[bytes, ...]]:
    """The body as sent and its Content-Encoding header value, if any."""
    how = draw(st.sampled_from(["none"] * 4 + ["gzip", "deflate", "lie", "unknown", "bomb"]))
    if how == "gzip":
        return gzip.compress(body), (b"gzip",)
    if how == "deflate":
        return zlib.compress(body), (b"deflate",)
    if how == "lie":  # says compressed, is not
        return body, (draw(st.sampled_from([b"gzip", b"deflate", b"br", b"zstd"])),)
    if how == "unknown":
        return body, (draw(st.sampled_from([b"identity", b"x-unknown", b"gzip, gzip", b""])),)
    if how == "bomb":
        return _gzip_bomb(), (b"gzip",)
    return body, ()


@st.composite
def encoded(draw: st.DrawFn) -> Case:
    """A well-formed request whose bytes are not UTF-8, or hold a bad sequence, or come
    compressed, under any Content-Type."""
    path, body = draw(well_formed())
    body = {**body, "user": draw(st.sampled_from(["é€😀", "plain", "ÿ"])) + MARK}
    text = render(body)
    encoding = draw(st.sampled_from(TEXT_ENCODINGS))
    raw = text.encode(encoding, "ignore")
    if encoding == "utf-8":
        raw = raw.replace(MARK.encode(), draw(st.sampled_from([MARK.encode(), *BAD_UTF8])))
    raw, content_encoding = _content_encoding(draw, raw)
    headers = list(AUTH_A) + [(b"Content-Encoding", v) for v in content_encoding]
    content_type = draw(st.none() | st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers.append((b"Content-Type", content_type))
    return Case(path, raw, tuple(headers))


# header values: any byte HTTP allows in a field value (VCHAR, obs-text, space, tab)
field_bytes = st.text(
    st.sampled_from([chr(c) for c in [9, *range(0x20, 0x7F), *range(0x80, 0x100)]]), max_size=40
).map(lambda s: s.encode("latin-1"))
KNOWN_BAD_AUTH = [b"", b"Bearer", b"Bearer ", b"Bearer sk-unknown", b"Basic c2stdGVzdA==",
                  f"Token {KEYS['A']}".encode(), KEYS["A"].encode()]  # fmt: skip
authorizations = st.one_of(
    st.sampled_from([f"Bearer {key}".encode() for key in KEYS.values()]),
    st.sampled_from(KNOWN_BAD_AUTH),
    st.builds(
        lambda scheme, gap, key, tail: scheme + gap + key + tail,
        st.sampled_from([b"Bearer", b"bearer", b"BEARER", b"Basic", b""]),
        st.sampled_from([b" ", b"  ", b"\t", b""]),
        st.sampled_from([k.encode() for k in KEYS.values()] + [b"sk-test-org-\xe9", b"\xff"]),
        st.sampled_from([b"", b" ", b"\t", b" x", b"\xa0", b"\x80"]),
    ),
    field_bytes,
)
CLASSES = ["batch", "interactive", "system"]
KNOWN_BAD_CLASSES = ["unknown", "Batch", "batch,interactive", "BATCH"]
classes = st.sampled_from([c.encode() for c in CLASSES + KNOWN_BAD_CLASSES]) | field_bytes
GOOD_TIMEOUT = re.compile(rb"[1-9][0-9]{0,4}(\.[0-9]{1,3})?")
KNOWN_BAD_TIMEOUTS = [
    b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"-1", b"0", b"0.0", b"-0", b"1e309",
    b"-1e309", b"abc", b"", b"5s", b"1" + b"0" * 400 + b"x",
]  # fmt: skip
timeouts = st.one_of(
    st.sampled_from(KNOWN_BAD_TIMEOUTS),
    st.sampled_from([b"30", b"0.5", b"1e-300", b"1e-9", b"0.001", b"1e308", b"1" + b"0" * 400,
                     b" 5 ", b"1_000", b"0x10", b"+5", b"5.", b".5", b"\xd9\xa5"]),
    st.floats().map(lambda f: repr(f).encode()),
    st.integers(-(10**20), 10**20).map(lambda i: str(i).encode()),
    field_bytes,
)  # fmt: skip


TRACE = b"4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = b"-00f067aa0ba902b7-"
traceparents = st.one_of(
    st.sampled_from([
        b"00-" + TRACE + PARENT + b"01", b"01-" + TRACE + PARENT + b"00-x",
        b"ff-" + TRACE + PARENT + b"01", b"00-" + b"0" * 32 + PARENT + b"01",
        b"00-" + TRACE.upper() + PARENT + b"01",
    ]),
    field_bytes,
)  # fmt: skip


def _maybe(draw: st.DrawFn, values: st.SearchStrategy[bytes]) -> list[bytes]:
    """A header absent, sent, or (rarely) sent twice."""
    return [draw(values) for _ in range(draw(st.sampled_from([0, 1, 0, 1, 0, 1, 2])))]


@st.composite
def with_headers(draw: st.DrawFn) -> Case:
    """A well-formed body under fuzzed headers, sometimes queued behind the only slot."""
    path, body = draw(well_formed())
    headers: list[tuple[bytes, bytes]] = []
    for name, values in [
        (b"Authorization", authorizations),
        (b"X-Workload-Class", classes),
        (b"X-Request-Timeout", timeouts),
        (b"Idempotency-Key", field_bytes),
        (b"X-Request-Id", field_bytes | st.just(b"x" * 200)),
        (b"api-key", authorizations.map(lambda a: a.removeprefix(b"Bearer ")) | field_bytes),
        (b"x-api-key", authorizations.map(lambda a: a.removeprefix(b"Bearer ")) | field_bytes),
        (b"traceparent", traceparents),
        (b"tracestate", field_bytes),
    ]:
        headers += [(name, value) for value in _maybe(draw, values)]
    # once at most: aiohttp's HTTP parser refuses a second one before any handler runs
    headers += [
        (b"Content-Type", v)
        for v in draw(st.lists(st.sampled_from(CONTENT_TYPES) | field_bytes, max_size=1))
    ]
    headers = draw(st.permutations(headers))
    hold = draw(st.none() | st.sampled_from([0.0, 0.02, 0.1]))
    return Case(path, encode(body), tuple(headers), hold=hold)


def expected_statuses(case: Case) -> set[int] | None:
    """What the header rules allow for a well-formed body under ``case``'s headers, where
    they are unambiguous; None where they leave room (odd spacing, repeated headers...)."""
    auth, cls = case.sends("Authorization"), case.sends("X-Workload-Class")
    timeout = case.sends("X-Request-Timeout")
    if not auth and (case.sends("api-key") or case.sends("x-api-key")):
        return None  # the key is in another header: its own rules (tests/core/test_flows.py)
    if not auth or (len(auth) == 1 and auth[0] in KNOWN_BAD_AUTH):
        return {401}
    key = auth[0].removeprefix(b"Bearer ").decode("latin-1")
    if len(auth) > 1 or not auth[0].startswith(b"Bearer ") or key not in KEY_CLASSES:
        return None
    if len(cls) > 1 or len(timeout) > 1:
        return None
    refusals = set()
    if cls and cls[0].decode("latin-1") in CLASSES + KNOWN_BAD_CLASSES:
        if cls[0].decode("latin-1") not in KEY_CLASSES[key]:
            refusals.add(403)
    elif cls:
        return None
    if timeout and timeout[0] in KNOWN_BAD_TIMEOUTS:
        refusals.add(400)
    elif timeout and not GOOD_TIMEOUT.fullmatch(timeout[0]):
        return None
    if refusals:
        return refusals
    return {200, 504} if timeout else {200}


# --- the tests ---------------------------------------------------------------------------


@FUZZ
@given(case=st.one_of(near_valid(), near_valid(), near_valid(), random_bodies()))  # 3:1
async def test_fuzzed_bodies(rig: Rig, case: Case) -> None:
    await exchange(rig, case)


@FUZZ
@given(case=encoded())
async def test_fuzzed_encodings(rig: Rig, case: Case) -> None:
    await exchange(rig, case)


@FUZZ
@given(case=with_headers())
async def test_fuzzed_headers(rig: Rig, case: Case) -> None:
    answer, _ = await exchange(rig, case)
    expected = expected_statuses(case)
    assert expected is None or answer.status in expected, (
        f"{answer.status} where the header rules say {sorted(expected)}: {answer.body[:300]!r}"
    )


@FUZZ
@given(request=well_formed())
async def test_well_formed_requests_are_forwarded_as_sent(
    rig: Rig, request: tuple[str, dict[Any, Any]]
) -> None:
    """The other half of the contract: what it allows is served, and reaches the backend as
    the client wrote it (the proxy may only add ``include_usage`` to a stream's options, and
    the ``max_tokens`` it charged to a request that set none)."""
    path, body = request
    answer, forwarded = await exchange(rig, Case(path, encode(body)))
    assert answer.status == 200, f"a well-formed request got {answer.status}: {answer.body!r}"
    [(_, raw)] = forwarded
    assert json.loads(raw) == _as_forwarded(path, body), f"forwarded as {raw!r}"


def _as_forwarded(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as the backend may see it: a stream asks for its usage chunk, and a request
    that sets no token field is told the output it was charged for."""
    fields = ("max_tokens", "max_completion_tokens")
    if path != EMBEDDING and all(body.get(f) is None for f in fields):  # null ones left out
        body = {k: v for k, v in body.items() if k not in fields}
        body["max_tokens"] = DEFAULT_MAX_TOKENS
    options = body.get("stream_options")
    if body.get("stream") is True and not (
        isinstance(options, dict) and options.get("include_usage")
    ):
        return {**body, "stream_options": {**(options or {}), "include_usage": True}}
    return body


@FUZZ
@given(case=near_valid_surface())
async def test_fuzzed_responses_and_extra_path_bodies(rig: Rig, case: Case) -> None:
    await exchange(rig, case)


@FUZZ
@given(request=well_formed_surface())
async def test_well_formed_responses_and_extra_path_requests_are_forwarded_as_sent(
    rig: Rig, request: tuple[str, dict[Any, Any]]
) -> None:
    """A Responses API request reaches the backend as written, but for the
    ``max_output_tokens`` it was charged when it set none (never a stream option: its
    usage comes anyway); an extra path's as written, always."""
    path, body = request
    answer, forwarded = await exchange(rig, Case(path, encode(body)))
    assert answer.status == 200, f"a well-formed request got {answer.status}: {answer.body!r}"
    [(_, raw)] = forwarded
    if path == RERANK:
        assert raw == encode(body)
        return
    if body.get("max_output_tokens") is None:
        body = {k: v for k, v in body.items() if k != "max_output_tokens"}
        body["max_output_tokens"] = DEFAULT_MAX_TOKENS
    assert json.loads(raw) == body, f"forwarded as {raw!r}"


LEAVINGS = ("mid-body", "right after sending", "while queued")


@FUZZ
@given(request=well_formed(), leave=st.sampled_from(LEAVINGS))
async def test_clients_that_leave_leave_nothing_behind(
    rig: Rig, request: tuple[str, dict[Any, Any]], leave: str
) -> None:
    path, body = request
    case = Case(path, encode(body))
    rig.recorder.bodies.clear()
    data = request_bytes(case)
    async with holding(rig, leave == "while queued"):
        _, writer = await asyncio.open_connection("127.0.0.1", rig.port)
        writer.write(data[: len(data) - len(case.body) // 2 - 1] if leave == "mid-body" else data)
        await writer.drain()
        if leave == "while queued":
            assert await until(lambda: rig.queued == 1), "the request never queued"
        writer.close()
        if leave == "while queued":
            assert await until(lambda: rig.queued == 0), "a phantom queue entry: its client left"
    forwarded = rig.recorder.forwarded()
    for forwarded_path, raw in forwarded:
        assert_forwardable(forwarded_path, raw)
    assert leave != "while queued" or not forwarded, "sent on after its client left the queue"
    await assert_whole(rig)


# --- the checker itself -----------------------------------------------------------------

GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
MALFORMED = [
    (CHAT, json.dumps(GOOD_CHAT).encode("utf-16")),
    (CHAT, json.dumps(GOOD_CHAT).encode("utf-32-le")),
    (CHAT, b"\xef\xbb\xbf" + json.dumps(GOOD_CHAT).encode()),
    (CHAT, encode({**GOOD_CHAT, "user": Raw('"\\ud800"')})),
    (CHAT, encode({**GOOD_CHAT, Raw('"\\udfff"'): 1})),
    (CHAT, encode({**GOOD_CHAT, "user": "a"}).replace(b'"a"', b'"\xed\xa0\x80"')),
    (CHAT, encode({**GOOD_CHAT, "temperature": Raw("NaN")})),
    (CHAT, encode({**GOOD_CHAT, "logit_bias": {"1": Raw("-Infinity")}})),
    (CHAT, encode({**GOOD_CHAT, "max_tokens": Raw("1" + "0" * 300)})),
    (CHAT, encode({**GOOD_CHAT, "max_tokens": 0, "max_completion_tokens": 5})),
    (CHAT, encode({**GOOD_CHAT, "max_completion_tokens": MAX_TOKENS + 1})),
    (CHAT, encode({**GOOD_CHAT, "max_tokens": 5.0})),
    (CHAT, encode({**GOOD_CHAT, "max_tokens": True})),
    (CHAT, encode({**GOOD_CHAT, "n": 129})),
    (COMPLETION, encode({"model": MODEL, "prompt": "x", "best_of": 0})),
    (CHAT, encode({**GOOD_CHAT, "stream": "true"})),
    (CHAT, encode({**GOOD_CHAT, "model": ""})),
    (CHAT, encode({**GOOD_CHAT, "model": "other"})),
    (CHAT, encode({"model": MODEL})),
    (CHAT, encode({"model": MODEL, "messages": []})),
    (CHAT, encode({"model": MODEL, "messages": ["hi"]})),
    (CHAT, encode({"model": MODEL, "messages": [{"role": "user", "content": 5}]})),
    (CHAT, encode({"model": MODEL, "messages": [{"role": "user", "content": [5]}]})),
    (CHAT, encode({"model": MODEL, "messages": [{"content": [{"type": "text", "text": 5}]}]})),
    (COMPLETION, encode({"model": MODEL, "prompt": [1, "a"]})),
    (COMPLETION, encode({"model": MODEL, "prompt": [-1]})),
    (COMPLETION, encode({"model": MODEL, "prompt": [True]})),
    (EMBEDDING, encode({"model": MODEL, "input": [[1.5]]})),
    (EMBEDDING, encode({"model": MODEL, "input": None})),
    (CHAT, encode([GOOD_CHAT])),
    (CHAT, encode(GOOD_CHAT) + b"}"),
    (CHAT, b"[" * 100_000 + b"]" * 100_000),
    (RESPONSES, encode({"model": MODEL})),
    (RESPONSES, encode({"model": MODEL, "input": []})),
    (RESPONSES, encode({"model": MODEL, "input": ["x"]})),
    (RESPONSES, encode({"model": MODEL, "input": [{"role": "user", "content": 5}]})),
    (RESPONSES, encode({"model": MODEL, "input": "x", "instructions": 5})),
    (RESPONSES, encode({"model": MODEL, "input": "x", "max_output_tokens": 0})),
    (RERANK, encode({"model": "other", "query": "x"})),
    (RERANK, encode([{"model": MODEL}])),
]
FORWARDABLE = [
    (CHAT, encode(GOOD_CHAT)),
    (CHAT, encode({**GOOD_CHAT, "user": Raw('"\\ud83d\\ude00"')})),
    (CHAT, encode({**GOOD_CHAT, "stream": True})[:-1] + b"," + USAGE_ASKED.encode() + b"}"),
    (CHAT, encode({**GOOD_CHAT, "max_tokens": None, "max_completion_tokens": MAX_TOKENS})),
    (CHAT, encode({"model": MODEL, "messages": [{"role": "assistant"}]})),
    (CHAT, encode({"model": MODEL, "messages": [{"role": "user", "content": None}]})),
    (CHAT, encode({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "x"}]}]})),
    (COMPLETION, encode({"model": MODEL, "prompt": [[1, 2], [3]], "n": 128, "best_of": 1})),
    (EMBEDDING, encode({"model": MODEL, "input": ["a", "b"], "metadata": Raw("9" * 5000)})),
    (RESPONSES, encode({"model": MODEL, "input": "x", "max_tokens": -1})),  # not its field
    (RESPONSES, encode({"model": MODEL, "input": [{"type": "function_call", "arguments": 5}]})),
    (RERANK, encode({"model": MODEL, "query": 5, "max_tokens": -1})),  # priced, never checked
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw"), MALFORMED)
def test_the_checker_refuses_malformed_bodies(path: str, raw: bytes) -> None:
    """A checker that let everything through would make the fuzz tests pass for nothing."""
    assert forwarding_problem(path, raw) is not None


@pytest.mark.parametrize(("path", "raw"), FORWARDABLE)
def test_the_checker_lets_well_formed_bodies_through(path: str, raw: bytes) -> None:
    assert forwarding_problem(path, raw) is None
