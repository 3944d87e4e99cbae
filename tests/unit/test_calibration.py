"""Learning of the cost estimate's parameters from observed usage (sfq_proxy.core.calibration)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.core.calibration import Calibration, Ratio
from sfq_proxy.http import calibration_store as calibration_module
from sfq_proxy.http.calibration_store import load, save

POOL = "llama-8b"
HUGE_HALF_LIFE = 10**12  # decay ≈ 1 - 7e-13: a plain ratio of sums for any realistic test


def output(cal: Calibration, completion: int | None, max_tokens: int, org: str = "acme") -> None:
    cal.observe(
        POOL, org, chars=0, prompt_tokens=None, max_tokens=max_tokens, completion_tokens=completion
    )


def prompt(cal: Calibration, chars: int, prompt_tokens: int | None) -> None:
    cal.observe(
        POOL, "acme", chars=chars, prompt_tokens=prompt_tokens, max_tokens=0, completion_tokens=None
    )


def learned_cal() -> Calibration:
    cal = Calibration(half_life_requests=4, min_org_samples=2)
    cal.observe("a", "x", chars=400, prompt_tokens=100, max_tokens=100, completion_tokens=25)
    cal.observe("a", "x", chars=310, prompt_tokens=99, max_tokens=256, completion_tokens=7)
    cal.observe("a", "y", chars=0, prompt_tokens=12, max_tokens=64, completion_tokens=64)
    cal.observe("b", "x", chars=123, prompt_tokens=31, max_tokens=0, completion_tokens=None)
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
    cal = Calibration(half_life_requests=1, min_org_samples=1)
    assert cal.decay == 0.5
    for completion, max_tokens in [(10, 100), (50, 100), (30, 60)]:
        output(cal, completion, max_tokens)
    pool = cal.snapshot()[POOL]
    assert pool["output_ratio"] == {"value": 57.5 / 135.0, "samples": 3}
    assert pool["orgs"]["acme"] == {"value": 57.5 / 135.0, "samples": 3}
    assert cal.to_json()["pools"][POOL]["output_ratio"] == {"num": 57.5, "den": 135.0, "samples": 3}


def test_huge_half_life_is_the_plain_ratio_of_sums() -> None:
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE)
    for completion, max_tokens in [(10, 100), (50, 100), (30, 60)]:
        output(cal, completion, max_tokens)
    assert cal.output_ratio(POOL, "acme", 1.0) == pytest.approx(90 / 260, rel=1e-9)


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
    expected = (0.2 * old_weight + 0.6 * new_weight) / (old_weight + new_weight)
    learned = cal.output_ratio(POOL, "someone-else", 1.0)
    assert learned == pytest.approx(expected, rel=1e-12)
    assert learned == pytest.approx(0.4, abs=1e-9)  # halfway: d**1000 = 2**-100 is negligible


# -- chars_per_token -------------------------------------------------------------------------


def test_chars_per_token_is_the_default_until_learned() -> None:
    cal = Calibration(half_life_requests=100)
    assert cal.chars_per_token(POOL, 4.0) == 4.0
    output(cal, 10, 100)  # an output-only observation teaches nothing about chars
    assert cal.chars_per_token(POOL, 3.25) == 3.25


def test_chars_per_token_is_learned_from_prompt_usage() -> None:
    cal = Calibration(half_life_requests=HUGE_HALF_LIFE)
    prompt(cal, 400, 100)
    assert cal.chars_per_token(POOL, 9.0) == 4.0
    prompt(cal, 300, 100)
    assert cal.chars_per_token(POOL, 9.0) == pytest.approx(700 / 200, rel=1e-9)
    assert cal.chars_per_token("other-pool", 9.0) == 9.0


@pytest.mark.parametrize(
    ("chars", "prompt_tokens", "expected"),
    [(10_000, 10, 12.0), (5, 100, 1.0), (600, 100, 6.0)],
)
def test_chars_per_token_is_clamped_to_its_bounds(
    chars: int, prompt_tokens: int, expected: float
) -> None:
    cal = Calibration(half_life_requests=100)
    prompt(cal, chars, prompt_tokens)
    assert cal.chars_per_token(POOL, 4.0) == expected


def test_custom_chars_per_token_bounds() -> None:
    cal = Calibration(half_life_requests=100, chars_per_token_bounds=(2.0, 3.0))
    prompt(cal, 1000, 100)
    assert cal.chars_per_token(POOL, 4.0) == 3.0


@pytest.mark.parametrize(("chars", "prompt_tokens"), [(0, 50), (400, None), (400, 0)])
def test_text_less_or_uncounted_prompts_are_ignored(chars: int, prompt_tokens: int | None) -> None:
    cal = Calibration(half_life_requests=100)
    prompt(cal, chars, prompt_tokens)
    assert cal.chars_per_token(POOL, 4.0) == 4.0
    assert cal.snapshot()[POOL]["chars_per_token"] == {"value": None, "samples": 0}


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
    output(cal, 10, 100, org="light")  # 0.1
    output(cal, 10, 100, org="light")
    pool_value = (4 * 90 + 2 * 10) / 600
    assert cal.output_ratio(POOL, "light", 1.0) == pytest.approx(pool_value, rel=1e-9)
    assert cal.output_ratio(POOL, "newcomer", 1.0) == pytest.approx(pool_value, rel=1e-9)
    output(cal, 10, 100, org="light")  # the third sample: now its own
    assert cal.output_ratio(POOL, "light", 1.0) == pytest.approx(0.1, rel=1e-9)
    assert cal.output_ratio(POOL, "heavy", 1.0) == pytest.approx(0.9, rel=1e-9)


def test_orgs_are_per_pool() -> None:
    cal = Calibration(half_life_requests=100, min_org_samples=1)
    cal.observe("p1", "acme", chars=0, prompt_tokens=None, max_tokens=100, completion_tokens=20)
    cal.observe("p2", "acme", chars=0, prompt_tokens=None, max_tokens=100, completion_tokens=80)
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
    cal.observe("p1", "a", chars=0, prompt_tokens=None, max_tokens=10, completion_tokens=1)
    cal.observe("p2", "b", chars=0, prompt_tokens=None, max_tokens=10, completion_tokens=1)
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
    assert cal.snapshot() == {
        "a": {
            "chars_per_token": {"value": (400 * d + 310) / (100 * d + 99), "samples": 2},
            "output_ratio": {
                "value": ((25 * d + 7) * d + 64) / ((100 * d + 256) * d + 64),
                "samples": 3,
            },
            "orgs": {
                "x": {"value": (25 * d + 7) / (100 * d + 256), "samples": 2},
                "y": {"value": 1.0, "samples": 1},
            },
        },
        "b": {
            "chars_per_token": {"value": 123 / 31, "samples": 1},
            "output_ratio": {"value": None, "samples": 0},
            "orgs": {},
        },
    }
    assert Calibration(half_life_requests=1).snapshot() == {}


def test_json_round_trip_keeps_values_and_samples() -> None:
    cal = learned_cal()
    document = json.loads(json.dumps(cal.to_json(), allow_nan=False))
    restored = Calibration.from_json(document, half_life_requests=4, min_org_samples=2)
    assert restored.to_json() == cal.to_json()
    assert restored.snapshot() == cal.snapshot()
    assert restored.output_ratio("a", "x", 0.5) == cal.output_ratio("a", "x", 0.5)
    assert restored.chars_per_token("a", 4.0) == cal.chars_per_token("a", 4.0)


def test_restored_calibration_keeps_learning_where_it_was() -> None:
    cal = learned_cal()
    restored = Calibration.from_json(cal.to_json(), half_life_requests=4, min_org_samples=2)
    for each in (cal, restored):
        each.observe("a", "x", chars=50, prompt_tokens=10, max_tokens=30, completion_tokens=3)
    assert restored.to_json() == cal.to_json()


def _doc(**pool: Any) -> dict[str, Any]:
    empty = {"num": 0.0, "den": 0.0, "samples": 0}
    base = {"chars_per_token": dict(empty), "output_ratio": dict(empty), "orgs": {}}
    return {"version": 1, "pools": {"p": base | pool}}


def _ratio(num: Any = 1.0, den: Any = 2.0, samples: Any = 1) -> dict[str, Any]:
    return {"num": num, "den": den, "samples": samples}


@pytest.mark.parametrize(
    "document",
    [
        [],
        "calibration",
        {"pools": {}},
        {"version": 2, "pools": {}},
        {"version": 1, "pools": {}, "extra": 1},
        {"version": 1, "pools": []},
        {"version": 1, "pools": {"p": None}},
        {"version": 1, "pools": {"p": {"chars_per_token": _ratio()}}},
        _doc(extra=1),
        _doc(orgs=[]),
        _doc(orgs={"acme": "0.5"}),
        _doc(output_ratio={"num": 1.0, "den": 2.0}),
        _doc(output_ratio=_ratio() | {"extra": 0}),
        _doc(output_ratio=_ratio(num=math.nan)),
        _doc(output_ratio=_ratio(den=math.inf)),
        _doc(chars_per_token=_ratio(num=-1.0)),
        _doc(chars_per_token=_ratio(num="1")),
        _doc(chars_per_token=_ratio(num=True)),
        _doc(chars_per_token=_ratio(num=10**400)),
        _doc(orgs={"acme": _ratio(samples=1.0)}),
        _doc(orgs={"acme": _ratio(samples=-1)}),
        _doc(orgs={"acme": _ratio(samples=True)}),
        _doc(orgs={"acme": _ratio(den=-math.inf)}),
    ],
)
def test_from_json_rejects_malformed_documents(document: Any) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each message names its own defect
        Calibration.from_json(document, half_life_requests=10)


def test_from_json_accepts_integer_sums() -> None:
    restored = Calibration.from_json(_doc(output_ratio=_ratio(num=1, den=4)), half_life_requests=10)
    assert restored.output_ratio("p", "acme", 1.0) == 0.25


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

    monkeypatch.setattr(calibration_module.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk on fire"):
        save(learned_cal(), path)
    assert os.listdir(tmp_path) == ["calibration.json"]
    assert path.read_text() == before


def _assert_fresh_with_warning(
    caplog: pytest.LogCaptureFixture, path: Path, words: str
) -> Calibration:
    with caplog.at_level(logging.WARNING, logger="sfq_proxy.http.calibration_store"):
        cal = load(path, half_life_requests=7, min_org_samples=3)
    assert cal.to_json() == {"version": 1, "pools": {}}
    assert (cal.half_life_requests, cal.min_org_samples) == (7, 3)
    [record] = [r for r in caplog.records if r.name == "sfq_proxy.http.calibration_store"]
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
    ],
)
def test_corrupt_file_gives_a_fresh_calibration_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, reason: str
) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(content)
    _assert_fresh_with_warning(caplog, path, "corrupt")
    assert reason in caplog.text


def test_undecodable_file_gives_a_fresh_calibration_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "calibration.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    _assert_fresh_with_warning(caplog, path, "cannot read")


def test_load_still_rejects_invalid_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="half_life_requests"):
        load(tmp_path / "absent.json", half_life_requests=0)
