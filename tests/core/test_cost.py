"""Pricing of requests (core/cost.py): the estimate, its tokenizer, and its bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from images import png_part
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from sfq_proxy.config import MAX_OUTPUT_TOKENS, ConfigError, CostSpec, ExtraCostSpec
from sfq_proxy.core.calibration import Calibration, InputModel
from sfq_proxy.core.cost import CostModel, Estimate
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.inference_request import (
    InferenceRequest,
    Kind,
    parse,
    parse_extra,
)
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
    [(0, 4.0, 1), (1, 4.0, 1), (4, 4.0, 1), (5, 4.0, 2), (8, 4.0, 2), (10, 2.5, 4), (11, 2.5, 5)],
)  # an empty prompt is a message: a token at least (its BOS)
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
    assert model.estimate(completion("x" * 8)) == Estimate(2, 300, 302.0, chars=8, messages=1)
    assert model.estimate(completion("x" * 8, max_tokens=10)) == Estimate(
        2, 10, 12.0, chars=8, messages=1
    )


def test_weights_and_output_ratio() -> None:
    spec = CostSpec(input_weight=0.5, output_weight=3.0, output_ratio=0.25, chars_per_token=2.0)
    estimate = CostModel(spec).estimate(completion("x" * 20, max_completion_tokens=100))
    # 0.5 * 10 + 3 * 100 * 0.25
    assert estimate == Estimate(input_tokens=10, max_tokens=100, cost=80.0, chars=20, messages=1)
    assert estimate.output_tokens == 25.0  # what a client that leaves pays at least


def test_zero_input_weight_prices_output_only() -> None:
    spec = CostSpec(input_weight=0.0, output_weight=2.0)
    assert CostModel(spec).estimate(completion("x" * 400, max_tokens=5)).cost == 10.0


def test_embeddings_cost_input_only() -> None:
    spec = CostSpec(input_weight=2.0, output_weight=5.0, default_max_tokens=512)
    req = parse(Kind.EMBEDDING, body(input="x" * 40))
    assert CostModel(spec).estimate(req) == Estimate(
        input_tokens=10, max_tokens=0, cost=20.0, chars=40, messages=1
    )


# -- template tokens per message, and what calibration learned --------------------------------


def test_tokens_per_message_adds_the_chat_templates_tokens() -> None:
    model = CostModel(CostSpec(tokens_per_message=3.5))
    req = chat({"content": "abcd"}, {"content": "efgh"}, {"content": "i"})
    assert model.input_tokens(req) == 13  # ceil(3.5 · 3 + 9 / 4)
    assert model.estimate(req, "acme") == Estimate(13, 512, 13 + 512, chars=9, messages=3)


def test_a_prompt_of_token_ids_has_no_template_tokens() -> None:
    model = CostModel(CostSpec(tokens_per_message=5.0))
    assert model.input_tokens(completion([1, 2, 3])) == 3
    assert model.estimate(completion([1, 2, 3], max_tokens=1)) == Estimate(3, 1, 4.0)


def test_input_model_is_the_configured_one_without_calibration() -> None:
    spec = CostSpec(tokens_per_message=2.0, chars_per_token=3.0)
    assert CostModel(spec).input_model() == InputModel(2.0, 3.0)
    calibration = Calibration(half_life_requests=10, min_pool_samples=5)
    learning = CostModel(spec, pool="p", calibration=calibration)
    assert learning.input_model() == InputModel(2.0, 3.0)  # nothing learned yet


def test_calibration_learns_template_and_text_tokens_through_the_cost_model() -> None:
    """Usage fed back by ``observe`` carries the messages the estimate counted: after a few
    chats of varied shapes, both parameters are the backend's and the estimates exact."""
    calibration = Calibration(half_life_requests=1000, min_pool_samples=3)
    model = CostModel(CostSpec(), pool="p", calibration=calibration)
    shapes = [(1, 40), (4, 8), (2, 400), (6, 100)]  # messages, chars per message
    for messages, chars in shapes:
        request = chat(*[{"content": "x" * chars}] * messages)
        estimate = model.estimate(request, "acme")
        assert (estimate.chars, estimate.messages) == (messages * chars, messages)
        model.observe(estimate, "acme", 7 * messages + messages * chars // 4, None)
    learned = model.input_model()
    assert learned.tokens_per_message == pytest.approx(7.0, rel=1e-6)
    assert learned.chars_per_token == pytest.approx(4.0, rel=1e-6)
    assert model.input_tokens(chat({"content": "x" * 3996})) == 7 + 999  # not 1 more


def test_tokenizer_counts_text_and_the_configured_template_tokens(tokenizer_path: Path) -> None:
    """A tokenizer sees the text, not the template: the configured tokens per message are
    added (calibration does not learn them: its input is counted, not estimated)."""
    spec = CostSpec(tokenizer=str(tokenizer_path), tokens_per_message=2.5)
    model = CostModel(spec, pool="p", calibration=Calibration(half_life_requests=10))
    req = chat({"content": "the quick brown "}, {"content": "fox jumps"})
    assert model.input_tokens(req) == 5 + 5  # 5 words, ceil(2.5 · 2)
    estimate = model.estimate(req, "acme")
    assert (estimate.chars, estimate.messages) == (0, 0)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [(Kind.EMBEDDING, {"input": [[]]}), (Kind.COMPLETION, {"prompt": [[]], "max_tokens": 1})],
)  # no token id, so no message: nothing of any input
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
    assert model.input_tokens(completion("")) == 1  # a message: a token at least


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


# -- CostModel.price: what one request may ask for, and what goes upstream ----------------------


def sent(request: InferenceRequest) -> dict[str, Any]:
    body = json.loads(request.raw)
    assert isinstance(body, dict)
    return body


def test_a_request_without_max_tokens_is_sent_the_output_it_is_charged_for() -> None:
    """Leaving max_tokens out used to be charged 512 while the backend generated up to the
    model's context: now the backend is told the 512 it was charged for."""
    model = CostModel(CostSpec(default_max_tokens=512))
    request, estimate = model.price(chat({"content": "x" * 40}), "a")
    assert sent(request)["max_tokens"] == 512 == request.max_tokens
    assert estimate.max_tokens == 512
    assert request.raw.startswith(chat({"content": "x" * 40}).raw.rstrip()[:-1])  # bytes kept


def test_the_injected_field_is_the_pools_choice_and_completions_always_use_max_tokens() -> None:
    model = CostModel(CostSpec(inject_max_tokens="max_completion_tokens"))
    request, _ = model.price(chat({"content": "hi"}, n=2), "a")
    assert sent(request)["max_completion_tokens"] == 512
    assert "max_tokens" not in sent(request)
    request, _ = model.price(completion("hi"), "a")
    assert sent(request)["max_tokens"] == 512


def test_injection_can_be_turned_off_and_the_charge_stays_the_default() -> None:
    model = CostModel(CostSpec(inject_max_tokens=False, default_max_tokens=300))
    original = chat({"content": "hi"})
    request, estimate = model.price(original, "a")
    assert request.raw == original.raw
    assert estimate.max_tokens == 300


def test_an_explicit_max_tokens_within_the_ceiling_goes_unchanged() -> None:
    model = CostModel(CostSpec(max_request_tokens=1000, chars_per_token=4.0))
    original = chat({"content": "x" * 400}, max_tokens=900)  # 100 in + 900 out = the ceiling
    request, estimate = model.price(original, "a")
    assert request.raw == original.raw
    assert estimate.max_tokens == 900


@pytest.mark.parametrize("fields", [{"max_tokens": 901}, {"max_tokens": 451, "n": 2}])
def test_an_explicit_request_over_the_ceiling_is_refused_by_default(fields: dict[str, int]) -> None:
    model = CostModel(CostSpec(max_request_tokens=1000, chars_per_token=4.0))
    with pytest.raises(ApiError) as info:
        model.price(chat({"content": "x" * 400}, **fields), "a")
    assert (info.value.status, info.value.code) == (400, "tokens_exceed_limit")
    assert "ceiling of 1000 tokens" in info.value.message


def test_clamping_lowers_every_token_field_the_client_set() -> None:
    model = CostModel(CostSpec(max_request_tokens=1000, chars_per_token=4.0, over_limit="clamp"))
    asked = chat({"content": "x" * 400}, max_tokens=5000, max_completion_tokens=5000, n=3)
    request, estimate = model.price(asked, "a")
    assert sent(request)["max_tokens"] == sent(request)["max_completion_tokens"] == 300
    assert estimate.max_tokens == 900
    assert estimate.input_tokens == 100


def test_a_class_ceiling_tighter_than_the_pools_applies() -> None:
    model = CostModel(CostSpec(max_request_tokens=100_000, chars_per_token=4.0))
    request, estimate = model.price(chat({"content": "x" * 400}), "a", ceiling=300)
    assert sent(request)["max_tokens"] == 200
    assert estimate.max_tokens == 200
    with pytest.raises(ApiError):
        model.price(chat({"content": "x" * 400}, max_tokens=201), "a", ceiling=300)


@pytest.mark.parametrize("kind", [Kind.CHAT, Kind.EMBEDDING])
def test_an_input_that_fills_the_ceiling_is_refused_even_when_clamping(kind: Kind) -> None:
    model = CostModel(CostSpec(max_request_tokens=100, chars_per_token=4.0, over_limit="clamp"))
    field = {Kind.CHAT: "messages", Kind.EMBEDDING: "input"}[kind]
    value = [{"content": "x" * 400}] if kind is Kind.CHAT else "x" * 404
    with pytest.raises(ApiError) as info:
        model.price(parse(kind, body(**{field: value})), "a")
    assert info.value.code == "tokens_exceed_limit"


def test_the_charge_of_the_largest_admissible_request_is_bounded_by_the_ceiling() -> None:
    """c_max = max(input_weight, output_weight) · max_request_tokens: the SFQ bound means
    something only when c_max is bounded."""
    spec = CostSpec(input_weight=2, output_weight=3, max_request_tokens=1000, over_limit="clamp")
    model = CostModel(spec)
    for chars in (0, 400, 3996):
        _, estimate = model.price(chat({"content": "x" * chars}, max_tokens=10**6), "a")
        assert estimate.cost <= 3 * 1000


def test_media_parts_are_priced_by_their_own_rule_or_the_pools_price_per_kind() -> None:
    """A 200 KB image used to cost what its caption cost."""
    spec = CostSpec(chars_per_token=4.0, media_tokens={"image": 500, "audio": 70, "file": 9})
    model = CostModel(spec)
    parts = [
        {"type": "text", "text": "x" * 40},
        png_part(1024, 1024),  # 765 by OpenAI's rule
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},  # 500
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},  # 70
        {"type": "unheard_of"},  # a file: 9
    ]
    estimate = model.estimate(chat({"content": parts}, max_tokens=1))
    assert estimate.input_tokens == 10 + 765 + 500 + 70 + 9
    assert estimate.chars == 0  # not all text: nothing for calibration's chars/token


# -- the Responses API and extra paths --------------------------------------------------------


def responses(**fields: Any) -> InferenceRequest:
    return parse(Kind.RESPONSES, body(**fields))


def test_a_responses_request_is_priced_as_the_chat_it_renders() -> None:
    """instructions + input are the system and user messages a chat template renders."""
    model = CostModel(CostSpec(tokens_per_message=4, default_max_tokens=100))
    as_chat = chat({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    as_responses = responses(instructions="Be brief.", input=[{"role": "user", "content": "Hi"}])
    assert model.estimate(as_responses) == model.estimate(as_chat)
    assert model.estimate(responses(input="Hi", max_output_tokens=7)).max_tokens == 7


def test_a_responses_request_without_max_output_tokens_is_sent_the_default() -> None:
    model = CostModel(CostSpec(default_max_tokens=300, inject_max_tokens="max_completion_tokens"))
    request, estimate = model.price(responses(input="x" * 40), "a")
    assert estimate.max_tokens == 300
    sent = json.loads(request.raw)
    assert sent["max_output_tokens"] == 300  # its own field, whatever the pool injects
    assert "max_completion_tokens" not in sent
    assert "max_tokens" not in sent


def test_a_responses_request_over_the_ceiling_is_refused_or_clamped() -> None:
    asked = responses(input="x" * 40, max_output_tokens=1000)  # 10 input tokens
    with pytest.raises(ApiError) as info:
        CostModel(CostSpec(max_request_tokens=100)).price(asked, "a")
    assert info.value.code == "tokens_exceed_limit"
    clamp = CostModel(CostSpec(max_request_tokens=100, over_limit="clamp"))
    request, estimate = clamp.price(asked, "a")
    assert (estimate.max_tokens, json.loads(request.raw)["max_output_tokens"]) == (90, 90)


def extra(raw: bytes, fixed: int = 0, *fields: str) -> InferenceRequest:
    rule = ExtraCostSpec(fixed=fixed, input_fields=list(fields))
    return parse_extra(raw, "/v1/rerank", lambda _: rule)


def test_an_extra_path_costs_its_fixed_tokens_and_fields_input_only() -> None:
    model = CostModel(CostSpec(input_weight=2, output_weight=3, default_max_tokens=100))
    request = extra(body(query="x" * 8, documents=["y" * 4]), 50, "query", "documents")
    sent, estimate = model.price(request, "a")
    assert sent.raw == request.raw  # nothing injected: it generates nothing we can bound
    assert estimate == Estimate(input_tokens=53, max_tokens=0, cost=106.0)  # no chars learnt
    assert model.estimate(extra(body(), 7)) == Estimate(7, 0, 14.0)


def test_an_extra_path_over_the_ceiling_is_refused() -> None:
    model = CostModel(CostSpec(max_request_tokens=100))
    with pytest.raises(ApiError) as info:
        model.price(extra(body(prompt="x" * 400), 1, "prompt"), "a")
    assert info.value.code == "tokens_exceed_limit"


# -- issue 38: what a tenant who has read the source cannot steer ------------------------------


def test_every_prompt_of_a_batch_generates_its_choices() -> None:
    """vLLM generates n (or best_of) sequences for each prompt of a list: 50 prompts with
    n=4 and max_tokens=100 were charged 425 (25 input tokens and 400 output) for the 20,050
    tokens a server reports (50 prompts of a token each, 200 sequences of 100)."""
    model = CostModel(CostSpec())
    estimate = model.estimate(completion(["xx"] * 50, n=4, max_tokens=100))
    assert (estimate.input_tokens, estimate.max_tokens, estimate.cost) == (50, 20_000, 20_050.0)
    ids = model.estimate(completion([[1, 2]] * 10, n=2, best_of=3, max_tokens=5))
    assert (ids.input_tokens, ids.max_tokens) == (20, 10 * 3 * 5)
    assert model.estimate(completion([1, 2, 3], n=2, max_tokens=5)).max_tokens == 10  # one prompt


def test_a_batch_is_bounded_by_the_ceiling_as_a_whole() -> None:
    """``max_request_tokens`` (and ``tpm``, which counts input_tokens + max_tokens) bounds
    every sequence of every prompt: 50 prompts × 4 × 100 does not fit in 10,000."""
    asked = completion(["xx"] * 50, n=4, max_tokens=100)
    with pytest.raises(ApiError) as info:
        CostModel(CostSpec(max_request_tokens=10_000)).price(asked, "a")
    assert info.value.code == "tokens_exceed_limit"
    clamp = CostModel(CostSpec(max_request_tokens=10_000, over_limit="clamp"))
    request, estimate = clamp.price(asked, "a")
    per_sequence = (10_000 - 50) // 200
    assert sent(request)["max_tokens"] == per_sequence == 49
    assert (estimate.input_tokens, estimate.max_tokens) == (50, 200 * per_sequence)
    _, default = clamp.price(completion(["xx"] * 50, n=4), "a")  # the default, cut to fit
    assert default.max_tokens == 200 * per_sequence


def test_calibration_learns_a_batchs_output_per_sequence() -> None:
    """usage counts every sequence of every prompt: so must the budget it is divided by."""
    calibration = Calibration(half_life_requests=10, min_org_samples=1)
    model = CostModel(CostSpec(), pool="p", calibration=calibration)
    estimate = model.estimate(completion(["xx"] * 50, n=4, max_tokens=100), "acme")
    model.observe(estimate, "acme", 50, 10_000)  # each of 200 sequences used half its budget
    assert model.output_ratio("acme") == pytest.approx(0.5)


HIDDEN = "x" * 16_000  # 4,000 tokens at the pool's default 4 characters a token


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": [{"type": "refusal", "refusal": HIDDEN}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": HIDDEN}]},
        {"role": "assistant", "content": [{"type": "tool_reference", "name": HIDDEN}]},
        {"role": "user", "content": [{"type": "text", "text": "hi", "reasoning": HIDDEN}]},
        {"role": "user", "content": [{"text": HIDDEN, "image_url": "https://x/y.png"}]},
        {"role": "assistant", "content": "", "reasoning_content": HIDDEN},
        {"role": "assistant", "content": None, "reasoning": HIDDEN},
        {"role": "assistant", "content": None, "refusal": HIDDEN},
        {"role": "user", "content": "hi", "name": HIDDEN},
        {"role": "tool", "content": "42", "tool_call_id": HIDDEN},
        {"role": "assistant", "function_call": {"name": "f", "arguments": HIDDEN}},
        {"role": HIDDEN, "content": "hi"},
    ],
    ids=[
        "refusal-part", "thinking-part", "tool-reference-part", "other-field-of-a-text-part",
        "text-beside-media", "reasoning_content", "reasoning", "refusal", "name",
        "tool_call_id", "function_call", "role",
    ],
)  # fmt: skip
def test_text_a_chat_template_renders_is_charged_wherever_it_is(message: dict[str, Any]) -> None:
    """A refusal or thinking part, or a message's reasoning, was read as no text at all: 16,000
    characters in one were charged 51 for the 4,057 tokens a server reports."""
    estimate = CostModel(CostSpec()).estimate(chat(message, max_tokens=1))
    assert estimate.input_tokens >= 4000


def test_every_message_pays_the_template_be_its_content_empty() -> None:
    """800 messages of empty content were charged their output only (50) for the 4,051
    tokens of their role markers a server reports: each message now costs the pool's tokens
    per message, and at least 1 token, learned or configured."""
    empty = [{"role": "user", "content": ""}] * 800
    assert CostModel(CostSpec()).input_tokens(chat(*empty)) == 800  # the floor of a token
    assert CostModel(CostSpec(tokens_per_message=5)).input_tokens(chat(*empty)) == 4000
    none = [{"role": "assistant", "content": None}, {"role": "tool"}]
    assert CostModel(CostSpec(tokens_per_message=5)).input_tokens(chat(*none)) == 10
    calibration = Calibration(half_life_requests=100, min_pool_samples=1)
    learned = CostModel(CostSpec(), pool="p", calibration=calibration)
    for chars in (400, 800, 1200):  # no template at all: a is learned as 0
        estimate = learned.estimate(completion("x" * chars), "acme")
        learned.observe(estimate, "acme", chars // 4, None)
    assert learned.input_model().tokens_per_message == pytest.approx(0.0, abs=1e-9)
    assert learned.input_tokens(chat(*empty)) == 800


def test_every_message_pays_at_least_a_token_with_a_tokenizer_too(tokenizer_path: Path) -> None:
    model = CostModel(CostSpec(tokenizer=str(tokenizer_path)))
    assert model.input_tokens(chat(*[{"role": "user", "content": ""}] * 800)) == 800


def test_idle_time_junk_cannot_collapse_an_orgs_output_ratio() -> None:
    """300 idle-time requests with max_tokens 120,000 that stop at once made the org's
    learned output ratio (and its pool's) ~0: its full-length requests were then charged ~36
    for ~1,020 tokens. A sample now weighs the output it generated, and an org's ratio is at
    least half its pool's: a full-length request is charged at least half what it costs."""
    calibration = Calibration(half_life_requests=5000, min_org_samples=50, min_pool_samples=50)
    model = CostModel(CostSpec(), pool="p", calibration=calibration)
    full = chat({"role": "user", "content": "x" * 100}, max_tokens=1024)
    for org in ("alice", "bob"):  # the pool's traffic: answers of about their budget
        for _ in range(100):
            model.observe(model.estimate(full, org), org, 30, 1020)
    junk = chat({"role": "user", "content": "x" * 100}, max_tokens=120_000)
    for _ in range(300):
        model.observe(model.estimate(junk, "mallory"), "mallory", 30, 1)
    charged, actual = model.estimate(full, "mallory").cost, model.actual(30, 1020)
    assert actual is not None
    assert actual / 2 <= charged <= actual
