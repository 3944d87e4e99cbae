"""Parsing of request bodies (core.inference_request) and their pricing (core.cost)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from sfq_proxy.config import ConfigError, CostSpec
from sfq_proxy.core.cost import CostModel, Estimate
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.inference_request import MAX_OUTPUT_TOKENS, InferenceRequest, Kind, parse
from sfq_proxy.core.scheduler import Ticket

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


# -- CostModel.estimate -----------------------------------------------------------------------


def completion(prompt: Any, **fields: Any) -> InferenceRequest:
    return parse(Kind.COMPLETION, body(prompt=prompt, **fields))


@pytest.mark.parametrize(
    ("chars", "chars_per_token", "tokens"),
    [(0, 4.0, 0), (1, 4.0, 1), (4, 4.0, 1), (5, 4.0, 2), (8, 4.0, 2), (10, 2.5, 4), (11, 2.5, 5)],
)
def test_input_tokens_from_text_length_rounds_up(
    chars: int, chars_per_token: float, tokens: int
) -> None:
    model = CostModel(CostSpec(chars_per_token=chars_per_token))
    assert model.input_tokens(completion("x" * chars)) == tokens


def test_token_ids_are_counted_exactly() -> None:
    model = CostModel(CostSpec(chars_per_token=4.0))
    assert model.input_tokens(completion([[1, 2, 3], [4, 5]])) == 5
    assert model.estimate(completion(list(range(13)), max_tokens=1)) == Estimate(13, 1, 14.0)


def test_chat_text_length_counts_every_message() -> None:
    model = CostModel(CostSpec())
    req = chat({"content": "abcd"}, {"content": "efgh"}, {"content": "i"})
    assert model.input_tokens(req) == 3  # ceil(9 / 4)


def test_default_max_tokens_applies_when_request_sets_none() -> None:
    model = CostModel(CostSpec(default_max_tokens=300))
    assert model.estimate(completion("x" * 8)) == Estimate(2, 300, 302.0, chars=8)
    assert model.estimate(completion("x" * 8, max_tokens=10)) == Estimate(2, 10, 12.0, chars=8)


def test_weights_and_output_ratio() -> None:
    spec = CostSpec(input_weight=0.5, output_weight=3.0, output_ratio=0.25, chars_per_token=2.0)
    estimate = CostModel(spec).estimate(completion("x" * 20, max_completion_tokens=100))
    # 0.5 * 10 + 3 * 100 * 0.25
    assert estimate == Estimate(input_tokens=10, max_tokens=100, cost=80.0, chars=20)


def test_zero_input_weight_prices_output_only() -> None:
    spec = CostSpec(input_weight=0.0, output_weight=2.0)
    assert CostModel(spec).estimate(completion("x" * 400, max_tokens=5)).cost == 10.0


def test_embeddings_cost_input_only() -> None:
    spec = CostSpec(input_weight=2.0, output_weight=5.0, default_max_tokens=512)
    req = parse(Kind.EMBEDDING, body(input="x" * 40))
    assert CostModel(spec).estimate(req) == Estimate(
        input_tokens=10, max_tokens=0, cost=20.0, chars=40
    )


@pytest.mark.parametrize(
    ("kind", "fields"),
    [(Kind.EMBEDDING, {"input": ""}), (Kind.COMPLETION, {"prompt": "", "max_tokens": 1})],
)
def test_cost_floor_is_one(kind: Kind, fields: dict[str, Any]) -> None:
    spec = CostSpec(input_weight=1.0, output_weight=0.5, output_ratio=0.5)
    estimate = CostModel(spec).estimate(parse(kind, body(**fields)))
    assert estimate.input_tokens == 0
    assert estimate.cost == 1.0


# -- tokenizer --------------------------------------------------------------------------------

WORDS = ["[UNK]", "the", "quick", "brown", "fox", "jumps"]


@pytest.fixture
def tokenizer_path(tmp_path: Path) -> Path:
    """A tiny word-level Hugging Face tokenizer.json, built here: nothing is downloaded."""
    vocab = {word: i for i, word in enumerate(WORDS)}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_tokenizer_counts_input_tokens(tokenizer_path: Path) -> None:
    model = CostModel(CostSpec(tokenizer=str(tokenizer_path), output_weight=2.0))
    text = "the quick brown fox jumps"  # 25 characters: 7 tokens at 4 chars/token
    assert model.input_tokens(completion(text)) == 5
    assert CostModel(CostSpec()).input_tokens(completion(text)) == 7
    assert model.estimate(completion(text, max_tokens=10)) == Estimate(5, 10, 25.0)


def test_tokenizer_counts_unknown_words_and_adds_token_ids(tokenizer_path: Path) -> None:
    model = CostModel(CostSpec(tokenizer=str(tokenizer_path)))
    assert model.input_tokens(chat({"content": "the zebra"}, {"content": " jumps, high"})) == 5
    assert model.input_tokens(completion([1, 2, 3])) == 3
    assert model.input_tokens(completion("")) == 0


def test_missing_tokenizer_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="No such file"):
        CostModel(CostSpec(tokenizer=str(tmp_path / "absent.json")))


def test_missing_tokenizer_error_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(
        ConfigError, match=r"^pools\.p\.cost\.tokenizer: cannot load '.*absent\.json'"
    ):
        CostModel(CostSpec(tokenizer=str(path)), "pools.p.cost")


def test_the_largest_request_under_the_most_extreme_config_is_a_valid_ticket() -> None:
    """The config's and the parser's bounds together keep every charge within what the fair
    queue takes: the biggest body at the top cost weights, fewest chars per token and the
    lowest flow weight still makes a ticket (a ValueError here would be a 500 per request)."""
    spec = CostSpec(input_weight=1000, output_weight=1000, chars_per_token=0.1)
    text = "x" * (1 << 30)  # limits.max_body_bytes at its maximum
    request = InferenceRequest(Kind.CHAT, "m", False, text, 0, MAX_OUTPUT_TOKENS, b"")
    estimate = CostModel(spec).estimate(request)
    tokens = estimate.input_tokens + estimate.max_tokens
    Ticket(org="a", cls="batch", cost=estimate.cost, weight=0.001 * 0.001, tokens=tokens)


def test_a_lone_surrogate_nested_as_deep_as_json_allows_is_400_not_a_crash() -> None:
    nested = "[" * 900 + '"\\ud800"' + "]" * 900
    raw = CHAT_TEXT.replace('"stream"', f'"x": {nested}, "stream"').encode()
    assert "surrogate" in rejected(Kind.CHAT, raw).message
