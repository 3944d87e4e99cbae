"""Parsing of request bodies (core/inference_request.py): what is read, and every 400."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfq_proxy.config import MAX_OUTPUT_TOKENS
from sfq_proxy.core import inference_request
from sfq_proxy.core.cost import with_output_limit
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.inference_request import (
    _FAST,
    _MAYBE_LONE_SURROGATE,
    DEFAULT_CAPS,
    CapValues,
    InferenceRequest,
    Kind,
    _has_lone_surrogate,
    _strictly,
    parse,
    parse_extra,
)
from sfq_proxy.core.media import Media

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def chat(*messages: Any, **fields: Any) -> InferenceRequest:
    return parse(Kind.CHAT, body(messages=list(messages), **fields))


def rejected(kind: Kind, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(kind, raw)
    assert info.value.status == 400
    assert info.value.code == "invalid_request"
    return info.value


# -- parse: what is read ----------------------------------------------------------------------


def test_chat_with_string_contents_joins_their_text() -> None:
    raw = body(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
        ]
    )
    req = parse(Kind.CHAT, raw)
    assert req == InferenceRequest(
        kind=Kind.CHAT,
        model=MODEL,
        stream=False,
        text="Be brief.Hello",
        token_ids=0,
        max_tokens=None,
        raw=raw,
        messages=2,
    )


def test_chat_with_list_of_parts_reads_only_text_parts() -> None:
    parts = [
        {"type": "text", "text": "What is "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "this?"},
    ]
    req = chat({"role": "user", "content": parts})
    assert req.text == "What is this?"
    assert req.token_ids == 0


def test_chat_with_none_or_absent_content_counts_as_empty() -> None:
    req = chat(
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool"},
        {"role": "user", "content": "ok"},
    )
    assert req.text == "ok"


def test_stream_true_is_read() -> None:
    assert chat({"role": "user", "content": "x"}, stream=True).stream is True


def test_a_stream_asks_for_usage_keeping_the_clients_bytes() -> None:
    raw = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]} \n'
    req = parse(Kind.CHAT, raw)
    assert req.strip_usage is True
    assert req.raw.startswith(raw.rstrip()[:-1])  # the client's bytes, one member added
    assert json.loads(req.raw) == {**json.loads(raw), "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    ("options", "sent", "strip"),
    [
        ({"continuous_usage_stats": True}, {"continuous_usage_stats": True, "include_usage": True},
         True),
        ({"include_usage": False}, {"include_usage": True}, True),
        ({"include_usage": True}, {"include_usage": True}, False),
    ],
)  # fmt: skip
def test_a_streams_own_options_are_kept(options: dict, sent: dict, strip: bool) -> None:
    req = chat({"role": "user", "content": "x"}, stream=True, stream_options=options)
    assert (json.loads(req.raw)["stream_options"], req.strip_usage) == (sent, strip)


def test_without_stream_the_body_is_sent_as_it_came() -> None:
    raw = body(messages=[{"role": "user", "content": "x"}], stream_options={"x": 1})
    assert (parse(Kind.CHAT, raw).raw, parse(Kind.CHAT, raw).strip_usage) == (raw, False)


@pytest.mark.parametrize(
    ("prompt", "text", "token_ids"),
    [
        ("Once upon", "Once upon", 0),
        (["Once ", "upon"], "Once upon", 0),
        ([1, 2, 3, 0], "", 4),
        ([[1, 2], [3], []], "", 3),
    ],
    ids=["string", "strings", "token-ids", "lists-of-token-ids"],
)
def test_completion_prompt_forms(prompt: Any, text: str, token_ids: int) -> None:
    req = parse(Kind.COMPLETION, body(prompt=prompt, max_tokens=7))
    assert (req.kind, req.text, req.token_ids, req.max_tokens) == (
        Kind.COMPLETION,
        text,
        token_ids,
        7,
    )


def test_embeddings_input_and_no_max_tokens() -> None:
    req = parse(Kind.EMBEDDING, body(input=["ab", "cd"], max_tokens=99))
    assert (req.kind, req.text, req.token_ids, req.max_tokens) == (Kind.EMBEDDING, "abcd", 0, None)
    assert parse(Kind.EMBEDDING, body(input=[5, 6])).token_ids == 2


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"max_tokens": 10}, 10),
        ({"max_completion_tokens": 20}, 20),
        ({"max_tokens": 10, "max_completion_tokens": 20}, 20),
        ({"max_tokens": 10, "max_completion_tokens": None}, 10),
        ({"max_tokens": None}, None),
    ],
)
def test_max_tokens_and_max_completion_tokens(fields: dict[str, Any], expected: int | None) -> None:
    assert chat({"role": "user", "content": "x"}, **fields).max_tokens == expected


# -- parse: every 400 -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "JSON"),
        (b"", "JSON"),
        (b'{"model": "\xff\xfe"}', "JSON"),
        (b'[{"model": "m"}]', "JSON object"),
        (b'"m"', "JSON object"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "'model'"),
        (b'{"model": "", "messages": [{"role": "user", "content": "x"}]}', "'model'"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "'model'"),
        (b'{"model": "m", "stream": "yes", "messages": []}', "'stream'"),
        (b'{"model": "m", "stream": 1, "messages": [{"content": "x"}]}', "'stream'"),
        (b'{"model": "m"}', "'messages'"),
        (b'{"model": "m", "messages": []}', "'messages'"),
        (b'{"model": "m", "messages": {"role": "user"}}', "'messages'"),
        (b'{"model": "m", "messages": ["hi"]}', "'messages[0]'"),
        (
            b'{"model": "m", "messages": [{"content": "a"}, {"content": 3}]}',
            "'messages[1].content'",
        ),
        (b'{"model": "m", "messages": [{"content": {"text": "a"}}]}', "'messages[0].content'"),
    ],
)
def test_chat_bodies_that_are_400(raw: bytes, needle: str) -> None:
    assert needle in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (name, value)
        for name in ("max_tokens", "max_completion_tokens")
        for value in (0, -1, 1.5, 8.0, True, "16", [16])
    ],
)
def test_bad_max_tokens_is_400_naming_the_field(name: str, value: Any) -> None:
    raw = body(messages=[{"role": "user", "content": "x"}], **{name: value})
    assert f"'{name}'" in rejected(Kind.CHAT, raw).message


def test_bad_max_completion_tokens_is_400_even_with_a_good_max_tokens() -> None:
    raw = body(messages=[{"content": "x"}], max_tokens=5, max_completion_tokens=0)
    assert "'max_completion_tokens'" in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize(
    "prompt",
    [[], ["a", 1], [1, [2]], [[1], "a"], [-1], [True], [[1.5]], 3, None, {"text": "a"}],
    ids=repr,
)
def test_bad_prompt_is_400(prompt: Any) -> None:
    assert "'prompt'" in rejected(Kind.COMPLETION, body(prompt=prompt)).message


def test_missing_prompt_and_input_are_400() -> None:
    assert "'prompt' is required" in rejected(Kind.COMPLETION, body()).message
    assert "'input' is required" in rejected(Kind.EMBEDDING, body(prompt="x")).message
    assert "'input'" in rejected(Kind.EMBEDDING, body(input=[{"a": 1}])).message


@pytest.mark.parametrize("part", ["not a part", None, 5, [{"text": "a"}]], ids=repr)
def test_a_content_part_that_is_not_an_object_is_400(part: Any) -> None:
    """The API's parts are objects: a backend refuses anything else, so it never gets there."""
    raw = body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, part]}])
    assert "'messages[0].content'" in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize("text", [None, 5])
def test_non_string_text_part_is_400(text: Any) -> None:
    raw = body(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}])
    assert "'messages[0].content'" in rejected(Kind.CHAT, raw).message


def test_deeply_nested_json_is_400() -> None:
    assert "JSON" in rejected(Kind.CHAT, b"[" * 100_000).message


CHAT_TEXT = '{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]}'


@pytest.mark.parametrize(
    "raw",
    [
        CHAT_TEXT.encode("utf-16"),  # with its BOM
        CHAT_TEXT.encode("utf-16-le"),
        CHAT_TEXT.encode("utf-32"),
        CHAT_TEXT.encode("utf-8-sig"),  # a BOM is not JSON text
        CHAT_TEXT.replace('"x"', '"\xed\xa0\x80"').encode("latin-1"),  # an encoded surrogate
        CHAT_TEXT.replace('"x"', '"caf\xe9"').encode("latin-1"),
    ],
    ids=["utf-16", "utf-16-le", "utf-32", "utf-8-bom", "encoded-surrogate", "latin-1"],
)
def test_a_body_not_in_utf8_is_400(raw: bytes) -> None:
    """JSON bytes are UTF-8 (RFC 8259 §8.1); a guess at another encoding would forward bytes
    that a backend reads otherwise, and the usage edit of a stream would corrupt them."""
    assert "JSON" in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "a\\ud83d", "\\ude00\\ud83d"])
def test_a_lone_surrogate_escape_is_400(escape: str) -> None:
    raw = CHAT_TEXT.replace('"x"', f'"{escape}"').encode()
    assert "surrogate" in rejected(Kind.CHAT, raw).message


def test_an_escaped_surrogate_pair_is_text() -> None:
    raw = CHAT_TEXT.replace('"x"', '"\\ud83d\\ude00 ok"').encode()
    assert parse(Kind.CHAT, raw).text == "\U0001f600 ok"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_anywhere_are_400(constant: str) -> None:
    raw = CHAT_TEXT.replace('"stream"', f'"temperature": {constant}, "stream"').encode()
    assert "JSON" in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize(
    ("name", "literal", "limit"),
    [
        ("max_tokens", "1" + "0" * 305, "10000000"),  # the integer that broke a pool
        ("max_tokens", "10000001", "10000000"),
        ("max_completion_tokens", "99999999999", "10000000"),
        ("n", "129", "128"),
        ("best_of", "0", "128"),
        ("n", "-1", "128"),
    ],
)
def test_numbers_beyond_their_documented_limit_are_400_naming_field_and_limit(
    name: str, literal: str, limit: str
) -> None:
    raw = CHAT_TEXT.replace('"stream"', f'"{name}": {literal}, "stream"').encode()
    message = rejected(Kind.CHAT, raw).message
    assert f"'{name}'" in message
    assert limit in message


def test_integers_longer_than_python_reads_are_400() -> None:
    raw = CHAT_TEXT.replace('"stream"', f'"max_tokens": {"9" * 5000}, "stream"').encode()
    assert "JSON" in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize("bad", [0, -1])
def test_every_token_field_is_checked_not_only_the_charged_one(bad: int) -> None:
    """vLLM reads ``max_tokens`` when ``max_completion_tokens`` is absent *or* when it is
    its own alias: a bad one beside a good one must not pass because it is not charged."""
    raw = body(messages=[{"content": "x"}], max_completion_tokens=5, max_tokens=bad)
    assert "'max_tokens'" in rejected(Kind.CHAT, raw).message


def test_the_largest_allowed_values_parse() -> None:
    req = chat({"content": "x"}, max_tokens=10_000_000, n=128, best_of=128)
    assert req.max_tokens == 10_000_000


def test_a_lone_surrogate_nested_as_deep_as_json_allows_is_400_not_a_crash() -> None:
    nested = "[" * 900 + '"\\ud800"' + "]" * 900
    raw = CHAT_TEXT.replace('"stream"', f'"x": {nested}, "stream"').encode()
    assert "surrogate" in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize(
    ("fields", "choices"),
    [({}, 1), ({"n": 4}, 4), ({"best_of": 3}, 3), ({"n": 2, "best_of": 5}, 5), ({"n": None}, 1)],
)
def test_choices_are_the_larger_of_n_and_best_of(fields: dict[str, Any], choices: int) -> None:
    assert chat({"content": "x"}, **fields).choices == choices


# -- reading the body: msgspec first, the stdlib's strict reading behind it --------------------

# JSON-ish bytes: what a mutation splices into a valid body
_JSONISH = st.sampled_from(
    [b"{", b"}", b"[", b"]", b'"', b",", b":", b"0", b"7", b"-", b"+", b".", b"e", b"E", b"\\",
     b"u", b"d8", b"dc", b"00", b"ff", b"true", b"null", b"NaN", b"Infinity", b" ", b"\n",
     b"\x00", b"\x1f", b"\x7f", b"\xc3\xa9", b"\xed\xa0\x80", b"\xff", b"\xef\xbb\xbf",
     b"9" * 25, b"1e400", b"1e-400", b"9" * 4301]
)  # fmt: skip
_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2, max_value=2**65)
    | st.integers(min_value=-(2**65), max_value=-(2**63) + 2) | st.floats(allow_nan=False)
    | st.text(st.characters(codec=None, exclude_categories=())) | st.text(max_size=3)
)  # fmt: skip
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    """A JSON value as text, maybe with a splice of JSON-ish bytes anywhere in it."""
    value = draw(_VALUES)
    ensure_ascii = draw(st.booleans())
    try:  # infinity written as ``Infinity``, lone surrogates escaped or raw
        raw = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    except ValueError:
        raw = json.dumps(value).encode()
    if draw(st.booleans()):
        start = draw(st.integers(0, len(raw)))
        end = draw(st.integers(start, min(len(raw), start + 8)))
        raw = raw[:start] + b"".join(draw(st.lists(_JSONISH, max_size=3))) + raw[end:]
    return raw


@given(_bodies() | st.binary(max_size=64))
@settings(max_examples=3000, deadline=None)
def test_what_msgspec_reads_the_stdlib_reads_alike(raw: bytes) -> None:
    """msgspec reads a body first; only what it refuses goes to the stdlib's strict reading,
    which was the one reading before. So every body it takes must be one that reading takes,
    as the same values (an int stays an int, every digit kept): else a body's meaning, its
    price, or its 400 would depend on which parser ran."""
    try:
        fast = _FAST.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return  # the stdlib's reading decides, as it always did
    assert repr(_strictly(raw)) == repr(fast)


# -- tools: what the chat template renders into the prompt is priced ---------------------------


def test_tool_definitions_and_earlier_tool_calls_are_counted_as_input() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    req = parse(Kind.CHAT, body(messages=messages, tools=tools))
    compact = {"separators": (",", ":"), "ensure_ascii": False}
    assert (
        req.text
        == "Hi" + "" + "42" + json.dumps(tools, **compact) + json.dumps(calls, **compact) + "c1"
    )  # the tool message's tool_call_id
    assert req.messages == 3


def test_a_schema_of_any_size_is_not_free() -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 20_000}}]
    with_tools = parse(Kind.CHAT, body(messages=[{"content": "x"}], tools=tools))
    assert len(with_tools.text or "") > 20_000


def test_the_output_limit_is_appended_and_usage_is_still_asked_for() -> None:
    req = chat({"content": "x"}, stream=True)
    limited = with_output_limit(req, 64, "max_completion_tokens")
    sent = json.loads(limited.raw)
    assert sent["max_completion_tokens"] == 64
    assert sent["stream_options"] == {"include_usage": True}
    assert limited.max_tokens == 64
    assert limited.strip_usage


def test_image_audio_and_file_parts_are_kept_for_pricing_not_read_as_text() -> None:
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f1"}},
        {"type": "something_new", "payload": "x" * 100},
    ]
    req = chat({"role": "user", "content": parts})
    assert req.text == "Compare "
    assert req.media == (
        Media("image", 85), Media("image", None), Media("audio", None),
        Media("file", None), Media("file", None),
    )  # fmt: skip


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_token_field_sent_as_null_is_written_in_place_never_twice(field: str) -> None:
    """Appending a second ``max_tokens`` after a null one would leave it to each backend's
    parser which one wins (one that keeps the first would generate without a limit), and a
    server that reads both names as one field (TGI) refuses a body naming it twice."""
    req = parse(Kind.CHAT, b'{"model":"m","messages":[{"content":"x"}],"\\u006dax_tokens":null}')
    raw = with_output_limit(req, 64, field).raw
    names = [name for name, _ in json.loads(raw, object_pairs_hook=lambda pairs: pairs)]
    assert sorted(names) == sorted(["model", "messages", field])  # the null one left out
    assert json.loads(raw)[field] == 64


def test_a_body_that_cannot_be_written_back_is_a_400_not_invalid_json_upstream() -> None:
    req = parse(Kind.CHAT, b'{"model":"m","messages":[],"max_tokens":null,"temperature":1e400}'
                .replace(b"[]", b'[{"content":"x"}]'))  # fmt: skip
    with pytest.raises(ApiError) as info:
        with_output_limit(req, 64, "max_tokens")
    assert info.value.status == 400


def test_stream_options_sent_as_null_are_replaced_not_sent_twice() -> None:
    req = chat({"content": "x"}, stream=True, stream_options=None)
    names = [name for name, _ in json.loads(req.raw, object_pairs_hook=lambda pairs: pairs)]
    assert names.count("stream_options") == 1
    assert json.loads(req.raw)["stream_options"] == {"include_usage": True}
    assert req.strip_usage


def test_a_stream_to_a_server_that_reports_no_usage_goes_as_it_came() -> None:
    raw = body(messages=[{"role": "user", "content": "x"}], stream=True)
    model = json.loads(raw)["model"]
    req = parse(Kind.CHAT, raw, lambda asked: asked != model)
    assert (req.raw, req.strip_usage) == (raw, False)
    assert parse(Kind.CHAT, raw, lambda asked: asked == model).strip_usage


# -- the Responses API (docs/design.md §4) ----------------------------------------------------


def responses(**fields: Any) -> InferenceRequest:
    return parse(Kind.RESPONSES, body(**fields))


def test_a_responses_string_input_is_one_user_message_after_its_instructions() -> None:
    req = responses(input="Hello", instructions="Be brief.")
    assert (req.kind, req.text, req.messages, req.choices) == (
        Kind.RESPONSES,
        "Be brief.Hello",
        2,
        1,
    )
    assert req.route == "/v1/responses"
    assert responses(input="Hello").messages == 1
    assert responses(input="Hello", instructions="").messages == 1  # no system message
    assert responses(input="Hello", instructions=None).text == "Hello"


def test_responses_input_items_are_read_as_chat_messages_are() -> None:
    chat_like = responses(
        input=[
            {"role": "user", "content": "What is "},  # an easy input message
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "this"},
                    {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "?"}],
            },
        ]
    )
    assert chat_like.text == "What is this?"
    assert chat_like.messages == 3
    assert chat_like.media == (Media("image", 85),)  # low detail: a flat price


def test_other_responses_items_and_tools_count_as_their_json() -> None:
    """A function call and its output are rendered into the prompt: never free."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    req = responses(input=[{"role": "user", "content": "hi"}, call, output], tools=[tool])
    compact = [json.dumps(x, separators=(",", ":")) for x in (call, output, [tool])]
    assert req.text == "hi" + "".join(compact)
    assert req.messages == 3  # tools are no message


def test_responses_max_output_tokens_is_its_output_field() -> None:
    assert responses(input="x", max_output_tokens=7).max_tokens == 7
    assert responses(input="x", max_output_tokens=7).names_output
    plain = responses(input="x", max_tokens=7)  # not a Responses API field: not read
    assert (plain.max_tokens, plain.names_output) == (None, False)
    assert responses(input="x", n=3).choices == 1  # it has no n


def test_a_responses_stream_is_sent_as_it_came() -> None:
    """Its usage always comes in ``response.completed``: no stream_options is added."""
    raw = body(input="x", stream=True)
    req = parse(Kind.RESPONSES, raw)
    assert (req.stream, req.raw, req.strip_usage) == (True, raw, False)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({}, "'input' is required"),
        ({"input": []}, "'input' must be"),
        ({"input": 3}, "'input' must be"),
        ({"input": ["x"]}, "'input[0]' must be an object"),
        ({"input": [{"role": "user", "content": 3}]}, "'input[0].content'"),
        ({"input": "x", "instructions": ["x"]}, "'instructions'"),
        ({"input": "x", "max_output_tokens": 0}, "'max_output_tokens'"),
        ({"input": "x", "max_output_tokens": MAX_OUTPUT_TOKENS + 1}, "'max_output_tokens'"),
    ],
)
def test_a_responses_body_that_cannot_be_priced_is_400(fields: dict[str, Any], says: str) -> None:
    assert says in rejected(Kind.RESPONSES, body(**fields)).message


def test_a_responses_output_limit_goes_into_max_output_tokens() -> None:
    bare = responses(input="x")
    assert json.loads(with_output_limit(bare, 9, "max_output_tokens").raw)["max_output_tokens"] == 9
    asked = responses(input="x", max_output_tokens=50, max_tokens=50)
    sent = json.loads(with_output_limit(asked, 9, "max_output_tokens").raw)
    assert (sent["max_output_tokens"], sent["max_tokens"]) == (9, 50)  # only its own field


# -- extra paths (docs/design.md §8) ----------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    fixed: int = 0
    input_fields: tuple[str, ...] = ()


def extra(raw: bytes, rule: Rule | None, path: str = "/v1/rerank") -> InferenceRequest:
    return parse_extra(raw, path, lambda model: rule if model == MODEL else None)


def test_an_extra_path_counts_its_fixed_tokens_and_the_text_of_its_fields() -> None:
    raw = body(query="abc", documents=["de", {"text": "fg", "n": 3}], top_n=2)
    req = extra(raw, Rule(fixed=50, input_fields=("query", "documents", "absent")))
    assert (req.kind, req.route, req.raw, req.model) == (Kind.EXTRA, "/v1/rerank", raw, MODEL)
    assert (req.text, req.messages, req.token_ids, req.fixed_tokens) == ("abcdefg", 3, 0, 50)
    assert (req.max_tokens, req.choices, req.stream, req.strip_usage) == (None, 1, False, False)


def test_an_extra_paths_token_ids_count_one_each() -> None:
    req = extra(body(prompt=[[1, 2, 3], [4]], text=7), Rule(input_fields=("prompt", "text")))
    assert (req.text, req.token_ids) == ("", 4)  # a lone number is no token id


def test_an_extra_path_for_a_model_whose_pool_does_not_serve_it_is_404() -> None:
    with pytest.raises(ApiError) as info:
        extra(body(prompt="x"), None, "/tokenize")
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    assert "/tokenize" in info.value.message


@pytest.mark.parametrize("raw", [b"[]", b"{bad", json.dumps({"prompt": "x"}).encode()])
def test_an_extra_path_needs_a_json_object_with_a_model(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        extra(raw, Rule(fixed=1))
    assert info.value.status == 400


def nested(depth: int) -> bytes:
    return b'{"model": "%s", "q": %s}' % (MODEL.encode(), b"[" * depth + b'"x"' + b"]" * depth)


def test_an_extra_paths_deeply_nested_field_is_walked_without_recursion() -> None:
    assert extra(nested(500), Rule(input_fields=("q",))).text == "x"


def test_an_extra_paths_field_nested_beyond_the_parser_is_400_not_a_crash() -> None:
    with pytest.raises(ApiError) as info:
        extra(nested(100_000), Rule(input_fields=("q",)))
    assert info.value.status == 400


# -- issue 38: what the estimate reads ---------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "fields", "choices"),
    [
        (["a", "b", "c"], {"n": 4}, 12),
        (["a", "b"], {"n": 2, "best_of": 3}, 6),
        ([[1, 2], [3]], {"n": 5}, 10),
        ([1, 2, 3], {"n": 5}, 5),  # one prompt of token ids
        ("abc", {"best_of": 2}, 2),
    ],
)
def test_a_completion_generates_its_choices_for_each_prompt(
    prompt: Any, fields: dict[str, Any], choices: int
) -> None:
    assert parse(Kind.COMPLETION, body(prompt=prompt, **fields)).choices == choices


def test_embeddings_generate_nothing_whatever_their_inputs() -> None:
    assert parse(Kind.EMBEDDING, body(input=["a", "b"], n=3)).choices == 1


def test_every_string_of_a_text_part_is_read_but_its_media() -> None:
    parts = [
        {"type": "refusal", "refusal": "No"},
        {"type": "thinking", "thinking": "Hm", "signature": "s"},
        {"type": "input_text", "text": "A", "id": "part-1", "uuid": "u"},
        {"type": "text", "text": "B", "image_url": {"url": "https://x/y.png"}},
        {"type": "image_url", "image_url": {"url": "https://x/z.png", "detail": "low"}},
    ]
    req = chat({"role": "user", "content": parts})
    assert req.text == "NoHmsAB"  # no type, id or media URL; the image priced, never read
    assert req.media == (Media("image", None), Media("image", 85))
    assert req.messages == 1


def test_every_field_of_a_message_a_template_renders_is_read() -> None:
    messages = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "refusal": "no"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "narrator", "content": ""},
        {"role": "user", "content": ""},
    ]
    req = chat(*messages)
    assert req.text == "Hi" + "42" + "ann" + "think" + "no" + "c1" + "narrator"  # contents first
    assert req.messages == 5


def test_token_ids_alone_make_no_message() -> None:
    assert parse(Kind.COMPLETION, body(prompt=[[1], [2]])).messages == 0
    assert parse(Kind.COMPLETION, body(prompt=["", ""])).messages == 2


@pytest.mark.parametrize("usage", ["false", "true", 0, 1, [], {}])
@pytest.mark.parametrize("kind", [Kind.CHAT, Kind.COMPLETION])
def test_an_include_usage_that_is_not_a_boolean_is_400(kind: Kind, usage: Any) -> None:
    """A server reads the string "false" as false (pydantic's lax mode) and sent no usage,
    while the proxy read a truthy string as asked for: the stream was billed no tokens."""
    field = {"messages": [{"content": "x"}]} if kind is Kind.CHAT else {"prompt": "x"}
    raw = body(stream=True, stream_options={"include_usage": usage}, **field)
    assert "'stream_options.include_usage' must be a boolean" in rejected(kind, raw).message


@pytest.mark.parametrize("options", ["yes", [], 1, True])
def test_stream_options_that_are_not_an_object_are_400(options: Any) -> None:
    raw = body(messages=[{"content": "x"}], stream=True, stream_options=options)
    assert "'stream_options' must be an object" in rejected(Kind.CHAT, raw).message


@pytest.mark.parametrize("options", [{"include_usage": None}, {"include_usage": False}, None])
def test_usage_is_asked_for_whatever_the_client_said(options: dict[str, Any] | None) -> None:
    req = chat({"content": "x"}, stream=True, stream_options=options)
    assert json.loads(req.raw)["stream_options"]["include_usage"] is True
    assert req.strip_usage


# -- caps on a body's structure: checked before any message is read ------------------------

SMALL_CAPS = CapValues(max_messages=3, max_content_parts=4, max_tools=2)
PART = {"type": "text", "text": "x"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def capped(kind: Kind, raw: bytes, caps: CapValues = SMALL_CAPS) -> str:
    """The message of ``raw``'s 400 under ``caps``."""
    with pytest.raises(ApiError) as info:
        parse(kind, raw, caps=caps)
    assert (info.value.status, info.value.code) == (400, "invalid_request")
    return info.value.message


def test_the_default_caps() -> None:
    caps = DEFAULT_CAPS
    assert (caps.max_messages, caps.max_content_parts, caps.max_tools) == (2000, 10_000, 512)


def test_more_messages_than_the_cap_is_a_400_naming_the_limit() -> None:
    at_cap = body(messages=[{"role": "user", "content": "x"}] * 3)
    assert parse(Kind.CHAT, at_cap, caps=SMALL_CAPS).messages == 3
    over = body(messages=[{"role": "user", "content": "x"}] * 4)
    message = capped(Kind.CHAT, over)
    assert message == "'messages' has 4 items; at most 3 are accepted (limits.max_messages)."


def test_more_responses_input_items_than_the_message_cap_is_a_400() -> None:
    over = body(input=[{"role": "user", "content": "x"}] * 4)
    assert "'input' has 4 items; at most 3" in capped(Kind.RESPONSES, over)
    assert parse(Kind.RESPONSES, body(input="x" * 100), caps=SMALL_CAPS).text == "x" * 100


@pytest.mark.parametrize("kind", [Kind.CHAT, Kind.RESPONSES])
def test_content_parts_are_capped_over_all_the_messages(kind: Kind) -> None:
    """Two messages of two parts each are at the cap of 4; a third part anywhere is over."""
    field = "messages" if kind is Kind.CHAT else "input"
    at_cap = [{"role": "user", "content": [PART, PART]}] * 2
    assert parse(kind, body(**{field: at_cap}), caps=SMALL_CAPS).text == "xxxx"
    over = [*at_cap, {"role": "user", "content": [PART]}]
    message = capped(kind, body(**{field: over}))
    assert message == (
        f"'{field}' has 5 content parts; at most 4 are accepted (limits.max_content_parts)."
    )


@pytest.mark.parametrize(
    ("fields", "count"),
    [({"tools": [TOOL] * 3}, 3), ({"functions": [TOOL["function"]] * 3}, 3),
     ({"tools": [TOOL] * 2, "functions": [TOOL["function"]]}, 3)],
)  # fmt: skip
def test_tool_definitions_are_capped_tools_and_functions_together(
    fields: dict[str, Any], count: int
) -> None:
    raw = body(messages=[{"role": "user", "content": "x"}], **fields)
    message = capped(Kind.CHAT, raw)
    assert message == (
        f"The request has {count} tool definitions; at most 2 are accepted (limits.max_tools)."
    )
    assert "limits.max_tools" in capped(Kind.RESPONSES, body(input="x", **fields))


def test_tools_at_the_cap_parse() -> None:
    raw = body(messages=[{"role": "user", "content": "x"}], tools=[TOOL] * 2)
    assert parse(Kind.CHAT, raw, caps=SMALL_CAPS).text.startswith("x[")


def test_the_caps_come_before_any_message_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body over a cap is refused for it, however wrong its messages are, and without a
    walk of them (nor of its strings for a lone surrogate)."""

    def walked(*_args: Any) -> Any:
        raise AssertionError("a message was read")

    monkeypatch.setattr(inference_request, "_message_text", walked)
    monkeypatch.setattr(inference_request, "_content_text", walked)
    monkeypatch.setattr(inference_request, "_has_lone_surrogate", walked)
    bad = [{"content": 5}, "not an object", {"content": "\ud800"}, None]  # a lone surrogate
    assert "limits.max_messages" in capped(Kind.CHAT, body(messages=bad))
    parts = [{"content": [PART] * 3}, {"content": [7, 8]}]
    assert "limits.max_content_parts" in capped(Kind.CHAT, body(messages=parts))
    tools = body(messages=bad, tools=[TOOL] * 3).replace(b'"model"', b'"seed": 1e400, "model"')
    assert "limits.max_tools" in capped(Kind.CHAT, tools, replace(SMALL_CAPS, max_messages=9))


def test_what_is_not_a_list_is_not_counted_and_gets_its_own_400() -> None:
    assert "'messages' must be a non-empty array" in capped(Kind.CHAT, body(messages={"a": 1}))
    raw = body(messages=[{"content": "x"}], tools={"a": [1, 2, 3]})
    assert parse(Kind.CHAT, raw, caps=SMALL_CAPS).messages == 1


# -- lone surrogates: found without a walk of every string, unless the bytes may hold one ---


def test_a_body_msgspec_reads_is_never_walked_for_a_lone_surrogate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """msgspec refuses a lone surrogate itself: 300 messages with escaped pairs in them
    are read without a walk of their strings."""

    def walked(_body: Any) -> bool:
        raise AssertionError("walked")

    monkeypatch.setattr(inference_request, "_has_lone_surrogate", walked)
    messages = [{"role": "user", "content": "\ud83d\ude00 hi"}] * 300
    raw = json.dumps({"model": MODEL, "messages": messages}).encode()
    assert b"\\ud83d\\ude00" in raw
    assert parse(Kind.CHAT, raw).text == "\U0001f600 hi" * 300


def test_pairs_read_by_the_stdlib_are_not_walked_either(monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge integer sends the body to the stdlib's reading; its escaped pairs alone do not
    make the proxy walk its strings."""

    def walked(_body: Any) -> bool:
        raise AssertionError("walked")

    monkeypatch.setattr(inference_request, "_has_lone_surrogate", walked)
    pair = CHAT_TEXT.replace('"x"', '"\\ud83d\\ude00"')
    raw = pair.replace('"stream"', '"seed": 1e400, "stream"')
    assert parse(Kind.CHAT, raw.encode()).text == "\U0001f600"


@pytest.mark.parametrize(
    "text",
    ["\\\\ud83d\\ude00", "\\\\\\\\ud83d\\ude00", "\\ude00\\ud83d", "\\ud83d\\\\ude00",
     "\\ud800\\ud800\\udc00", "a\\udfff", "\\ud83d"],
)  # fmt: skip
def test_a_lone_surrogate_among_escapes_is_found_whichever_reading(text: str) -> None:
    """Pairs the escaped backslash splits (``\\\\ud83d`` is text, then a lone low half),
    halves in the wrong order, a high half twice: each is a lone surrogate for the stdlib
    reading, which the raw search sends to the walk, and for msgspec's."""
    raw = CHAT_TEXT.replace('"x"', f'"{text}"').encode()
    assert "surrogate" in rejected(Kind.CHAT, raw).message
    huge = CHAT_TEXT.replace('"x"', f'"{text}"').replace('"stream"', '"seed": 1e400, "stream"')
    assert "surrogate" in rejected(Kind.CHAT, huge.encode()).message


# the pieces of a JSON string's text: escapes (of backslashes, of surrogates' halves and
# others) and plain characters that can make one look like another
_STRING_PIECES = st.sampled_from(
    ["\\\\", "\\ud83d", "\\uD83D", "\\ude00", "\\uDE00", "\\ud800", "\\udbff", "\\udc00",
     "\\udfff", "\\u0041", "\\n", '\\"', "ud83d", "uDBFF", "ude00", "\\\\ud83d", "\\\\uDE00", "a",
     "\u00e9", "\U0001f600"]
)  # fmt: skip


@given(st.lists(_STRING_PIECES, max_size=12), st.lists(_STRING_PIECES, max_size=4))
@settings(max_examples=3000, deadline=None)
def test_the_raw_search_never_misses_a_lone_surrogate(value: list[str], key: list[str]) -> None:
    """Wherever a lone surrogate is in a body the stdlib reads (a key, a value, after any
    run of backslashes), the search of its bytes finds where it may be: skipping the walk
    when it finds nothing never lets one through. And msgspec refuses every such body."""
    raw = ('{"' + "".join(key) + '": "' + "".join(value) + '"}').encode()
    body = _strictly(raw)
    if _has_lone_surrogate(body):
        assert _MAYBE_LONE_SURROGATE.search(raw)
        with pytest.raises(msgspec.DecodeError):
            _FAST.decode(raw)
    else:
        assert repr(_FAST.decode(raw)) == repr(body)


@given(_bodies())
@settings(max_examples=2000, deadline=None)
def test_what_msgspec_reads_holds_no_lone_surrogate(raw: bytes) -> None:
    """The fast path's premise: a body msgspec takes needs no search for one."""
    try:
        value = _FAST.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return
    assert not _has_lone_surrogate(value)


def _continuous(_model: str) -> bool:
    return True


@pytest.mark.parametrize(
    ("options", "strip"),
    [
        (None, True),
        ({"include_usage": False}, True),
        ({"include_usage": True}, False),
        ({"include_usage": True, "continuous_usage_stats": False}, False),
        ({"continuous_usage_stats": True}, True),
    ],
)
def test_a_pool_with_continuous_usage_asks_for_usage_on_every_chunk(
    options: dict | None, strip: bool
) -> None:
    fields = {} if options is None else {"stream_options": options}
    raw = body(stream=True, messages=[{"role": "user", "content": "x"}], **fields)
    req = parse(Kind.CHAT, raw, continuous_usage=_continuous)
    sent = json.loads(req.raw)
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert {**sent, "stream_options": options} == {**json.loads(raw), "stream_options": options}
    assert req.strip_usage is strip


def test_continuous_usage_appends_to_the_clients_bytes_and_leaves_whole_answers_be() -> None:
    raw = b'{"model": "m", "stream": true, "prompt": "x"} \n'
    req = parse(Kind.COMPLETION, raw, continuous_usage=_continuous)
    assert req.raw.startswith(raw.rstrip()[:-1])  # one member added
    options = {"include_usage": True, "continuous_usage_stats": True}
    assert json.loads(req.raw) == {**json.loads(raw), "stream_options": options}
    already = body(stream=True, prompt="x", stream_options=options)
    assert parse(Kind.COMPLETION, already, continuous_usage=_continuous).raw is already
    whole = body(prompt="x")
    assert parse(Kind.COMPLETION, whole, continuous_usage=_continuous).raw is whole


@given(
    caps=st.builds(CapValues, st.integers(1, 40), st.integers(1, 40), st.integers(1, 40)),
    extra=st.integers(1, 3),
    which=st.sampled_from(["messages", "parts", "tools"]),
)
def test_the_most_compact_body_beyond_a_cap_is_still_refused(
    caps: CapValues, extra: int, which: str
) -> None:
    """A small body is not counted at all (it cannot hold more items than a cap: each takes
    two bytes at least); the most compact one beyond a cap is long enough to be counted."""
    message = {"role": "user", "content": "x"}
    if which == "messages":
        fields: dict[str, Any] = {"messages": [message] * (caps.max_messages + extra)}
    elif which == "parts":
        fields = {"messages": [{"role": "user", "content": [1] * (caps.max_content_parts + extra)}]}
    else:
        fields = {"messages": [message], "tools": [1] * (caps.max_tools + extra)}
    raw = json.dumps({"model": "m", **fields}, separators=(",", ":")).encode()
    with pytest.raises(ApiError, match=r"limits\.max_"):
        parse(Kind.CHAT, raw, caps=caps)
