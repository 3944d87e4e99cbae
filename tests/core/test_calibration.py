"""Learning of the cost estimate's parameters from observed usage (sfq_proxy.core.calibration)."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from sfq_proxy.core.calibration import FORMAT_VERSION, Calibration, InputModel, Ratio
from sfq_proxy.state import atomic_file
from sfq_proxy.state.calibration_file import load, save
from sfq_proxy.state.redis_calibration import SharedCalibration

POOL = "llama-8b"
HUGE_HALF_LIFE = 10**12  # decay ≈ 1 - 7e-13: a plain ratio of sums for any realistic test
_INPUT_SUMS = ("m", "c", "t", "mm", "mc", "cc", "mt", "ct")  # the stored fit's decayed sums


def output(cal: Calibration, completion: int | None, max_tokens: int, org: str = "acme") -> None:
    cal.observe(
        POOL, org, chars=0, messages=1, prompt_tokens=None, max_tokens=max_tokens,
        completion_tokens=completion,
    )  # fmt: skip


def prompt(cal: Calibration, chars: int, prompt_tokens: int | None, messages: int = 1) -> None:
    cal.observe(
        POOL, "acme", chars=chars, messages=messages, prompt_tokens=prompt_tokens, max_tokens=0,
        completion_tokens=None,
    )  # fmt: skip


def observe(
    cal: Calibration,
    pool: str,
    org: str,
    chars: int,
    messages: int,
    prompt_tokens: int | None,
    max_tokens: int,
    completion: int | None,
) -> None:
    cal.observe(
        pool, org, chars=chars, messages=messages, prompt_tokens=prompt_tokens,
        max_tokens=max_tokens, completion_tokens=completion,
    )  # fmt: skip


def learned_cal() -> Calibration:
    cal = Calibration(half_life_requests=4, min_org_samples=2)
    observe(cal, "a", "x", 400, 1, 100, 100, 25)
    observe(cal, "a", "x", 310, 3, 99, 256, 7)
    observe(cal, "a", "y", 0, 1, 12, 64, 64)
    observe(cal, "b", "x", 123, 1, 31, 0, None)
    return cal


# -- Ratio -----------------------------------------------------------------------------------


def test_ratio_is_none_until_observed() -> None:
    assert Ratio().value() is None
    assert Ratio(num=0.0, den=0.0, samples=0) == Ratio()


def test_ratio_with_half_life_one_halves_the_weights_per_observation() -> None:
    ratio = Ratio()
    ratio.add(10, 100, 0.5)
    assert ratio == Ratio(num=10.0, den=100.0, samples=1)
    ratio.add(50, 100, 0.5)
    assert ratio == Ratio(num=55.0, den=150.0, samples=2)  # 10·½ + 50, 100·½ + 100
    ratio.add(30, 60, 0.5)
    assert ratio == Ratio(num=57.5, den=135.0, samples=3)  # 55·½ + 30, 150·½ + 60
    assert ratio.value() == 57.5 / 135.0


def test_calibration_with_half_life_one_decays_by_exactly_one_half() -> None:
    """Each sample weighs its output: 10 · 0.1, 50 · 0.5 and 30 · 0.5 over 10, 50 and 30."""
    cal = Calibration(half_life_requests=1, min_org_samples=1)
    assert cal.decay == 0.5
    for completion, max_tokens in [(10, 100), (50, 100), (30, 60)]:
        output(cal, completion, max_tokens)
    pool = cal.snapshot()[POOL]
    assert pool["output_ratio"] == {"value": 27.75 / 57.5, "samples": 3}
    assert pool["orgs"]["acme"] == {"value": 27.75 / 57.5, "samples": 3}
    # (1·½ + 25)·½ + 15, (10·½ + 50)·½ + 30
    assert cal.to_json()["pools"][POOL]["output_ratio"] == {"num": 27.75, "den": 57.5, "samples": 3}


def test_huge_half_life_is_the_plain_ratio_of_sums() -> None:
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE)
    for completion, max_tokens in [(10, 100), (50, 100), (30, 60)]:
        output(cal, completion, max_tokens)
    # the ratios 0.1, 0.5, 0.5 weighed by the outputs 10, 50, 30
    assert cal.output_ratio(POOL, "acme", 1.0) == pytest.approx(41 / 90, rel=1e-9)


def test_half_life_is_counted_in_requests() -> None:
    """After ``h`` observations of a new ratio, old and new weigh the same."""
    half_life, old_count = 10, 1000
    cal = Calibration(half_life_requests=half_life)
    for _ in range(old_count):
        output(cal, 20, 100)  # ratio 0.2
    for _ in range(half_life):
        output(cal, 60, 100)  # ratio 0.6
    d = 0.5 ** (1 / half_life)
    new_weight = sum(d**age for age in range(half_life))
    old_weight = sum(d**age for age in range(half_life, half_life + old_count))
    # each sample also weighs its output: 20 tokens for the old, 60 for the new
    expected = (0.2 * 20 * old_weight + 0.6 * 60 * new_weight) / (20 * old_weight + 60 * new_weight)
    learned = cal.output_ratio(POOL, "someone-else", 1.0)
    assert learned == pytest.approx(expected, rel=1e-12)
    # halfway (d**1000 = 2**-100 is negligible), the new answers three times the weight
    assert learned == pytest.approx((0.2 * 20 + 0.6 * 60) / 80, abs=1e-9)


# -- input model -----------------------------------------------------------------------------

DEFAULT = InputModel(tokens_per_message=0.0, chars_per_token=4.0)
PRIORS = st.builds(InputModel, st.floats(0, 1000), st.floats(0.1, 100))  # CostSpec's bounds


def test_input_model_tokens_is_per_message_plus_per_char() -> None:
    assert InputModel(7.0, 4.0).tokens(3, 400) == 7 * 3 + 400 / 4
    assert InputModel(0.5, 2.5).tokens(0, 0) == 0.0


def test_input_model_is_the_default_until_learned() -> None:
    cal = Calibration(half_life_requests=100)
    assert cal.input_model(POOL, DEFAULT) is DEFAULT
    output(cal, 10, 100)  # an output-only observation teaches nothing about chars
    custom = InputModel(3.0, 3.25)
    assert cal.input_model(POOL, custom) is custom


def test_input_model_waits_for_min_pool_samples_then_is_per_pool() -> None:
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE, min_pool_samples=3)
    prompt(cal, 400, 100)
    prompt(cal, 800, 200)
    assert cal.input_model(POOL, DEFAULT) is DEFAULT
    prompt(cal, 1200, 300)
    model = cal.input_model(POOL, InputModel(5.0, 9.0))
    assert model.tokens_per_message == pytest.approx(0.0, abs=1e-9)  # fitted, not the prior
    assert model.chars_per_token == pytest.approx(4.0, rel=1e-9)
    assert cal.input_model("other-pool", DEFAULT) is DEFAULT


def on_the_data(messages: float, chars: float, tokens: float, prior: InputModel) -> InputModel:
    """Where the least change to ``prior`` meets Σt = a·Σm + b·Σc, written out from the
    Lagrange conditions on the raw sums (a trusted to ±8 tokens, b to ±25%), a clamped."""
    a0, b0 = prior.tokens_per_message, 1 / prior.chars_per_token
    var_a, var_b = 8.0**2, (0.25 * b0) ** 2
    gap = tokens - a0 * messages - b0 * chars
    a = a0 + gap * var_a * messages / (var_a * messages**2 + var_b * chars**2)
    a = min(max(a, 0.0), 64.0)
    return InputModel(a, chars / (tokens - a * messages))


def assert_model(model: InputModel, expected: InputModel) -> None:
    assert model.tokens_per_message == pytest.approx(expected.tokens_per_message, rel=1e-9)
    assert model.chars_per_token == pytest.approx(expected.chars_per_token, rel=1e-9)


@pytest.mark.parametrize(
    "prior", [InputModel(0.0, 4.0), InputModel(10.0, 4.0), InputModel(3.0, 9.0)]
)
def test_one_sample_moves_the_prior_onto_it(prior: InputModel) -> None:
    """One equation, two unknowns: the prior, moved the least onto the sample's line."""
    cal = Calibration(half_life_requests=100)
    prompt(cal, 400, 100)
    model = cal.input_model(POOL, prior)
    assert_model(model, on_the_data(1, 400, 100, prior))
    assert model.tokens(1, 400) == pytest.approx(100, rel=1e-12)  # the sample, exactly


def test_one_sample_that_agrees_with_the_prior_keeps_it() -> None:
    cal = Calibration(half_life_requests=100)
    prompt(cal, 400, 107, messages=1)
    assert_model(cal.input_model(POOL, InputModel(7.0, 4.0)), InputModel(7.0, 4.0))


def test_requests_all_alike_move_the_prior_onto_their_ratio_of_sums() -> None:
    """Chars ∝ messages in every request: the fit cannot tell template tokens from text, and
    the decayed sums Σm, Σc, Σt are all the data say."""
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE)
    for messages, tokens in [(1, 110), (2, 210), (3, 330)]:
        prompt(cal, 400 * messages, tokens, messages=messages)
    prior = InputModel(5.0, 9.0)
    assert_model(cal.input_model(POOL, prior), on_the_data(6, 2400, 650, prior))


@pytest.mark.parametrize(
    ("chars", "tokens", "prior", "near"),
    [
        # identical tiny chats, template 7 + 1 text token: not 2 tokens a character
        (4, 8, InputModel(0.0, 4.0), InputModel(7.0, 4.0)),
        # one long prompt again and again, text at 3 chars/token: not a 300-token template
        (4000, 4 + 1333, InputModel(0.0, 4.0), InputModel(0.0, 3.0)),
        # the operator's template count is right: chars/token is learned, a kept
        (4000, 7 + 1053, InputModel(7.0, 4.0), InputModel(7.0, 3.8)),
    ],
)
def test_identical_requests_share_the_gap_by_their_text_tokens_per_message(
    chars: int, tokens: int, prior: InputModel, near: InputModel
) -> None:
    """The gap between the data and the prior goes to the template while a message holds
    few text tokens, to chars/token when it holds many (the crossover is near 32)."""
    cal = Calibration(half_life_requests=5000)
    for _ in range(100):
        prompt(cal, chars, tokens)
    model = cal.input_model(POOL, prior)
    assert model.tokens_per_message == pytest.approx(near.tokens_per_message, abs=0.5)
    assert model.chars_per_token == pytest.approx(near.chars_per_token, rel=0.02)
    assert model.tokens(1, chars) == pytest.approx(tokens, rel=1e-9)
    if chars == 4:  # then a long message is priced about right, not at 1 token a character
        assert model.tokens(1, 3200) == pytest.approx(7 + 800, rel=0.02)


def test_a_prior_beyond_the_bound_is_clamped_too() -> None:
    cal = Calibration(half_life_requests=100)
    prompt(cal, 400, 100)
    model = cal.input_model(POOL, InputModel(100.0, 4.0))
    assert model.tokens_per_message == 64.0
    assert model.chars_per_token == pytest.approx(400 / (100 - 64), rel=1e-12)


def test_varied_chars_per_message_separate_template_and_text_tokens() -> None:
    cal = Calibration(half_life_requests=100)
    for messages, chars in [(1, 400), (3, 400), (2, 1000)]:
        prompt(cal, chars, 7 * messages + chars // 4, messages=messages)
    model = cal.input_model(POOL, InputModel(30.0, 9.0))  # the prior is not used
    assert model.tokens_per_message == pytest.approx(7.0, rel=1e-9)
    assert model.chars_per_token == pytest.approx(4.0, rel=1e-9)


@pytest.mark.parametrize(("per_message", "clamped"), [(100, 64.0), (-3, 0.0)])
def test_a_fitted_tokens_per_message_out_of_bounds_is_clamped_and_b_refit(
    per_message: int, clamped: float
) -> None:
    """A template adds 0 to 64 tokens a message; under the clamped a, b is least squares."""
    steps = [(1, 400), (2, 1000), (3, 400)]
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE)
    for messages, chars in steps:
        prompt(cal, chars, per_message * messages + chars // 4, messages=messages)
    mc = sum(m * c for m, c in steps)
    cc = sum(c * c for _, c in steps)
    ct = sum(c * (per_message * m + c // 4) for m, c in steps)
    model = cal.input_model(POOL, DEFAULT)
    assert model.tokens_per_message == clamped
    assert model.chars_per_token == pytest.approx(cc / (ct - clamped * mc), rel=1e-9)


@pytest.mark.parametrize(
    ("chars", "prompt_tokens", "prior", "expected"),
    [
        (10_000, 10, 0.0, 12.0),
        (5, 100, 0.0, 1.0),
        (600, 100, 0.0, 6.0),
        (400, 10, 50.0, 12.0),  # b < 0: tokens do not shrink as text grows, so the top
    ],
)
def test_chars_per_token_is_clamped_to_its_bounds(
    chars: int, prompt_tokens: int, prior: float, expected: float
) -> None:
    cal = Calibration(half_life_requests=100)
    prompt(cal, chars, prompt_tokens)
    assert cal.input_model(POOL, InputModel(prior, 4.0)).chars_per_token == expected


def test_custom_chars_per_token_bounds() -> None:
    cal = Calibration(half_life_requests=100, chars_per_token_bounds=(2.0, 3.0))
    prompt(cal, 1000, 100)
    assert cal.input_model(POOL, DEFAULT).chars_per_token == 3.0


@pytest.mark.parametrize(
    ("chars", "prompt_tokens", "messages"), [(0, 50, 1), (400, None, 1), (400, 0, 1), (400, 9, -1)]
)
def test_text_less_or_uncounted_prompts_are_ignored(
    chars: int, prompt_tokens: int | None, messages: int
) -> None:
    cal = Calibration(half_life_requests=100)
    prompt(cal, chars, prompt_tokens, messages=messages)
    assert cal.input_model(POOL, DEFAULT) is DEFAULT
    assert cal.snapshot()[POOL]["input"] == {
        "tokens_per_message": None,
        "chars_per_token": None,
        "samples": 0,
    }


def _spread(steps: list[tuple[int, int]], decay: float) -> float:
    """1 − ρ² of the decayed messages and chars vectors, by Lagrange's identity (not the
    way the code computes it): 0 when chars ∝ messages, the fit's conditioning."""
    w = [decay ** (len(steps) - 1 - i) for i in range(len(steps))]
    mm = sum(wi * m * m for wi, (m, _) in zip(w, steps, strict=True))
    cc = sum(wi * c * c for wi, (_, c) in zip(w, steps, strict=True))
    cross = sum(
        w[i] * w[j] * (steps[i][0] * steps[j][1] - steps[j][0] * steps[i][1]) ** 2
        for i in range(len(steps))
        for j in range(i + 1, len(steps))
    )
    return cross / (mm * cc)


@given(
    half_life=st.integers(1, 10**6),
    per_message=st.integers(0, 64),
    q=st.integers(1, 4),
    prior=PRIORS,
    data=st.data(),
)
def test_exact_data_recovers_tokens_per_message_and_chars_per_token(
    half_life: int, per_message: int, q: int, prior: InputModel, data: st.DataObject
) -> None:
    """Noise-free t = a·m + c/k, the chars/messages ratio varied: a and k are found within
    1%, whatever the prior. k = p/q spans the bounds [1, 12]; each c is a multiple of p, so
    that t is a whole number of tokens."""
    p = data.draw(st.integers(q, 12 * q), label="p")
    steps = data.draw(
        st.lists(st.tuples(st.integers(1, 64), st.integers(1, 5000)), min_size=2, max_size=30),
        label="steps (messages, chars / p)",
    )
    assume(_spread(steps, 0.5 ** (1 / half_life)) >= 1e-3)
    cal = Calibration(half_life_requests=half_life)
    for messages, j in steps:
        prompt(cal, p * j, per_message * messages + q * j, messages=messages)
    model = cal.input_model(POOL, prior)
    assert model.tokens_per_message == pytest.approx(per_message, rel=0.01, abs=0.01)
    assert model.chars_per_token == pytest.approx(p / q, rel=0.01)


def _assert_sane(model: InputModel, default: InputModel, cal: Calibration) -> None:
    """The default as is (not learned, or no float sense in the sums), else within bounds."""
    if model is default:
        return
    low, high = cal.chars_per_token_bounds
    assert 0 <= model.tokens_per_message <= 64
    assert low <= model.chars_per_token <= high


@given(
    half_life=st.sampled_from([1, 2, 5000, 10**12]) | st.integers(1, 10**12),
    prior=PRIORS,
    steps=st.lists(
        st.tuples(
            st.integers(0, 2**31),  # chars: a body of up to 2 GiB
            st.integers(0, 10**9),  # messages
            st.none() | st.integers(0, 10**9),  # prompt tokens, as the handler admits them
        ),
        max_size=30,
    ),
)
def test_the_input_model_is_always_finite_and_within_bounds(
    half_life: int, prior: InputModel, steps: list[tuple[int, int, int | None]]
) -> None:
    cal = Calibration(half_life_requests=half_life)
    for chars, messages, tokens in steps:
        prompt(cal, chars, tokens, messages=messages)
    model = cal.input_model(POOL, prior)
    _assert_sane(model, prior, cal)
    learned = any(c > 0 and m >= 0 and t for c, m, t in steps)
    assert (model is prior) is not learned  # observations of counts always make sense
    for value in cal.snapshot({POOL: prior}).get(POOL, {}).get("input", {}).values():
        assert value is None or math.isfinite(value)


@given(
    prior=PRIORS,
    other=PRIORS,
    steps=st.lists(
        st.tuples(st.integers(1, 10**6), st.integers(1, 50), st.integers(1, 10**6), st.booleans()),
        max_size=30,
    ),
)
@example(  # one sample: the fit is the prior moved onto it, so it depends on the prior
    prior=InputModel(0.0, 4.0), other=InputModel(10.0, 3.0), steps=[(400, 1, 100, True)]
)
def test_the_fit_asked_between_observations_is_the_fit_of_everything_seen(
    prior: InputModel, other: InputModel, steps: list[tuple[int, int, int, bool]]
) -> None:
    """The fit is kept between observations (every request is priced on it): asked after
    any of them, or with another prior, it is what a calibration asked only then gives."""
    cal = Calibration(half_life_requests=7)
    for i, (chars, messages, tokens, ask) in enumerate(steps):
        prompt(cal, chars, tokens, messages=messages)
        if not ask:
            continue
        for asked in (prior, other, prior):
            twin = Calibration(half_life_requests=7)
            for chars_, messages_, tokens_, _ in steps[: i + 1]:
                prompt(twin, chars_, tokens_, messages=messages_)
            assert cal.input_model(POOL, asked) == twin.input_model(POOL, asked)


_SUM = st.sampled_from([0.0, 5e-324, 1e-300, 1.0, 1e300, 1.7976931348623157e308]) | st.floats(
    0, 1.7976931348623157e308
)


@given(
    sums=st.fixed_dictionaries({key: _SUM for key in _INPUT_SUMS}),
    samples=st.integers(1, 10**9),
    prior=PRIORS,
)
def test_any_stored_sums_give_a_finite_model_within_bounds(
    sums: dict[str, float], samples: int, prior: InputModel
) -> None:
    """Even sums no sequence of observations makes (a hand-edited file): no overflow, no NaN."""
    cal = Calibration.from_json(_doc(input=_input(**sums, samples=samples)), half_life_requests=9)
    model = cal.input_model("p", prior)
    _assert_sane(model, prior, cal)
    for value in cal.snapshot({"p": prior})["p"]["input"].values():
        assert value is None or math.isfinite(value)


def test_short_chats_no_longer_price_a_long_prompt_at_the_chars_per_token_floor() -> None:
    """Issue 16: short chats, their template's tokens as many as their text's.

    200 requests of 1–6 messages of 1–16 characters, each really t = 7·m + ⌈c/4⌉ tokens (a
    template of 7 tokens a message, text at 4 chars/token), learned at the proxy's default
    settings (half-life 5000, trusted after 50); then a 3,996-character single message,
    really 7 + 999 = 1,006 tokens:

    - the old ratio Σchars ÷ Σtokens (decayed) is 0.91 chars/token, clamped to its floor
      1.0: the prompt was priced 3,996 tokens, 3.97× its real count;
    - the fit finds a = 7.07 tokens a message and 3.96 chars/token: priced ⌈1,016.1⌉ =
      1,017 tokens (+1.1%).

    (Over 300 seeds of these data the fit's worst error was 3.5%; the ratio never rose
    above 0.98, so it priced the prompt 3,996 every time.)
    """
    rng = random.Random(16)
    cal = Calibration(half_life_requests=5000, min_pool_samples=50)
    for _ in range(200):
        lengths = [rng.randint(1, 16) for _ in range(rng.randint(1, 6))]
        chars = sum(lengths)
        prompt(cal, chars, 7 * len(lengths) + math.ceil(chars / 4), messages=len(lengths))
    model = cal.input_model(POOL, DEFAULT)
    assert model.tokens(1, 3996) == pytest.approx(7 + 999, rel=0.05)


# -- output_ratio ----------------------------------------------------------------------------


def test_output_ratio_is_the_default_until_learned() -> None:
    cal = Calibration(half_life_requests=100)
    assert cal.output_ratio(POOL, "acme", 0.7) == 0.7
    prompt(cal, 400, 100)
    assert cal.output_ratio(POOL, "acme", 0.7) == 0.7


def test_default_is_returned_unclamped() -> None:
    """The configured value is the operator's; only learned values are clamped."""
    cal = Calibration(half_life_requests=100)
    assert cal.output_ratio(POOL, "acme", 0.001) == 0.001


def test_pool_ratio_until_the_org_has_min_samples_then_its_own() -> None:
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE, min_org_samples=3)
    for _ in range(4):
        output(cal, 90, 100, org="heavy")  # 0.9
    output(cal, 50, 100, org="light")  # 0.5
    output(cal, 50, 100, org="light")
    pool_value = (4 * 90 * 0.9 + 2 * 50 * 0.5) / (4 * 90 + 2 * 50)  # weighed by output
    assert cal.output_ratio(POOL, "light", 1.0) == pytest.approx(pool_value, rel=1e-9)
    assert cal.output_ratio(POOL, "newcomer", 1.0) == pytest.approx(pool_value, rel=1e-9)
    output(cal, 50, 100, org="light")  # the third sample: now its own
    assert cal.output_ratio(POOL, "light", 1.0) == pytest.approx(0.5, rel=1e-9)
    assert cal.output_ratio(POOL, "heavy", 1.0) == pytest.approx(0.9, rel=1e-9)


def test_orgs_are_per_pool() -> None:
    cal = Calibration(half_life_requests=100, min_org_samples=1)
    observe(cal, "p1", "acme", 0, 1, None, 100, 20)
    observe(cal, "p2", "acme", 0, 1, None, 100, 80)
    assert cal.output_ratio("p1", "acme", 1.0) == 0.2
    assert cal.output_ratio("p2", "acme", 1.0) == 0.8


@pytest.mark.parametrize(
    ("completion", "max_tokens", "expected"),
    [(0, 100, 0.01), (300, 100, 1.0), (1, 1000, 0.01), (50, 100, 0.5)],
)
def test_output_ratio_is_clamped(completion: int, max_tokens: int, expected: float) -> None:
    cal = Calibration(half_life_requests=100, min_org_samples=1)
    output(cal, completion, max_tokens)
    assert cal.output_ratio(POOL, "acme", 0.3) == expected  # the org's own
    assert cal.output_ratio(POOL, "other", 0.3) == expected  # the pool's


@pytest.mark.parametrize(("completion", "max_tokens"), [(None, 100), (10, 0), (10, -5), (-1, 10)])
def test_missing_completion_or_budget_is_ignored(completion: int | None, max_tokens: int) -> None:
    cal = Calibration(half_life_requests=100, min_org_samples=0)
    output(cal, completion, max_tokens)
    assert cal.output_ratio(POOL, "acme", 0.7) == 0.7
    assert cal.snapshot()[POOL]["output_ratio"] == {"value": None, "samples": 0}
    assert cal.snapshot()[POOL]["orgs"] == {}


@given(
    half_life=st.integers(1, 10**6),
    q=st.integers(1, 100),
    data=st.data(),
)
def test_a_fixed_true_ratio_is_learned_exactly(half_life: int, q: int, data: st.DataObject) -> None:
    p = data.draw(st.integers(1, q), label="p")  # r = p/q ∈ [0.01, 1]: never clamped
    steps = data.draw(
        st.lists(st.tuples(st.integers(1, 10_000), st.sampled_from("abc")), min_size=1),
        label="steps",
    )
    cal = Calibration(half_life_requests=half_life, min_org_samples=1)
    for k, org in steps:
        output(cal, p * k, q * k, org=org)  # completion = r · max_tokens exactly
    r = p / q
    assert abs(cal.output_ratio(POOL, "nobody", 1.0) - r) <= 1e-9
    for org in {org for _, org in steps}:
        assert abs(cal.output_ratio(POOL, org, 1.0) - r) <= 1e-9


# -- memory bound ----------------------------------------------------------------------------


def test_max_orgs_evicts_the_org_with_fewest_samples() -> None:
    cal = Calibration(half_life_requests=100, min_org_samples=1, max_orgs=3)
    for org, count in [("a", 5), ("b", 1), ("c", 3)]:
        for _ in range(count):
            output(cal, 50, 100, org=org)
    output(cal, 10, 100, org="d")
    assert list(cal.snapshot()[POOL]["orgs"]) == ["a", "c", "d"]
    output(cal, 10, 100, org="d")
    output(cal, 10, 100, org="e")  # d has 2 samples, fewer than a (5) and c (3)
    assert sorted(cal.snapshot()[POOL]["orgs"]) == ["a", "c", "e"]
    assert cal.output_ratio(POOL, "d", 0.9) == pytest.approx(cal.output_ratio(POOL, "z", 0.9))


def test_max_orgs_ties_evict_the_least_recently_observed() -> None:
    cal = Calibration(half_life_requests=100, max_orgs=2)
    output(cal, 50, 100, org="a")
    output(cal, 50, 100, org="b")
    output(cal, 50, 100, org="a")
    output(cal, 50, 100, org="b")  # both have 2 samples; a was seen less recently
    output(cal, 50, 100, org="c")
    assert sorted(cal.snapshot()[POOL]["orgs"]) == ["b", "c"]


def test_max_orgs_is_per_pool() -> None:
    cal = Calibration(half_life_requests=100, max_orgs=1)
    observe(cal, "p1", "a", 0, 1, None, 10, 1)
    observe(cal, "p2", "b", 0, 1, None, 10, 1)
    snapshot = cal.snapshot()
    assert list(snapshot["p1"]["orgs"]) == ["a"]
    assert list(snapshot["p2"]["orgs"]) == ["b"]


def test_from_json_with_a_smaller_max_orgs_keeps_the_best_sampled() -> None:
    cal = Calibration(half_life_requests=100)
    for org, count in [("a", 1), ("b", 4), ("c", 2), ("d", 3)]:
        for _ in range(count):
            output(cal, 50, 100, org=org)
    restored = Calibration.from_json(cal.to_json(), half_life_requests=100, max_orgs=2)
    assert sorted(restored.snapshot()[POOL]["orgs"]) == ["b", "d"]


# -- merging what several processes learned --------------------------------------------------

Step = tuple[str, str, int, int, int | None, int, int | None]


def or_none(counts: st.SearchStrategy[int]) -> st.SearchStrategy[int | None]:
    """A count, or now and then none (a response without that usage)."""
    return st.tuples(counts, st.integers(0, 4)).map(lambda pair: pair[0] if pair[1] else None)


STEP = st.tuples(
    st.sampled_from(["p", "q"]),  # pool
    st.sampled_from("abc"),  # org
    st.integers(0, 4000),  # chars (0: not all text)
    st.integers(0, 12),  # messages
    or_none(st.integers(0, 3000)),  # prompt tokens
    st.integers(-1, 4096),  # max_tokens
    or_none(st.integers(-1, 4096)),  # completion tokens
)
STEPS = st.lists(STEP, max_size=40)


def learned_from(steps: list[Step], **settings: Any) -> Calibration:
    cal = Calibration(**settings)
    for step in steps:
        observe(cal, *step)
    return cal


def merged_in_batches(steps: list[Step], cuts: set[int], **settings: Any) -> Calibration:
    """Each batch learned from nothing by a calibration of its own, then merged in order, as
    the shared calibration's deltas are; ``later`` is checked to come out unchanged."""
    merged = Calibration(**settings)
    bounds = [0, *sorted(cuts), len(steps)]
    for start, end in itertools.pairwise(bounds):
        batch = learned_from(steps[start:end], **settings)
        before = batch.to_json()
        merged.merge(batch)
        assert batch.to_json() == before
        for pool in merged.snapshot().values():
            assert len(pool["orgs"]) <= merged.max_orgs
    return merged


def sums(cal: Calibration) -> dict[str, float]:
    """Every decayed sum and count, by its path in the document."""
    flat: dict[str, float] = {}

    def walk(node: Any, path: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{path}{key}.")
            else:
                flat[f"{path}{key}"] = value

    walk(cal.to_json()["pools"], "")
    return flat


def estimates(cal: Calibration) -> dict[str, float]:
    """What a cost model would use for every pool and org (and an org never seen)."""
    prior = InputModel(5.0, 3.0)
    found: dict[str, float] = {}
    for pool in ("p", "q"):
        model = cal.input_model(pool, prior)
        found[f"{pool} a"], found[f"{pool} cpt"] = model.tokens_per_message, model.chars_per_token
        for org in "abcz":
            found[f"{pool} {org}"] = cal.output_ratio(pool, org, 0.3)
    return found


@given(
    half_life=st.integers(1, 50),
    min_pool_samples=st.integers(1, 3),
    steps=STEPS,
    data=st.data(),
)
def test_merging_batches_in_order_is_learning_them_in_one(
    half_life: int, min_pool_samples: int, steps: list[Step], data: st.DataObject
) -> None:
    cuts = data.draw(st.sets(st.integers(0, len(steps)), min_size=1), label="cuts")
    settings = {
        "half_life_requests": half_life,
        "min_pool_samples": min_pool_samples,
        "min_org_samples": 2,  # orgs' own ratios are used, not only their pool's
    }
    whole = learned_from(steps, **settings)
    merged = merged_in_batches(steps, cuts, **settings)
    assert sums(merged) == pytest.approx(sums(whole), rel=1e-9)
    assert estimates(merged) == pytest.approx(estimates(whole), rel=1e-9, abs=1e-9)
    orgs = {name: list(pool["orgs"]) for name, pool in whole.snapshot().items()}
    assert {name: list(pool["orgs"]) for name, pool in merged.snapshot().items()} == orgs


@given(max_orgs=st.integers(1, 2), steps=STEPS, data=st.data())
def test_a_merge_keeps_max_orgs_and_the_pools_own_sums_exact(
    max_orgs: int, steps: list[Step], data: st.DataObject
) -> None:
    """Dropping orgs is not exact across batches (an org that one calibration drops and
    sees again starts over; merged, it keeps its history), but the bound holds after every
    merge, and the pools' own sums are those of learning in one."""
    cuts = data.draw(st.sets(st.integers(0, len(steps)), min_size=1), label="cuts")
    settings = {"half_life_requests": 3, "max_orgs": max_orgs}
    whole = learned_from(steps, **settings)
    merged = merged_in_batches(steps, cuts, **settings)

    def pools_own(cal: Calibration) -> dict[str, float]:
        return {path: value for path, value in sums(cal).items() if ".orgs." not in path}

    assert pools_own(merged) == pytest.approx(pools_own(whole), rel=1e-9)


def test_merge_ages_what_was_there_by_the_later_observations_of_the_same_sums() -> None:
    """Half-life 1: what was there is halved once per later observation of its own group
    (the pool's ratio twice, org b's not at all); as in the half-life test above."""
    base = Calibration(half_life_requests=1, min_org_samples=1)
    output(base, 10, 100, org="a")
    output(base, 40, 100, org="b")
    later = Calibration(half_life_requests=1, min_org_samples=1)
    output(later, 50, 100, org="a")
    output(later, 30, 60, org="a")
    base.merge(later)
    pool = base.to_json()["pools"][POOL]
    # each sample weighs its output: it adds output · ratio and output (1, 10; 16, 40; ...)
    # (1·½ + 16)·¼ + 25·½ + 15, (10·½ + 40)·¼ + 50·½ + 30
    assert pool["output_ratio"] == {"num": 31.625, "den": 66.25, "samples": 4}
    assert pool["orgs"] == {
        "b": {"num": 16.0, "den": 40.0, "samples": 1},
        "a": {"num": 27.75, "den": 57.5, "samples": 3},  # 1·¼ + 25·½ + 15; most recent
    }


def test_merge_copies_what_it_takes() -> None:
    merged, later = Calibration(half_life_requests=4), learned_cal()
    learned = later.to_json()
    merged.merge(later)
    observe(merged, "a", "x", 400, 1, 100, 100, 25)
    assert later.to_json() == learned


def test_merge_refuses_a_calibration_of_another_half_life() -> None:
    with pytest.raises(ValueError, match="decay"):
        Calibration(half_life_requests=4).merge(Calibration(half_life_requests=5))


# -- shared through Redis: base ⊕ delta (sfq_proxy.state.redis_calibration) -----------------


@hypothesis_settings(max_examples=300)  # a delta given back out of order fails 1 in 100
@given(events=st.lists(STEP | st.sampled_from(["take", "pushed", "failed"]), max_size=60))
def test_a_shared_calibration_prices_as_one_that_learned_everything(
    events: list[Step | str],
) -> None:
    """Observations, and syncs that take the delta, then push it into the store (Redis, here
    a Calibration) or fail and give it back, with observations arriving in between (the
    round trip): the shared calibration always holds what one calibration learning every
    observation would, and so does the store after a last sync."""
    settings = {"half_life_requests": 5, "min_org_samples": 2}
    shared, store = SharedCalibration(**settings), Calibration(**settings)
    whole = Calibration(**settings)
    taken = None
    for event in [*events, "pushed", "take", "pushed"]:  # the last sync goes through
        if isinstance(event, tuple):
            observe(shared, *event)
            observe(whole, *event)
        elif event == "take" and taken is None:
            taken = shared.take()
        elif event == "failed" and taken is not None:
            shared.give_back(taken)
            taken = None
        elif event == "pushed" and taken is not None:
            store.merge(taken.learned)
            merged = Calibration(**settings)
            merged.merge(store)
            shared.adopt(merged)
            taken = None
        assert sums(shared) == pytest.approx(sums(whole), rel=1e-9)
        assert estimates(shared) == pytest.approx(estimates(whole), rel=1e-9, abs=1e-9)
    assert sums(store) == pytest.approx(sums(whole), rel=1e-9)
    assert shared.delta.observations == 0


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"half_life_requests": 0},
        {"half_life_requests": 1.5},
        {"half_life_requests": 10, "min_org_samples": -1},
        {"half_life_requests": 10, "max_orgs": 0},
        {"half_life_requests": 10, "chars_per_token_bounds": (0.0, 4.0)},
        {"half_life_requests": 10, "chars_per_token_bounds": (5.0, 4.0)},
        {"half_life_requests": 10, "output_ratio_bounds": (0.01, math.inf)},
        {"half_life_requests": 10, "output_ratio_bounds": (math.nan, 1.0)},
        {"half_life_requests": 10, "output_ratio_bounds": (0.5,)},
    ],
)
def test_invalid_settings_are_rejected(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message varies with the setting
        Calibration(**settings)


# -- snapshot and persistence ----------------------------------------------------------------


def test_snapshot_reports_clamped_values_and_samples() -> None:
    cal = learned_cal()
    d = 0.5 ** (1 / 4)
    snapshot = cal.snapshot()
    # pool a: two requests, a + 400·b = 100 and 3a + 310·b = 99, solved exactly
    a = {"tokens_per_message": 100 - 400 * 201 / 890, "chars_per_token": 890 / 201}
    assert snapshot["a"].pop("input") == pytest.approx(a | {"samples": 2}, rel=1e-9)
    # pool b: one request, so the prior (CostSpec's when not given) moved onto it
    b = on_the_data(1, 123, 31, InputModel(0.0, 4.0))
    assert snapshot["b"].pop("input") == pytest.approx(
        {"tokens_per_message": b.tokens_per_message, "chars_per_token": b.chars_per_token,
         "samples": 1}, rel=1e-9
    )  # fmt: skip
    # each sample weighs its output: it adds output² / max_tokens and output
    pool_a = ((25**2 / 100 * d + 7**2 / 256) * d + 64) / ((25 * d + 7) * d + 64)
    assert (25**2 / 100 * d + 7**2 / 256) / (25 * d + 7) < pool_a / 2
    assert snapshot == {
        "a": {
            "output_ratio": {"value": pool_a, "samples": 3},
            "orgs": {
                "x": {"value": pool_a / 2, "samples": 2},  # its own is below half its pool's
                "y": {"value": 1.0, "samples": 1},
            },
        },
        "b": {
            "output_ratio": {"value": None, "samples": 0},
            "orgs": {},
        },
    }
    assert Calibration(half_life_requests=1).snapshot() == {}


def test_snapshot_uses_each_pools_prior_where_the_fit_cannot_tell() -> None:
    prior = InputModel(5.0, 3.0)
    snapshot = learned_cal().snapshot({"b": prior, "a": InputModel(50.0, 9.0)})
    b = on_the_data(1, 123, 31, prior)
    assert snapshot["b"]["input"]["tokens_per_message"] == pytest.approx(b.tokens_per_message)
    assert snapshot["b"]["input"]["chars_per_token"] == pytest.approx(b.chars_per_token)
    assert snapshot["a"]["input"]["tokens_per_message"] == pytest.approx(9.66, abs=0.01)


def test_json_round_trip_keeps_values_and_samples() -> None:
    cal = learned_cal()
    document = json.loads(json.dumps(cal.to_json(), allow_nan=False))
    assert document["version"] == FORMAT_VERSION == 3
    assert set(document["pools"]["a"]["input"]) == set(_INPUT_SUMS) | {"samples"}
    restored = Calibration.from_json(document, half_life_requests=4, min_org_samples=2)
    assert restored.to_json() == cal.to_json()
    assert restored.snapshot() == cal.snapshot()
    assert restored.output_ratio("a", "x", 0.5) == cal.output_ratio("a", "x", 0.5)
    assert restored.input_model("a", DEFAULT) == cal.input_model("a", DEFAULT)


def test_restored_calibration_keeps_learning_where_it_was() -> None:
    cal = learned_cal()
    restored = Calibration.from_json(cal.to_json(), half_life_requests=4, min_org_samples=2)
    for each in (cal, restored):
        observe(each, "a", "x", 50, 2, 10, 30, 3)
    assert restored.to_json() == cal.to_json()


def test_a_version_1_document_keeps_its_output_ratios_and_drops_chars_per_token() -> None:
    """Version 1 learned chars/token as one ratio, which cannot be split into a and b."""
    document = {
        "version": 1,
        "pools": {
            "p": {
                "chars_per_token": _ratio(num=4000.0, den=1000.0, samples=10),
                "output_ratio": _ratio(num=25.0, den=100.0, samples=3),
                "orgs": {"acme": _ratio(num=2.0, den=10.0, samples=3)},
            }
        },
    }
    cal = Calibration.from_json(document, half_life_requests=10, min_org_samples=3)
    assert cal.input_model("p", InputModel(2.0, 3.0)) == InputModel(2.0, 3.0)
    assert cal.output_ratio("p", "acme", 1.0) == 0.2
    assert cal.output_ratio("p", "other", 1.0) == 0.25
    pool = cal.to_json()["pools"]["p"]
    assert cal.to_json()["version"] == 3
    assert pool["input"] == _input()
    assert pool["output_ratio"] == _ratio(num=6.25, den=25.0, samples=3)  # reweighed


def test_a_version_2_documents_output_ratios_are_kept_weighing_their_output() -> None:
    """Version 2 summed Σ completion ÷ Σ max_tokens: each ratio keeps its value, and weighs
    the output it was learned from, as a request's own output weighs it now."""
    fit = _input(samples=1, m=1, c=400, t=100, mm=1, mc=400, cc=160_000, mt=100, ct=40_000)
    document = _doc(
        input=fit,
        output_ratio=_ratio(num=300.0, den=1200.0, samples=4),
        orgs={"acme": _ratio(num=80.0, den=100.0, samples=2), "none": _ratio(0.0, 0.0, 1)},
    )
    cal = Calibration.from_json(document | {"version": 2}, half_life_requests=10)
    pool = cal.to_json()["pools"]["p"]
    assert pool["input"] == {key: float(value) for key, value in fit.items()} | {"samples": 1}
    assert pool["output_ratio"] == _ratio(num=75.0, den=300.0, samples=4)
    assert pool["orgs"] == {"acme": _ratio(64.0, 80.0, 2), "none": _ratio(0.0, 0.0, 1)}


def _input(samples: Any = 0, **sums: Any) -> dict[str, Any]:
    return {key: 0.0 for key in _INPUT_SUMS} | sums | {"samples": samples}


def _doc(**pool: Any) -> dict[str, Any]:
    empty = {"num": 0.0, "den": 0.0, "samples": 0}
    base = {"input": _input(), "output_ratio": dict(empty), "orgs": {}}
    return {"version": FORMAT_VERSION, "pools": {"p": base | pool}}


def _doc_v1(**pool: Any) -> dict[str, Any]:
    empty = {"num": 0.0, "den": 0.0, "samples": 0}
    base = {"chars_per_token": dict(empty), "output_ratio": dict(empty), "orgs": {}}
    return {"version": 1, "pools": {"p": base | pool}}


def _ratio(num: Any = 1.0, den: Any = 2.0, samples: Any = 1) -> dict[str, Any]:
    return {"num": num, "den": den, "samples": samples}


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ([], "document"),
        ("calibration", "document"),
        ({"pools": {}}, "version"),
        ({"version": 4, "pools": {}}, "version"),
        ({"version": True, "pools": {}}, "version"),
        ({"version": 2.0, "pools": {}}, "version"),
        ({"version": 2, "pools": {}, "extra": 1}, "extra"),
        ({"version": 2, "pools": []}, "pools"),
        ({"version": 2, "pools": {"p": None}}, "pools.p"),
        ({"version": 2, "pools": {"p": {"input": _input()}}}, "pools.p"),
        (_doc(extra=1), "pools.p"),
        (_doc(orgs=[]), "pools.p.orgs"),
        (_doc(orgs={"acme": "0.5"}), "pools.p.orgs.acme"),
        (_doc(output_ratio={"num": 1.0, "den": 2.0}), "pools.p.output_ratio"),
        (_doc(output_ratio=_ratio() | {"extra": 0}), "pools.p.output_ratio"),
        (_doc(output_ratio=_ratio(num=math.nan)), "pools.p.output_ratio.num"),
        (_doc(output_ratio=_ratio(den=math.inf)), "pools.p.output_ratio.den"),
        (_doc(input=None), "pools.p.input"),
        (_doc(input=_input() | {"extra": 0.0}), "pools.p.input"),
        (_doc(input={k: v for k, v in _input().items() if k != "ct"}), "pools.p.input"),
        (_doc(input=_input(mt=-1.0)), "pools.p.input.mt"),
        (_doc(input=_input(cc=math.nan)), "pools.p.input.cc"),
        (_doc(input=_input(c=math.inf)), "pools.p.input.c"),
        (_doc(input=_input(mc="1")), "pools.p.input.mc"),
        (_doc(input=_input(t=True)), "pools.p.input.t"),
        (_doc(input=_input(ct=10**400)), "pools.p.input.ct"),
        (_doc(input=_input(samples=1.0)), "pools.p.input.samples"),
        (_doc(input=_input(samples=-1)), "pools.p.input.samples"),
        (_doc(chars_per_token=_ratio()), "pools.p"),  # a version 1 pool in a version 2 doc
        (_doc(orgs={"acme": _ratio(samples=1.0)}), "pools.p.orgs.acme.samples"),
        (_doc(orgs={"acme": _ratio(samples=-1)}), "pools.p.orgs.acme.samples"),
        (_doc(orgs={"acme": _ratio(samples=True)}), "pools.p.orgs.acme.samples"),
        (_doc(orgs={"acme": _ratio(den=-math.inf)}), "pools.p.orgs.acme.den"),
        # version 1 is still read as strictly as it was
        ({"version": 1, "pools": {"p": {"chars_per_token": _ratio()}}}, "pools.p"),
        (_doc_v1(input=_input()), "pools.p"),
        (_doc_v1(chars_per_token=_ratio(num=-1.0)), "pools.p.chars_per_token.num"),
        (_doc_v1(chars_per_token=_ratio(num="1")), "pools.p.chars_per_token.num"),
        (_doc_v1(chars_per_token=_ratio(num=True)), "pools.p.chars_per_token.num"),
        (_doc_v1(chars_per_token=_ratio(num=10**400)), "pools.p.chars_per_token.num"),
        (_doc_v1(output_ratio=_ratio(num=math.nan)), "pools.p.output_ratio.num"),
    ],
)
def test_from_json_rejects_malformed_documents(document: Any, where: str) -> None:
    with pytest.raises(ValueError, match=re.escape(where)):
        Calibration.from_json(document, half_life_requests=10)


def test_from_json_accepts_integer_sums() -> None:
    restored = Calibration.from_json(_doc(output_ratio=_ratio(num=1, den=4)), half_life_requests=10)
    assert restored.output_ratio("p", "acme", 1.0) == 0.25
    fit = _input(samples=1, m=1, c=400, t=100, mm=1, mc=400, cc=160_000, mt=100, ct=40_000)
    restored = Calibration.from_json(_doc(input=fit), half_life_requests=10)
    assert restored.input_model("p", DEFAULT) == InputModel(0.0, 4.0)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    cal = learned_cal()
    path = tmp_path / "calibration.json"
    save(cal, path)
    restored = load(path, half_life_requests=4, min_org_samples=2)
    assert restored.to_json() == cal.to_json()
    assert restored.min_org_samples == 2
    assert restored.half_life_requests == 4


def test_save_replaces_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    save(Calibration(half_life_requests=4), path)
    cal = learned_cal()
    save(cal, path)
    assert os.listdir(tmp_path) == ["calibration.json"]
    assert json.loads(path.read_text()) == cal.to_json()


def test_failed_save_keeps_the_old_file_and_leaves_no_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "calibration.json"
    save(Calibration(half_life_requests=4), path)
    before = path.read_text()

    def failing_replace(src: str, dst: str) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(atomic_file.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk on fire"):
        save(learned_cal(), path)
    assert os.listdir(tmp_path) == ["calibration.json"]
    assert path.read_text() == before


def _assert_fresh_with_warning(
    caplog: pytest.LogCaptureFixture, path: Path, words: str
) -> Calibration:
    with caplog.at_level(logging.WARNING, logger="sfq_proxy.state.calibration_file"):
        cal = load(path, half_life_requests=7, min_org_samples=3)
    assert cal.to_json() == {"version": FORMAT_VERSION, "pools": {}}
    assert (cal.half_life_requests, cal.min_org_samples) == (7, 3)
    [record] = [r for r in caplog.records if r.name == "sfq_proxy.state.calibration_file"]
    assert record.levelno == logging.WARNING
    assert words in record.getMessage()
    assert str(path) in record.getMessage()
    return cal


def test_missing_file_gives_a_fresh_calibration_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _assert_fresh_with_warning(caplog, tmp_path / "absent.json", "not found")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{", "Expecting"),
        ("", "Expecting value"),
        ("[1, 2]", "expected an object"),
        ('{"version": 1, "pools": {"p": 3}}', "pools.p"),
        (
            '{"version": 1, "pools": {"p": {"chars_per_token": {"num": NaN, "den": 1, '
            '"samples": 1}, "output_ratio": {"num": 0, "den": 0, "samples": 0}, "orgs": {}}}}',
            "pools.p.chars_per_token.num",
        ),
        ('{"version": 1, "pools": {"p": {"orgs": {}}}}', "pools.p"),
        (
            json.dumps(_doc(input=_input(samples=1, mt=-2.0))),
            "pools.p.input.mt",
        ),
        ('{"version": 4, "pools": {}}', "unsupported version 4"),
    ],
)
def test_corrupt_file_gives_a_fresh_calibration_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, reason: str
) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(content)
    _assert_fresh_with_warning(caplog, path, "corrupt")
    assert reason in caplog.text


def test_a_version_1_file_loads_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file saved before the input fit: an upgrade keeps the learned output ratios."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(_doc_v1(output_ratio=_ratio(num=1.0, den=4.0, samples=9))))
    with caplog.at_level(logging.WARNING, logger="sfq_proxy.state.calibration_file"):
        cal = load(path, half_life_requests=7)
    assert not caplog.records
    assert cal.output_ratio("p", "acme", 1.0) == 0.25
    save(cal, path)
    assert json.loads(path.read_text())["version"] == FORMAT_VERSION


def test_undecodable_file_gives_a_fresh_calibration_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "calibration.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    _assert_fresh_with_warning(caplog, path, "cannot read")


def test_load_still_rejects_invalid_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="half_life_requests"):
        load(tmp_path / "absent.json", half_life_requests=0)


# -- issue 38: what idle-time junk can teach ---------------------------------------------------


def test_a_thousand_one_token_answers_do_not_outweigh_one_of_a_thousand_tokens() -> None:
    """A sample weighs the output it generated, not its max_tokens: a thousand answers of 1
    token out of 120,000 weigh as much as one answer of 1,000 out of 1,000, no more. Weighed
    by max_tokens, they made the pool's ratio 2,000 / 120,001,000 (clamped to 0.01)."""
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE, min_org_samples=1)
    output(cal, 1000, 1000, org="worker")
    for _ in range(1000):
        output(cal, 1, 120_000, org="idler")
    assert cal.output_ratio(POOL, "newcomer", 0.3) == pytest.approx(0.5, rel=1e-4)
    assert cal.output_ratio(POOL, "worker", 0.3) == 1.0


def test_an_orgs_ratio_is_at_least_half_its_pools() -> None:
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE, min_org_samples=3)
    for _ in range(10):
        output(cal, 80, 100, org="others")
    for _ in range(3):
        output(cal, 1, 100, org="low")
    pool = cal.output_ratio(POOL, "newcomer", 1.0)
    assert pool == pytest.approx((10 * 80 * 0.8 + 3 * 0.01) / 803, rel=1e-9)
    assert cal.output_ratio(POOL, "low", 1.0) == pytest.approx(pool / 2, rel=1e-9)
    assert cal.snapshot()[POOL]["orgs"]["low"]["value"] == pytest.approx(pool / 2, rel=1e-9)
