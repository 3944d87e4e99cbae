"""Pricing of requests (core/cost.py): the estimate, its tokenizer, and its bounds."""

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
from sfq_proxy.core.inference_request import MAX_OUTPUT_TOKENS, InferenceRequest, Kind, parse
from sfq_proxy.core.scheduler import Ticket

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def chat(*messages: Any, **fields: Any) -> InferenceRequest:
    return parse(Kind.CHAT, body(messages=list(messages), **fields))


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


def test_the_actual_cost_is_the_same_formula_on_the_usage_reported() -> None:
    model = CostModel(CostSpec(input_weight=2.0, output_weight=5.0, output_ratio=0.5))
    assert model.actual(10, 4) == 2 * 10 + 5 * 4  # no output_ratio: these tokens happened
    assert model.actual(10, None) == 20.0  # an embedding: no completion
    assert model.actual(0, 0) == 1.0  # the floor a charge has too
    assert model.actual(None, 4) is None  # nothing to compare without a prompt count


def test_n_and_best_of_multiply_the_output_a_request_may_generate() -> None:
    """n=4 used to cost what n=1 costs, for four times the output."""
    model = CostModel(CostSpec(input_weight=1.0, output_weight=2.0, chars_per_token=4.0))
    one = model.estimate(chat({"content": "x" * 40}, max_tokens=100))
    four = model.estimate(chat({"content": "x" * 40}, max_tokens=100, n=4))
    best_of = model.estimate(chat({"content": "x" * 40}, max_tokens=100, n=2, best_of=6))
    assert (one.max_tokens, one.cost) == (100, 10 + 2 * 100)
    assert (four.max_tokens, four.cost) == (400, 10 + 2 * 400)
    assert best_of.max_tokens == 600  # best_of sequences are generated, n returned
    # with no max_tokens, each choice may take the pool's default
    assert model.estimate(chat({"content": "x"}, n=3)).max_tokens == 3 * 512
