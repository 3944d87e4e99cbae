"""Access per key (docs/access.md): what a key and its org may use, and the orgs check."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.config import (
    Config,
    ConfigError,
    OrgSpec,
    did_you_mean,
    effective_access,
    parse_config,
    usable_models,
)
from sfq_proxy.config.summary import summary, warnings
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.flows import classify, may_use

GPU_MODELS = ["llama-8b-instruct", "llama-70b-instruct"]
PAID_MODELS = ["gpt-4o-mini"]


def base() -> dict[str, Any]:
    """Two pools: the GPUs (two models) and a paid provider (one); two orgs with a key each."""
    return {
        "keys": [
            {"key": "sk-analytics", "org": "analytics", "classes": ["batch"]},
            {"key": "sk-product", "org": "product", "classes": ["interactive", "batch"]},
        ],
        "orgs": {"analytics": {"rpm": 600}},
        "pools": {
            "gpu": {
                "models": GPU_MODELS,
                "backends": [{"url": "http://10.0.0.1:8000", "slots": 8}],
            },
            "provider-a": {
                "models": PAID_MODELS,
                "backends": [{"url": "https://provider.example/v1", "slots": 8}],
            },
        },
    }


def parse(data: dict[str, Any]) -> Config:
    return parse_config(yaml.safe_dump(data), environ={})


def errors(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(data)
    return str(info.value).splitlines()


def with_access(key: dict[str, Any] | None = None, org: dict[str, Any] | None = None) -> Config:
    """``base()`` with ``key`` added to analytics' key and ``org`` to analytics' entry."""
    data = base()
    data["keys"][0].update(key or {})
    data["orgs"]["analytics"].update(org or {})
    return parse(data)


def analytics(config: Config) -> tuple[frozenset[str] | None, frozenset[str] | None]:
    key = config.resolved_keys()[0]
    return key.pools, key.models


# --- the effective access: key ∩ org ---------------------------------------------------


def test_without_lists_every_key_reaches_every_model() -> None:
    config = parse(base())
    assert [(k.pools, k.models) for k in config.resolved_keys()] == [(None, None), (None, None)]


@pytest.mark.parametrize(
    ("key", "org", "expected"),
    [
        ({"pools": ["gpu"]}, {}, (frozenset({"gpu"}), None)),
        ({}, {"pools": ["gpu"]}, (frozenset({"gpu"}), None)),
        ({"pools": ["gpu"]}, {"pools": ["gpu", "provider-a"]}, (frozenset({"gpu"}), None)),
        ({"pools": ["gpu", "provider-a"]}, {"pools": ["gpu"]}, (frozenset({"gpu"}), None)),
        ({"models": ["llama-8b-instruct"]}, {}, (None, frozenset({"llama-8b-instruct"}))),
        (
            {"models": ["llama-8b-instruct", "gpt-4o-mini"]},
            {"pools": ["gpu"]},
            (frozenset({"gpu"}), frozenset({"llama-8b-instruct"})),  # models kept to its pools
        ),
        (
            {"models": GPU_MODELS},
            {"models": ["llama-70b-instruct", "gpt-4o-mini"]},
            (None, frozenset({"llama-70b-instruct"})),
        ),
    ],
    ids=["key", "org", "key-narrows", "org-narrows", "models", "pools-cut-models", "both-models"],
)
def test_a_key_gets_the_intersection_of_its_lists_and_its_orgs(
    key: dict[str, Any], org: dict[str, Any], expected: tuple[Any, Any]
) -> None:
    assert analytics(with_access(key, org)) == expected


def test_a_key_never_widens_its_org() -> None:
    """A key listing a pool its org does not allow gets only what the org allows."""
    config = with_access({"pools": ["gpu", "provider-a"]}, {"pools": ["gpu"]})
    key = config.resolved_keys()[0]
    assert not may_use(key, "gpt-4o-mini", "provider-a")
    assert may_use(key, "llama-8b-instruct", "gpu")


def test_the_other_orgs_keys_are_untouched() -> None:
    config = with_access({"pools": ["gpu"]}, {"models": ["llama-8b-instruct"]})
    assert (config.resolved_keys()[1].pools, config.resolved_keys()[1].models) == (None, None)


# the names a hypothesis draws lists from: both pools and every model, with some unknown
POOLS = st.none() | st.lists(st.sampled_from(["gpu", "provider-a"]), unique=True)
MODELS = st.none() | st.lists(st.sampled_from(GPU_MODELS + PAID_MODELS), unique=True)


@given(org_pools=POOLS, org_models=MODELS, key_pools=POOLS, key_models=MODELS)
def test_what_a_key_may_call_is_within_both_its_own_lists_and_its_orgs(
    org_pools: list[str] | None,
    org_models: list[str] | None,
    key_pools: list[str] | None,
    key_models: list[str] | None,
) -> None:
    """Every model the effective access allows is allowed by the key's lists alone and by
    the org's alone; and every model both allow is in it (nothing lost either)."""
    pools = parse(base()).pools
    served = {m: name for name, spec in pools.items() for m in spec.models}
    org = OrgSpec(pools=org_pools, models=org_models)
    access = effective_access(org, key_pools, key_models, served)
    by_org = effective_access(org, None, None, served)
    by_key = effective_access(OrgSpec(), key_pools, key_models, served)
    callable_ = [
        {model for models in usable_models(pools, a).values() for model in models}
        for a in (access, by_org, by_key)
    ]
    assert callable_[0] == callable_[1] & callable_[2]


# --- the lists name what exists ----------------------------------------------------------


def test_an_unknown_pool_is_an_error_at_its_path_with_a_suggestion() -> None:
    data = base()
    data["keys"][1]["pools"] = ["gpu", "provider_a"]
    data["orgs"]["analytics"]["pools"] = ["gpus"]
    assert errors(data) == [
        "orgs.analytics.pools[0]: pool 'gpus' is not defined; did you mean 'gpu'?",
        "keys[1].pools[1]: pool 'provider_a' is not defined; did you mean 'provider-a'?",
    ]


def test_an_unknown_model_is_an_error_with_a_suggestion_only_when_one_is_close() -> None:
    data = base()
    data["keys"][0]["models"] = ["llama-8b-instruc", "mistral-7b"]
    assert errors(data) == [
        "keys[0].models[0]: no pool serves model 'llama-8b-instruc'; did you mean "
        "'llama-8b-instruct'?",
        "keys[0].models[1]: no pool serves model 'mistral-7b'",
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("pools", "gpu", "expected a list"),
        ("pools", ["../gpu"], "must start with a letter or digit"),
        ("models", [""], "must not be empty"),
        ("models", [7], "expected a string"),
    ],
)
def test_malformed_lists_are_refused(field: str, value: Any, message: str) -> None:
    data = base()
    data["keys"][0][field] = value
    (line,) = errors(data)
    assert line.startswith(f"keys[0].{field}")
    assert message in line


@pytest.mark.parametrize(
    ("key", "org"),
    [
        ({"pools": []}, {}),
        ({"pools": ["provider-a"]}, {"pools": ["gpu"]}),
        ({"models": ["gpt-4o-mini"]}, {"pools": ["gpu"]}),
        ({"models": ["llama-8b-instruct"]}, {"models": ["llama-70b-instruct"]}),
    ],
    ids=["empty-list", "disjoint-pools", "model-outside-pools", "models"],
)
def test_a_key_that_could_use_nothing_is_an_error(key: dict[str, Any], org: dict[str, Any]) -> None:
    data = base()
    data["keys"][0].update(key)
    data["orgs"]["analytics"].update(org)
    lines = errors(data)
    assert (
        "keys[0]: could use no model: its pools and models, within those of org 'analytics', "
        "leave none"
    ) in lines


@pytest.mark.parametrize(
    "org", [{"models": []}, {"pools": ["provider-a"], "models": ["llama-8b-instruct"]}]
)
def test_an_org_whose_own_lists_leave_nothing_is_one_error_not_one_per_key(
    org: dict[str, Any],
) -> None:
    data = base()
    data["orgs"]["analytics"].update(org)
    assert errors(data) == ["orgs.analytics: its pools and models leave no model to use"]


# --- enforcement: classify -------------------------------------------------------------


def test_classify_refuses_a_model_outside_the_keys_pools_naming_what_it_may_use() -> None:
    config = with_access({"pools": ["gpu"]})
    key = config.resolved_keys()[0]
    assert classify(config, key, None, "llama-70b-instruct").pool == "gpu"
    with pytest.raises(ApiError) as info:
        classify(config, key, None, "gpt-4o-mini")
    err = info.value
    assert (err.status, err.code, err.type) == (403, "model_not_allowed", "permission_error")
    assert err.message == (
        "This key may not use the model 'gpt-4o-mini' (pool 'provider-a'); it may use: pools 'gpu'."
    )


def test_classify_names_the_models_when_the_key_lists_models() -> None:
    config = with_access({"models": ["llama-8b-instruct"]})
    with pytest.raises(ApiError) as info:
        classify(config, config.resolved_keys()[0], None, "llama-70b-instruct")
    assert info.value.message.endswith("it may use: models 'llama-8b-instruct'.")


def test_a_key_left_with_nothing_is_refused_everything_and_told_so() -> None:
    """A key of the admin API whose org a reload narrowed away (the file's keys cannot be
    empty): every model refused, and the message does not trail off."""
    config = parse(base())
    key = dataclasses.replace(config.resolved_keys()[0], pools=frozenset(), managed=True)
    with pytest.raises(ApiError) as info:
        classify(config, key, None, "llama-8b-instruct")
    assert info.value.message.endswith("; it may use: no model.")


def test_an_unknown_model_is_still_a_404_and_a_bad_class_still_a_403_first() -> None:
    config = with_access({"pools": ["gpu"]})
    key = config.resolved_keys()[0]
    with pytest.raises(ApiError) as unknown:
        classify(config, key, None, "no-such-model")
    assert unknown.value.status == 404
    with pytest.raises(ApiError) as cls:
        classify(config, key, "interactive", "gpt-4o-mini")
    assert (cls.value.status, cls.value.code) == (403, "forbidden")  # the class, as before


# --- the orgs check ----------------------------------------------------------------------


def test_an_org_no_key_uses_is_an_error_suggesting_the_org_meant() -> None:
    data = base()
    data["orgs"] = {"analytcs": {"rpm": 600}}  # the typo of the issue: analytics runs uncapped
    assert errors(data) == ["orgs.analytcs: no key uses this org; did you mean 'analytics'?"]


def test_a_key_whose_org_is_misspelt_is_caught_from_the_orgs_side() -> None:
    data = base()
    data["keys"][0]["org"] = "analytcs"
    assert errors(data) == ["orgs.analytics: no key uses this org; did you mean 'analytcs'?"]


def test_an_unused_org_far_from_every_key_org_gets_no_guess() -> None:
    data = base()
    data["orgs"]["zzz"] = {}
    assert errors(data) == [
        "orgs.zzz: no key uses this org: give a key this org, or set keys_from_api: true if "
        "its keys are made through the admin API"
    ]


def test_an_org_with_keys_from_the_api_loads_and_check_config_warns() -> None:
    data = base()
    data["orgs"]["research"] = {"keys_from_api": True, "pools": ["gpu"]}
    data["orgs"]["analytics"]["keys_from_api"] = True  # has a key in the file too: no warning
    config = parse(data)
    assert warnings(config) == [
        "warning: orgs.research: no key in this file uses this org (keys_from_api: its keys "
        "are made through the admin API); check its name if that is not so"
    ]
    assert "  research: weight=1; no key in this file; admin API keys reach at most [gpu]" in (
        summary(config).splitlines()
    )


def test_did_you_mean_suggests_only_a_close_name() -> None:
    assert did_you_mean("prodcut", ["product", "analytics"]) == "; did you mean 'product'?"
    assert did_you_mean("x", ["product", "analytics"]) == ""
    assert did_you_mean("x", []) == ""


# --- check-config ------------------------------------------------------------------------


def test_check_config_shows_each_orgs_reach_each_restricted_key_and_only_reachable_flows() -> None:
    data = base()
    data["keys"][0].update(pools=["gpu"], name="etl")
    data["keys"].append(
        {"key": "sk-product-2", "org": "product", "classes": ["batch"], "models": ["gpt-4o-mini"]}
    )
    lines = summary(parse(data)).splitlines()
    assert (
        "  keys[0]: name=etl, org=analytics, classes=[batch] (plain), may use pools [gpu]" in lines
    )
    assert "  keys[1]: org=product, classes=[interactive, batch] (plain)" in lines
    assert "  keys[2]: org=product, classes=[batch] (plain), may use models [gpt-4o-mini]" in lines
    assert "  analytics: weight=1, rpm=600; reaches [gpu]" in lines
    assert "  product: weight=1; reaches [gpu, provider-a]" in lines
    flows = lines[lines.index("flows (org/class/pool: weight):") + 1 :]
    analytics_flows = [f.split(":")[0] for f in flows if f.startswith("  analytics/")]
    assert analytics_flows == ["  analytics/batch/gpu"]  # never analytics/batch/provider-a
