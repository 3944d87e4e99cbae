"""Tests of the configuration layer (docs/design.md §7): loading, errors, secrets, helpers."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from sfq_proxy.config import (
    ClassSpec,
    Config,
    ConfigError,
    OrgSpec,
    api_base,
    default_config,
    load_config,
    parse_config,
)
from sfq_proxy.config.summary import summary
from sfq_proxy.http.parse_worker import Models

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-SECRET-123"
EXAMPLE_ENV = {
    "ANALYTICS_KEY": "sk-analytics-prod",
    "PRODUCT_KEY": "sk-product-prod",
    "PROVIDER_A_KEY": "sk-provider",
    "SFQ_ADMIN_KEY": "admin",
}


def base() -> dict[str, Any]:
    """A small valid config as a dict; tests mutate a fresh copy."""
    return {
        "keys": [
            {"key": "sk-product", "org": "product", "classes": ["interactive", "batch"]},
            {"key_env": "ANALYTICS_KEY", "org": "analytics", "classes": ["batch"]},
        ],
        "orgs": {"product": {"weight": 2}},
        "pools": {
            "llama-8b": {
                "models": ["meta-llama/Llama-3.1-8B-Instruct"],
                "backends": [
                    {"url": "http://127.0.0.1:8001", "slots": 32},
                    {"url": "http://127.0.0.1:8002", "slots": 32},
                ],
            },
            "provider-a": {
                "models": ["gpt-4o-mini"],
                "backends": [{"url": "https://provider.example/v1", "slots": 24}],
            },
        },
    }


ENV = {"ANALYTICS_KEY": "sk-analytics"}


def parse(data: dict[str, Any], environ: dict[str, str] | None = None) -> Config:
    return parse_config(yaml.safe_dump(data), environ=ENV if environ is None else environ)


def error_lines(data: dict[str, Any], environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(data, environ)
    return str(info.value).splitlines()


def text_error_lines(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, environ={})
    return str(info.value).splitlines()


# --- the shipped configurations -------------------------------------------------------


def test_demo_config_loads() -> None:
    config = default_config()
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8080)
    assert [k.org for k in config.keys] == ["product", "analytics", "research", "ops"]
    assert config.keys[3].classes == ["system", "interactive"]
    pool = config.pools["sim"]
    assert [(b.url, b.slots, b.name) for b in pool.backends] == [
        ("http://127.0.0.1:8101", 4, "127.0.0.1:8101"),
        ("http://127.0.0.1:8102", 4, "127.0.0.1:8102"),
    ]
    assert (pool.health.interval_s, pool.health.cooldown_s) == (1, 2)
    assert (pool.cost.input_weight, pool.cost.output_weight) == (1, 2)
    assert pool.cost.default_max_tokens == 256
    assert config.pool_for_model("sim-llama") == "sim"
    assert config.org("analytics").max_in_flight == 8
    assert config.flow_weight("product", "interactive") == 12
    digests = {r.digest for r in config.resolved_keys()}
    assert hashlib.sha256(b"sk-demo-ops").digest() in digests


def test_demo_yaml_has_a_single_copy() -> None:
    assert (ROOT / "sfq_proxy" / "demo.yaml").is_file()
    assert not (ROOT / "config" / "demo.yaml").exists()


def test_example_config_loads() -> None:
    config = load_config(ROOT / "config" / "example.yaml", environ=EXAMPLE_ENV)
    assert set(config.pools) == {"llama-8b", "provider-a"}
    provider = config.pools["provider-a"]
    assert provider.upstream_key_env == "PROVIDER_A_KEY"
    assert provider.rate is not None
    assert provider.rate.requests_per_minute == 900
    assert config.pool_for_model("gpt-4o-mini") == "provider-a"
    assert (provider.health.mode, provider.health.consecutive_failures) == ("passive", 5)
    assert config.pools["llama-8b"].health.mode == "active"
    assert {k.source for k in config.keys} == {
        "from env ANALYTICS_KEY",
        "from env PRODUCT_KEY",
        "sha256",
    }
    assert config.admin_key_env == "SFQ_ADMIN_KEY"
    assert "sk-analytics-prod" not in summary(config)


def test_example_config_needs_its_environment() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "config" / "example.yaml", environ={})
    assert str(info.value).splitlines() == [
        "keys[0].key_env: environment variable ANALYTICS_KEY is not set",
        "keys[1].key_env: environment variable PRODUCT_KEY is not set",
        "pools.provider-a.upstream_key_env: environment variable PROVIDER_A_KEY is not set",
        "admin_key_env: environment variable SFQ_ADMIN_KEY is not set",
    ]
    assert info.value.source.endswith("example.yaml")


# --- defaults -------------------------------------------------------------------------


def test_defaults() -> None:
    config = parse(base())
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8080)
    assert config.limits.max_body_bytes == 10 * 1024 * 1024
    limits = config.limits  # design.md §6, Slow senders
    assert (limits.max_connections, limits.max_connections_per_peer) == (None, None)
    assert (limits.header_timeout_s, limits.body_timeout_s) == (10, 30)
    assert (limits.body_grace_s, limits.min_body_kib_per_s) == (5, 32)
    assert (limits.max_messages, limits.max_content_parts, limits.max_tools) == (2000, 10_000, 512)
    assert limits.parse_in_loop_bytes == 16 * 1024
    assert config.drain_timeout_s == 30
    assert config.classes == {
        "system": ClassSpec(priority=True, max_in_flight=4, max_queue_age_s=5, max_queue_len=100),
        "interactive": ClassSpec(weight=6, max_queue_age_s=45, max_queue_len=1000),
        "batch": ClassSpec(weight=1, max_queue_age_s=7200, max_queue_len=100000),
    }
    pool = config.pools["llama-8b"]
    assert pool.cost.default_max_tokens == 512
    assert pool.cost.output_ratio == 1
    assert pool.health.path == "/health"
    assert (pool.timeouts.connect_s, pool.timeouts.first_byte_s) == (5, 300)
    assert (pool.timeouts.client_write_s, config.limits.answer_buffer_mb) == (30, 32)
    assert config.limits.answer_buffer_bytes == 32 << 20
    assert (config.retry.max_attempts, config.retry.budget_ratio) == (3, 0.1)
    assert config.calibration.state_file is None
    assert config.metrics.max_labelled_orgs == 200
    assert config.admin_key_env is None
    assert (config.metrics_key_env, config.metrics_digest()) == (None, None)


def test_classes_section_replaces_defaults() -> None:
    data = base()
    data["classes"] = {"interactive": {"weight": 3}, "batch": {}}
    config = parse(data)
    assert set(config.classes) == {"interactive", "batch"}
    assert config.flow_weight("product", "interactive") == 6


def test_null_section_means_defaults() -> None:
    data = base()
    del data["orgs"]
    config = parse_config(yaml.safe_dump(data) + "orgs:\nclasses:\n", environ=ENV)
    assert config.orgs == {}
    assert set(config.classes) == {"system", "interactive", "batch"}


def test_org_flow_weight_and_pool_lookup() -> None:
    config = parse(base())
    assert config.org("product").weight == 2
    assert config.org("nobody") == OrgSpec(weight=1)
    assert config.org("nobody").max_in_flight is None
    assert config.flow_weight("product", "interactive") == 12
    assert config.flow_weight("nobody", "batch") == 1
    assert config.pool_for_model("meta-llama/Llama-3.1-8B-Instruct") == "llama-8b"
    assert config.pool_for_model("gpt-4o-mini") == "provider-a"
    assert config.pool_for_model("unknown") is None


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://10.0.0.11:8000", "http://10.0.0.11:8000"),
        ("https://api.openai.com/v1", "https://api.openai.com"),
        ("https://gw.example/openai/v1", "https://gw.example/openai"),
        ("https://gw.example/openai", "https://gw.example/openai"),
        ("https://gw.example/v1beta", "https://gw.example/v1beta"),
        ("http://v1", "http://v1"),  # a host named v1 is not a path
        ("http://v1:8000", "http://v1:8000"),
    ],
)
def test_api_base_is_the_url_without_a_trailing_v1(url: str, base: str) -> None:
    assert api_base(url) == base


def test_backend_url_normalised_and_named() -> None:
    data = base()
    data["pools"]["llama-8b"]["backends"] = [
        {"url": "http://10.0.0.1:8000/", "slots": 1},
        {"url": "https://api.example/v1/", "slots": 1},
        {"url": "http://[::1]:9000", "slots": 1, "name": "local"},
        {"url": "http://gpu-a", "slots": 1},
    ]
    backends = parse(data).pools["llama-8b"].backends
    assert [b.url for b in backends] == [
        "http://10.0.0.1:8000",
        "https://api.example/v1",
        "http://[::1]:9000",
        "http://gpu-a",
    ]
    assert [b.name for b in backends] == ["10.0.0.1:8000", "api.example:443", "local", "gpu-a:80"]


def test_sha256_is_normalised_to_lowercase() -> None:
    data = base()
    digest = hashlib.sha256(b"sk-ops").hexdigest()
    data["keys"].append({"key_sha256": digest.upper(), "org": "ops", "classes": ["system"]})
    assert parse(data).keys[2].key_sha256 == digest


def test_config_is_frozen() -> None:
    config = parse(base())
    with pytest.raises(ValidationError):
        config.listen = config.listen  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.pools["llama-8b"].backends[0].slots = 1  # type: ignore[misc]


# --- keys and secrets -----------------------------------------------------------------


def test_resolved_keys_digests_for_all_three_forms() -> None:
    data = base()
    data["keys"] = [
        {"key": "sk-plain", "org": "a", "classes": ["batch"]},
        {"key_env": "ENV_KEY", "org": "b", "classes": ["interactive", "batch"]},
        {"key_sha256": hashlib.sha256(b"sk-hashed").hexdigest(), "org": "c", "classes": ["system"]},
    ]
    del data["orgs"]  # its org "product" has no key here
    resolved = parse(data, environ={"ENV_KEY": "sk-from-env\n"}).resolved_keys()
    assert [(r.index, r.org, r.classes) for r in resolved] == [
        (0, "a", ("batch",)),
        (1, "b", ("interactive", "batch")),
        (2, "c", ("system",)),
    ]
    assert [r.digest for r in resolved] == [
        hashlib.sha256(b"sk-plain").digest(),
        hashlib.sha256(b"sk-from-env").digest(),  # trailing newline of a mounted file dropped
        hashlib.sha256(b"sk-hashed").digest(),
    ]


def test_environment_is_read_at_load_time_only() -> None:
    environ = {"ANALYTICS_KEY": "sk-first"}
    config = parse(base(), environ=environ)
    environ["ANALYTICS_KEY"] = "sk-second"
    assert config.resolved_keys()[1].digest == hashlib.sha256(b"sk-first").digest()


def test_secrets_never_shown() -> None:
    data = base()
    data["keys"][0]["key"] = SECRET
    data["keys"][1]["key_env"] = "SECRET_ENV"
    config = parse(data, environ={"SECRET_ENV": SECRET + "-env"})
    shown = [repr(config), str(config), summary(config), config.model_dump_json()]
    shown += [repr(config.model_dump()), repr(config.resolved_keys())]
    for text in shown:
        assert SECRET not in text
    assert "keys[0]: org=product, classes=[interactive, batch] (plain)" in summary(config)
    assert "keys[1]: org=analytics, classes=[batch] (from env SECRET_ENV)" in summary(config)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["keys"][0].update(key_env="X"),  # two sources
        lambda d: d["keys"][0].update(key_sha256=SECRET),  # a key pasted as a digest
        lambda d: d["keys"][0].update(org=""),  # another error in the same entry
        lambda d: d["keys"].append({"key": SECRET, "org": "x", "classes": ["batch"]}),  # dup
        lambda d: d["keys"][0].update(classes=["gold"]),
        lambda d: d["keys"][0].update(extra=SECRET),
        lambda d: d["keys"][0].update(key=[SECRET]),
        lambda d: d["pools"]["llama-8b"]["backends"][0].update(url=f"http://u:{SECRET}@h"),
        lambda d: d["pools"]["llama-8b"]["backends"][0].update(url=f"ftp://{SECRET}"),
    ],
)
def test_secrets_never_in_errors(mutate: Callable[[dict[str, Any]], None]) -> None:
    data = base()
    data["keys"][0]["key"] = SECRET
    mutate(data)
    assert SECRET not in "\n".join(error_lines(data))


def test_secret_not_in_yaml_syntax_error() -> None:
    lines = text_error_lines(f'keys:\n  - {{key: "{SECRET}, org: a}}\n')
    assert len(lines) == 1
    assert lines[0].startswith("line ")
    assert SECRET not in lines[0]


# --- errors: exact path and message ---------------------------------------------------

Mutation = Callable[[dict[str, Any]], object]


def _locate(data: dict[str, Any], path: str) -> tuple[Any, Any]:
    """The container holding dotted ``path`` (integers index lists), and the last key."""
    *parents, last = (int(p) if p.isdigit() else p for p in path.split("."))
    node: Any = data
    for part in parents:
        node = node[part]
    return node, last


def _set(path: str, value: Any) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        node, last = _locate(data, path)
        node[last] = value

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(data: dict[str, Any]) -> None:
        node, last = _locate(data, path)
        del node[last]

    return mutate


ERROR_CASES: list[tuple[str, Mutation, str]] = [
    # non-positive and out-of-range numbers
    (
        "slots 0",
        _set("pools.llama-8b.backends.1.slots", 0),
        "pools.llama-8b.backends[1].slots: must be > 0",
    ),
    (
        "slots -3",
        _set("pools.llama-8b.backends.0.slots", -3),
        "pools.llama-8b.backends[0].slots: must be > 0",
    ),
    ("org weight 0", _set("orgs.product.weight", 0), "orgs.product.weight: must be >= 0.001"),
    ("org weight < 0", _set("orgs.product.weight", -1.5), "orgs.product.weight: must be >= 0.001"),
    (
        "class weight 0",
        _set("classes", {"batch": {"weight": 0}}),
        "classes.batch.weight: must be >= 0.001",
    ),
    ("org weight huge", _set("orgs.product.weight", 1e6), "orgs.product.weight: must be <= 1000"),
    (
        "cost weight huge",
        _set("pools.llama-8b.cost", {"input_weight": 1e300}),
        "pools.llama-8b.cost.input_weight: must be <= 1000",
    ),
    (
        "chars per token tiny",
        _set("pools.llama-8b.cost", {"chars_per_token": 1e-300}),
        "pools.llama-8b.cost.chars_per_token: must be >= 0.1",
    ),
    (
        "default max tokens huge",
        _set("pools.llama-8b.cost", {"default_max_tokens": 10**12}),
        "pools.llama-8b.cost.default_max_tokens: must be <= 10000000",
    ),
    (
        "timeout of 10^308 s",
        _set("pools.llama-8b.timeouts", {"idle_s": 1e308}),
        "pools.llama-8b.timeouts.idle_s: must be <= 31536000",
    ),
    (
        "body limit above 1 GiB",
        _set("limits", {"max_body_bytes": 1 << 40}),
        "limits.max_body_bytes: must be <= 1073741824",
    ),
    ("no messages", _set("limits", {"max_messages": 0}), "limits.max_messages: must be > 0"),
    (
        "content parts cap huge",
        _set("limits", {"max_content_parts": 10**7}),
        "limits.max_content_parts: must be <= 1000000",
    ),
    ("tools cap -1", _set("limits", {"max_tools": -1}), "limits.max_tools: must be > 0"),
    (
        "no time for a head",
        _set("limits", {"header_timeout_s": 0}),
        "limits.header_timeout_s: must be > 0",
    ),
    (
        "no connection for a peer",
        _set("limits", {"max_connections_per_peer": 0}),
        "limits.max_connections_per_peer: must be > 0",
    ),
    (
        "a body's pace below 0",
        _set("limits", {"min_body_kib_per_s": -1}),
        "limits.min_body_kib_per_s: must be >= 0",
    ),
    (
        "in-loop bytes < 0",
        _set("limits", {"parse_in_loop_bytes": -1}),
        "limits.parse_in_loop_bytes: must be >= 0",
    ),
    (
        "no answer buffer",
        _set("limits", {"answer_buffer_mb": 0}),
        "limits.answer_buffer_mb: must be >= 1",
    ),
    (
        "a client write timeout of 0",
        _set("pools.llama-8b.timeouts", {"client_write_s": 0}),
        "pools.llama-8b.timeouts.client_write_s: must be > 0",
    ),
    (
        "infinite weight",
        _set("orgs.product.weight", float("inf")),
        "orgs.product.weight: must be a finite number",
    ),
    (
        "output_ratio > 1",
        _set("pools.llama-8b.cost", {"output_ratio": 1.5}),
        "pools.llama-8b.cost.output_ratio: must be <= 1",
    ),
    (
        "cooldown < 0",
        _set("pools.llama-8b.health", {"cooldown_s": -1}),
        "pools.llama-8b.health.cooldown_s: must be >= 0",
    ),
    ("max_attempts 0", _set("retry", {"max_attempts": 0}), "retry.max_attempts: must be >= 1"),
    ("budget > 1", _set("retry", {"budget_ratio": 2}), "retry.budget_ratio: must be <= 1"),
    ("port too big", _set("listen", {"port": 70000}), "listen.port: must be <= 65535"),
    ("rpm 0", _set("orgs.product.rpm", 0), "orgs.product.rpm: must be > 0"),
    (
        "max_in_flight 0",
        _set("orgs.product.max_in_flight", 0),
        "orgs.product.max_in_flight: must be > 0",
    ),
    (
        "rate 0",
        _set("pools.provider-a.rate", {"tokens_per_minute": 0}),
        "pools.provider-a.rate.tokens_per_minute: must be > 0",
    ),
    (
        "both cost weights 0",
        _set("pools.llama-8b.cost", {"input_weight": 0, "output_weight": 0}),
        "pools.llama-8b.cost: input_weight and output_weight cannot both be 0",
    ),
    # unknown keys at several depths
    ("unknown top", _set("listne", {}), "listne: unknown field"),
    ("unknown in pool", _set("pools.llama-8b.model", "x"), "pools.llama-8b.model: unknown field"),
    (
        "unknown in backend",
        _set("pools.llama-8b.backends.1.weight", 2),
        "pools.llama-8b.backends[1].weight: unknown field",
    ),
    (
        "unknown in cost",
        _set("pools.llama-8b.cost", {"max_tokens": 5}),
        "pools.llama-8b.cost.max_tokens: unknown field",
    ),
    ("unknown in key", _set("keys.0.team", "x"), "keys[0].team: unknown field"),
    (
        "unknown in class",
        _set("classes", {"batch": {"prio": True}}),
        "classes.batch.prio: unknown field",
    ),
    # wrong types
    (
        "slots as string",
        _set("pools.llama-8b.backends.0.slots", "32"),
        "pools.llama-8b.backends[0].slots: expected an integer, or auto",
    ),
    (
        "slots fractional",
        _set("pools.llama-8b.backends.0.slots", 2.5),
        "pools.llama-8b.backends[0].slots: expected an integer, or auto",
    ),
    (
        "weight as string",
        _set("orgs.product.weight", "heavy"),
        "orgs.product.weight: expected a number",
    ),
    (
        "priority as string",
        _set("classes", {"batch": {"priority": "yes"}}),
        "classes.batch.priority: expected true or false",
    ),
    (
        "models not a list",
        _set("pools.llama-8b.models", "m"),
        "pools.llama-8b.models: expected a list",
    ),
    ("listen not a mapping", _set("listen", [1]), "listen: expected a mapping"),
    ("orgs not a mapping", _set("orgs", ["product"]), "orgs: expected a mapping"),
    ("org not a string", _set("keys.0.org", 7), "keys[0].org: expected a string"),
    # required and non-empty
    ("no keys", _delete("keys"), "keys: required"),
    ("empty keys", _set("keys", []), "keys: must not be empty"),
    ("no pools", _set("pools", {}), "pools: must not be empty"),
    ("key without org", _delete("keys.0.org"), "keys[0].org: required"),
    ("key without classes", _set("keys.0.classes", []), "keys[0].classes: must not be empty"),
    (
        "pool without models",
        _set("pools.llama-8b.models", []),
        "pools.llama-8b.models: must not be empty",
    ),
    (
        "pool without backends",
        _delete("pools.llama-8b.backends"),
        "pools.llama-8b.backends: required",
    ),
    (
        "backend without slots",
        _delete("pools.llama-8b.backends.0.slots"),
        "pools.llama-8b.backends[0].slots: required",
    ),
    (
        "bad pool name",
        _set("pools.bad name", {"models": ["x"], "backends": [{"url": "http://h", "slots": 1}]}),
        "pools.bad name: invalid name: must start with a letter or digit"
        " and use only letters, digits, '_', '.', '-'",
    ),
    # key sources
    (
        "two sources",
        _set("keys.0.key_env", "X"),
        "keys[0]: needs exactly one of key_env, key, key_sha256 (found key_env, key)",
    ),
    ("no source", _delete("keys.0.key"), "keys[0]: needs exactly one of key_env, key, key_sha256"),
    (
        "bad hex",
        _set("keys.1", {"key_sha256": "ab" * 31 + "zz", "org": "a", "classes": ["batch"]}),
        "keys[1].key_sha256: must be 64 hexadecimal digits (a SHA-256 digest)",
    ),
    (
        "short hex",
        _set("keys.1", {"key_sha256": "ab", "org": "a", "classes": ["batch"]}),
        "keys[1].key_sha256: must be 64 hexadecimal digits (a SHA-256 digest)",
    ),
    ("empty plain key", _set("keys.0.key", ""), "keys[0].key: must not be empty"),
    # URLs and health
    (
        "ftp url",
        _set("pools.llama-8b.backends.0.url", "ftp://h"),
        "pools.llama-8b.backends[0].url: must be an http:// or https:// URL with a host",
    ),
    (
        "url without scheme",
        _set("pools.llama-8b.backends.0.url", "127.0.0.1:8001"),
        "pools.llama-8b.backends[0].url: must be an http:// or https:// URL with a host",
    ),
    (
        "url without host",
        _set("pools.llama-8b.backends.0.url", "http://"),
        "pools.llama-8b.backends[0].url: must be an http:// or https:// URL with a host",
    ),
    (
        "url bad port",
        _set("pools.llama-8b.backends.0.url", "http://h:99999"),
        "pools.llama-8b.backends[0].url: must be a valid http:// or https:// URL",
    ),
    (
        "url credentials",
        _set("pools.llama-8b.backends.0.url", "http://u:p@h"),
        "pools.llama-8b.backends[0].url: must not contain credentials; use upstream_key_env",
    ),
    (
        "relative health path",
        _set("pools.llama-8b.health", {"path": "health"}),
        "pools.llama-8b.health.path: must start with '/'",
    ),
    # cross-field checks
    (
        "same url twice",
        _set("pools.llama-8b.backends.1.url", "http://127.0.0.1:8001/"),
        "pools.llama-8b.backends[1].url: same url as backends[0]",
    ),
    (
        "same server with and without /v1",
        _set(
            "pools.llama-8b.backends.1",
            {"url": "http://127.0.0.1:8001/v1", "slots": 1, "name": "other"},
        ),
        "pools.llama-8b.backends[1].url: same url as backends[0]",
    ),
    (
        "same name twice",
        _set("pools.llama-8b.backends.1.name", "127.0.0.1:8001"),
        "pools.llama-8b.backends[1].name: same name as backends[0]",
    ),
    (
        "model in two pools",
        _set("pools.provider-a.models", ["x", "meta-llama/Llama-3.1-8B-Instruct"]),
        "pools.provider-a.models[1]: model 'meta-llama/Llama-3.1-8B-Instruct'"
        " is already served by pool 'llama-8b'",
    ),
    (
        "undefined class",
        _set("keys.0.classes", ["interactive", "gold"]),
        "keys[0].classes[1]: class 'gold' is not defined",
    ),
    (
        "class dropped by classes:",
        _set("classes", {"batch": {}}),
        "keys[0].classes[0]: class 'interactive' is not defined",
    ),
    (
        "unset key_env",
        _set("keys.1.key_env", "MISSING_KEY"),
        "keys[1].key_env: environment variable MISSING_KEY is not set",
    ),
    (
        "duplicate plain keys",
        _set("keys.1", {"key": "sk-product", "org": "x", "classes": ["batch"]}),
        "keys[1]: duplicates the key of keys[0]",
    ),
    (
        "plain duplicates env",
        _set("keys.0.key", "sk-analytics"),
        "keys[1]: duplicates the key of keys[0]",
    ),
    (
        "digest duplicates plain",
        _set(
            "keys.1",
            {
                "key_sha256": hashlib.sha256(b"sk-product").hexdigest().upper(),
                "org": "x",
                "classes": ["batch"],
            },
        ),
        "keys[1]: duplicates the key of keys[0]",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [pytest.param(m, e, id=name) for name, m, e in ERROR_CASES],
)
def test_error_path_and_message(mutate: Mutation, expected: str) -> None:
    data = base()
    mutate(data)
    assert error_lines(data) == [expected]


def test_empty_key_env_value() -> None:
    assert error_lines(base(), environ={"ANALYTICS_KEY": " \n"}) == [
        "keys[1].key_env: environment variable ANALYTICS_KEY is empty"
    ]


def test_the_metrics_key_comes_from_the_environment_as_the_admin_key_does() -> None:
    data = {**base(), "metrics_key_env": "SFQ_METRICS_KEY"}
    config = parse(data, environ={**ENV, "SFQ_METRICS_KEY": " sk-scraper\n"})
    assert config.metrics_digest() == hashlib.sha256(b"sk-scraper").digest()
    assert "sk-scraper" not in repr(config)
    assert error_lines(data) == ["metrics_key_env: environment variable SFQ_METRICS_KEY is not set"]
    assert error_lines(data, environ={**ENV, "SFQ_METRICS_KEY": ""}) == [
        "metrics_key_env: environment variable SFQ_METRICS_KEY is empty"
    ]


def test_several_errors_reported_together() -> None:
    data = base()
    data["pools"]["llama-8b"]["backends"][0]["slots"] = 0
    data["orgs"]["product"]["weight"] = 0
    data["keys"][0]["colour"] = "red"
    lines = error_lines(data)
    assert sorted(lines) == [
        "keys[0].colour: unknown field",
        "orgs.product.weight: must be >= 0.001",
        "pools.llama-8b.backends[0].slots: must be > 0",
    ]


def test_cross_field_errors_reported_together() -> None:
    data = base()
    data["keys"][0]["classes"] = ["gold"]
    data["pools"]["provider-a"]["models"] = ["gpt-4o-mini", "meta-llama/Llama-3.1-8B-Instruct"]
    assert error_lines(data, environ={}) == [
        "pools.provider-a.models[1]: model 'meta-llama/Llama-3.1-8B-Instruct' is already "
        "served by pool 'llama-8b'",
        "keys[0].classes[0]: class 'gold' is not defined",
        "keys[1].key_env: environment variable ANALYTICS_KEY is not set",
    ]


def test_error_list_is_structured() -> None:
    data = base()
    data["pools"]["llama-8b"]["backends"][1]["slots"] = 0
    with pytest.raises(ConfigError) as info:
        parse(data)
    assert info.value.errors == [("pools.llama-8b.backends[1].slots", "must be > 0")]
    assert info.value.source == "<string>"


# --- the priority band must leave every pool a slot for the fair queue ----------------

SYSTEM = {"priority": True, "max_in_flight": 4, "max_queue_age_s": 5, "max_queue_len": 100}


def with_band(slots: int = 24, **classes: dict[str, Any]) -> dict[str, Any]:
    """base() plus an ops key granting ``system`` and ``classes`` (their specs; the default
    classes when none), with ``slots`` slots in pool provider-a (llama-8b has 64)."""
    data = base()
    if classes:
        data["classes"] = {**classes, "interactive": {"weight": 6}, "batch": {}}
    grants = [*classes, "interactive"] if classes else ["system", "interactive"]
    data["keys"].append({"key": "sk-ops", "org": "ops", "classes": grants})
    data["pools"]["provider-a"]["backends"][0]["slots"] = slots
    return data


@pytest.mark.parametrize(
    ("field", "why"),
    [
        (
            "max_in_flight",
            "an uncapped band can take every slot of a pool and starve the fair queue",
        ),
        (
            "max_queue_age_s",
            "band requests that never expire, always served first, let the band hold the pool",
        ),
        (
            "max_queue_len",
            "an unbounded band queue, always served first, lets the band hold the pool",
        ),
    ],
)
def test_a_priority_class_needs_a_cap_an_age_and_a_length(field: str, why: str) -> None:
    spec = {k: v for k, v in SYSTEM.items() if k != field}
    assert error_lines(with_band(system=spec)) == [
        f"classes.system.{field}: a priority class needs {field}: {why}"
    ]


def test_a_bare_priority_class_gets_all_three_errors() -> None:
    assert [line.split(":")[0] for line in error_lines(with_band(system={"priority": True}))] == [
        "classes.system.max_in_flight",
        "classes.system.max_queue_age_s",
        "classes.system.max_queue_len",
    ]


@pytest.mark.parametrize("slots", [4, 3, 1])
def test_a_band_that_could_fill_the_smallest_pool_is_refused(slots: int) -> None:
    # the case: the default system class (max_in_flight 4) granted, a pool of 4 slots
    assert error_lines(with_band(slots=slots)) == [
        "classes.system.max_in_flight: the priority band's max_in_flight total 4 (system 4) "
        f"leaves no slot of pool 'provider-a' ({slots} slots) to the fair queue; it must be "
        "below every pool's slots"
    ]


def test_a_pool_slot_count_is_the_sum_of_its_backends() -> None:
    data = with_band(slots=2)
    data["pools"]["provider-a"]["backends"].append({"url": "http://10.0.0.9:8000", "slots": 3})
    assert parse(data).pools["provider-a"].backends[1].slots == 3  # 2 + 3 > 4: accepted


def test_two_priority_classes_whose_caps_sum_to_the_slots_are_refused() -> None:
    alert = {**SYSTEM, "max_in_flight": 2}
    system = {**SYSTEM, "max_in_flight": 2}
    message = (
        "the priority band's max_in_flight total 4 (alert 2 + system 2) leaves no slot of pool "
        "'provider-a' (4 slots) to the fair queue; it must be below every pool's slots"
    )
    assert error_lines(with_band(slots=4, system=system, alert=alert)) == [
        f"classes.alert.max_in_flight: {message}",  # in file order (safe_dump sorts them)
        f"classes.system.max_in_flight: {message}",
    ]
    parse(with_band(slots=5, system=system, alert=alert))  # one slot left: accepted


def test_the_default_classes_pass_when_system_is_granted() -> None:
    config = parse(with_band(slots=5))
    assert config.classes["system"] == ClassSpec(**SYSTEM)
    assert default_config().classes["system"].max_queue_len == 100


def test_a_priority_class_no_key_grants_is_not_checked() -> None:
    data = base()  # no key grants system
    data["classes"] = {"system": {"priority": True}, "interactive": {}, "batch": {}}
    data["pools"]["provider-a"]["backends"][0]["slots"] = 1
    shown = summary(parse(data))
    assert "  system: priority (no key grants it)\n" in shown
    assert "    system:" not in shown  # no share: it can never run
    data["keys"][0]["classes"].append("system")
    assert len(error_lines(data)) == 3


def test_summary_shows_each_class_worst_case_share_of_each_pool() -> None:
    data = with_band(slots=24, system=SYSTEM)
    data["classes"]["batch"] = {"max_in_flight": 2}
    lines = summary(parse(data)).splitlines()
    at = lines.index("  worst-case shares of 64 slots (all classes backlogged, equal org weights):")
    assert lines[at + 1 : at + 4] == [
        "    batch: at least 3.1% (held by its max_in_flight=2)",
        "    interactive: at least 80.3% (85.7% of the rest)",
        "    system: up to 6.3% (priority, max_in_flight=4)",
    ]
    at = lines.index("  worst-case shares of 24 slots (all classes backlogged, equal org weights):")
    assert lines[at + 1 : at + 4] == [
        "    batch: at least 8.3% (held by its max_in_flight=2)",
        "    interactive: at least 71.4% (85.7% of the rest)",
        "    system: up to 16.7% (priority, max_in_flight=4)",
    ]


def test_summary_shares_without_a_band_are_shares_of_the_whole_pool() -> None:
    lines = summary(parse(base())).splitlines()  # default classes; no key grants system
    at = lines.index("  worst-case shares of 24 slots (all classes backlogged, equal org weights):")
    assert lines[at + 1 : at + 3] == [
        "    interactive: at least 85.7%",
        "    batch: at least 14.2%",
    ]


# --- YAML-level errors ----------------------------------------------------------------


def test_yaml_syntax_error_names_the_line() -> None:
    text = "listen: {host: 127.0.0.1, port: 8080}\nkeys:\n  - key: a org: b\n"
    assert text_error_lines(text) == ["line 3: mapping values are not allowed here"]


def test_yaml_duplicate_key_is_an_error() -> None:
    text = "pools: {}\nlisten: {}\npools: {}\n"
    assert text_error_lines(text) == ["line 3: duplicate key 'pools'"]


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n", "---\n"])
def test_empty_file(text: str) -> None:
    assert text_error_lines(text) == ["the configuration is empty"]


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(text: str) -> None:
    assert text_error_lines(text) == ["the top level must be a mapping of sections"]


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert str(info.value).startswith(f"cannot read {tmp_path / 'nope.yaml'}: ")


def test_load_config_reads_file(tmp_path: Path) -> None:
    path = tmp_path / "sfq.yaml"
    path.write_text(yaml.safe_dump(base()), encoding="utf-8")
    assert load_config(path, environ=ENV).pool_for_model("gpt-4o-mini") == "provider-a"


# --- property tests -------------------------------------------------------------------

positive = st.floats(min_value=0.001, max_value=1000, allow_nan=False)
non_positive = st.floats(max_value=0, allow_nan=False, allow_infinity=False)


@given(slots=st.integers(1, 10_000), org_weight=positive, class_weight=positive)
def test_positive_values_load(slots: int, org_weight: float, class_weight: float) -> None:
    data = copy.deepcopy(base())
    data["pools"]["llama-8b"]["backends"][1]["slots"] = slots
    data["orgs"]["product"]["weight"] = org_weight
    data["classes"] = {"interactive": {"weight": class_weight}, "batch": {}}
    config = parse(data)
    assert config.pools["llama-8b"].backends[1].slots == slots
    assert config.flow_weight("product", "interactive") == pytest.approx(org_weight * class_weight)


@given(
    field=st.sampled_from(["slots", "org weight", "class weight"]),
    int_value=st.integers(max_value=0),
    float_value=non_positive,
)
def test_non_positive_values_fail(field: str, int_value: int, float_value: float) -> None:
    data = copy.deepcopy(base())
    if field == "slots":
        data["pools"]["llama-8b"]["backends"][1]["slots"] = int_value
        expected = "pools.llama-8b.backends[1].slots: must be > 0"
    elif field == "org weight":
        data["orgs"]["product"]["weight"] = float_value
        expected = "orgs.product.weight: must be >= 0.001"
    else:
        data["classes"] = {"interactive": {"weight": float_value}, "batch": {}}
        expected = "classes.interactive.weight: must be >= 0.001"
    with pytest.raises(ConfigError) as info:
        parse(data)
    assert str(info.value).splitlines() == [expected]


# --- health per pool: active probes or passive only -------------------------------------


def _keyed(data: dict[str, Any], health: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base()``'s provider pool with an upstream key, and ``health`` if given."""
    data["pools"]["provider-a"]["upstream_key_env"] = "PROVIDER_KEY"
    if health is not None:
        data["pools"]["provider-a"]["health"] = health
    return data


KEYED_ENV = {**ENV, "PROVIDER_KEY": "sk-provider"}


def test_health_is_active_without_an_upstream_key_and_passive_with_one() -> None:
    config = parse(_keyed(base()), KEYED_ENV)
    local, provider = config.pools["llama-8b"].health, config.pools["provider-a"].health
    assert (local.mode, local.consecutive_failures, local.method, local.send_key) == (
        "active", 1, "GET", True,
    )  # fmt: skip
    assert (provider.mode, provider.consecutive_failures) == ("passive", 5)
    assert provider.cooldown_s == 10


def test_health_mode_and_streak_can_be_set() -> None:
    probe = {"mode": "active", "path": "/v1/models", "method": "HEAD", "send_key": False}
    data = _keyed(base(), probe)
    data["pools"]["llama-8b"]["health"] = {"mode": "passive", "consecutive_failures": 2}
    config = parse(data, KEYED_ENV)
    provider = config.pools["provider-a"].health
    assert (provider.mode, provider.path, provider.method, provider.send_key) == (
        "active", "/v1/models", "HEAD", False,
    )  # fmt: skip
    assert provider.consecutive_failures == 1
    local = config.pools["llama-8b"].health
    assert (local.mode, local.consecutive_failures) == ("passive", 2)


@pytest.mark.parametrize("field", ["path", "method", "send_key"])
def test_a_probe_setting_on_a_passive_pool_is_an_error(field: str) -> None:
    value = {"path": "/health", "method": "GET", "send_key": True}[field]
    assert error_lines(_keyed(base(), {field: value}), KEYED_ENV) == [
        f"pools.provider-a.health: {field} is for active probes; set mode: active to probe "
        "(a pool with upstream_key_env or family openai is passive by default)"
    ]
    data = base()
    data["pools"]["llama-8b"]["health"] = {"mode": "passive", field: value}
    assert len(error_lines(data)) == 1


@pytest.mark.parametrize(
    ("health", "error"),
    [
        ({"mode": "auto"}, "pools.llama-8b.health.mode: Input should be 'active' or 'passive'"),
        ({"method": "POST"}, "pools.llama-8b.health.method: Input should be 'GET' or 'HEAD'"),
        ({"consecutive_failures": 0}, "pools.llama-8b.health.consecutive_failures: must be > 0"),
        ({"send_key": "yes"}, "pools.llama-8b.health.send_key: expected true or false"),
    ],
)
def test_bad_health_settings(health: dict[str, Any], error: str) -> None:
    data = base()
    data["pools"]["llama-8b"]["health"] = health
    assert error_lines(data) == [error]


def test_summary_shows_each_pool_health() -> None:
    data = _keyed(base())
    data["pools"]["llama-8b"]["health"] = {"method": "HEAD", "consecutive_failures": 3}
    shown = summary(parse(data, KEYED_ENV))
    assert (
        "  health: active, HEAD /health every 5 s (timeout 2 s); out for 10 s after 3 failures "
        "in a row, back at the next good probe\n"
    ) in shown
    assert (
        "  health: passive, no probe; out for 10 s after 5 failures in a row (connect errors, "
        "5xx, timeouts), then trusted again\n"
    ) in shown
    probed = _keyed(base(), {"mode": "active", "path": "/v1/models"})
    assert (
        "  health: active, GET /v1/models every 5 s (timeout 2 s, with the upstream key); "
        "out for 10 s after 1 failure, back at the next good probe\n"
    ) in summary(parse(probed, KEYED_ENV))


def test_a_llamacpp_pool_is_probed_where_its_server_answers_without_its_lock() -> None:
    data = base()
    one = [{"url": "http://a:1", "slots": 1}]
    data["pools"]["llama-8b"].update(family="llamacpp", backends=one)
    pool = parse(data).pools["llama-8b"]
    assert (pool.health.mode, pool.health.path, pool.stream_usage) == (
        "active", "/openapi.json", False,
    )  # fmt: skip
    data["pools"]["llama-8b"]["health"] = {"path": "/v1/models"}  # the operator's own wins
    assert parse(data).pools["llama-8b"].health.path == "/v1/models"


def test_a_llamacpp_backend_with_a_second_slot_is_an_error_at_its_path() -> None:
    data = base()
    two = [{"url": "http://a:1", "slots": 1}, {"url": "http://b:1", "slots": 2}]
    data["pools"]["llama-8b"].update(family="llamacpp", backends=two)
    assert error_lines(data) == [
        "pools.llama-8b.backends[1].slots: a llamacpp server serves one request at a time "
        "(a second one ends the running stream): must be 1"
    ]


@pytest.mark.parametrize("family", ["vllm", "tgi", "openai"])
def test_other_families_keep_health_on_health_and_ask_streams_for_usage(family: str) -> None:
    data = base()
    data["pools"]["llama-8b"]["family"] = family
    pool = parse(data).pools["llama-8b"]
    mode = "passive" if family == "openai" else "active"
    assert (pool.health.mode, pool.health.path, pool.stream_usage) == (mode, "/health", True)


def test_an_unknown_family_is_an_error() -> None:
    data = base()
    data["pools"]["llama-8b"]["family"] = "sglang"
    (line,) = error_lines(data)
    assert line.startswith("pools.llama-8b.family: ")


def test_state_is_memory_unless_redis_is_given() -> None:
    assert parse(base()).state is None  # memory
    assert parse(base()).redis_url() is None
    data = base()
    data["state"] = {"redis": "redis://r:6379/0"}
    config = parse(data)
    assert config.redis_url() == "redis://r:6379/0"
    assert config.state is not None
    assert (config.state.lease_ttl_s, config.state.cluster) == (5.0, False)
    assert config.state.when_unreachable == "fail_closed"  # never exceeds a slot


def test_a_sentinel_password_comes_from_the_environment() -> None:
    data = base()
    data["state"] = {"sentinel": {"hosts": ["10.0.0.5:26379"], "service": "m", "password_env": "P"}}
    config = parse(data, {**ENV, "P": "s3cret"})
    assert (config.redis_url(), config.redis_password()) == (None, "s3cret")
    assert "s3cret" not in repr(config.state)
    assert error_lines(data) == ["state.sentinel.password_env: environment variable P is not set"]


def test_a_redis_url_with_a_password_comes_from_the_environment() -> None:
    data = base()
    data["state"] = {"redis_env": "SFQ_REDIS_URL"}
    config = parse(data, {**ENV, "SFQ_REDIS_URL": "redis://:secret@r:6379/0"})
    assert config.redis_url() == "redis://:secret@r:6379/0"
    assert "secret" not in repr(config.state)
    assert error_lines(data) == ["state.redis_env: environment variable SFQ_REDIS_URL is not set"]


ONE_URL = "state: set exactly one of redis (a URL), redis_env or sentinel"


@pytest.mark.parametrize(
    ("state", "line"),
    [
        ({}, ONE_URL),
        ({"redis": "redis://r", "redis_env": "X"}, ONE_URL),
        ({"redis": "redis://r", "lease_ttl_s": 0.1}, "state.lease_ttl_s: must be >= 0.5"),
        ("disk", "state: must be memory, or a mapping with redis, redis_env or sentinel"),
        (
            {"sentinel": {"hosts": ["s1"], "service": "m"}},
            "state.sentinel.hosts: 's1' is not host:port",
        ),
        (
            {"sentinel": {"hosts": ["s:1"], "service": "m"}, "cluster": True},
            "state: a Sentinel-managed Redis is not a cluster",
        ),
        ({"sentinel": {"hosts": ["s:1"], "service": "m"}, "redis": "redis://r"}, ONE_URL),
        (
            {"redis": "redis://r", "when_unreachable": "open"},
            "state.when_unreachable: Input should be 'fail_closed' or 'local'",
        ),
    ],
)
def test_a_bad_state_is_an_error_at_its_path(state: Any, line: str) -> None:
    data = base()
    data["state"] = state
    assert error_lines(data) == [line]


def test_shared_state_takes_a_provider_rate_and_refuses_charges_redis_cannot_count() -> None:
    """A pool's rate is paced in Redis (shared by the replicas), so it is taken; a charge
    above 2^31 cost units (c_max over the smallest flow weight) loses meters' exactness in
    Lua."""
    data = base()
    data["state"] = {"redis": "redis://r:6379/0"}
    data["pools"]["provider-a"]["rate"] = {"requests_per_minute": 600}
    data["orgs"]["product"] = {"weight": 0.001}
    data["pools"]["llama-8b"]["cost"] = {"max_request_tokens": 10_000_000, "output_weight": 10}
    assert error_lines(data) == [
        "pools.llama-8b.cost.max_request_tokens: with state: redis, c_max (1e+08) over the "
        "smallest flow weight (0.001) must stay below 2^31: lower it, or raise that weight",
    ]
    del data["state"]
    assert parse(data).state is None  # in memory both are fine


# --- size buckets inside a flow (docs/design.md §3) --------------------------------------


def with_buckets(**interactive: Any) -> dict[str, Any]:
    """base() with the default classes, ``interactive`` given ``interactive``'s settings."""
    data = base()
    data["classes"] = {"interactive": {"weight": 6, **interactive}, "batch": {}}
    return data


def test_size_buckets_are_off_by_default_and_shown_by_check_config_when_set() -> None:
    plain = parse(base())
    assert all(c.size_buckets is None for c in plain.classes.values())
    assert plain.classes["interactive"].overtaking(5000.0) == (0, None)
    config = parse(with_buckets(size_buckets=[500, 4000], max_overtaken=12))
    interactive = config.classes["interactive"]
    assert interactive.size_buckets == [500, 4000]
    assert [interactive.overtaking(c) for c in (500, 501, 4001)] == [(0, 12), (1, 12), (2, 12)]
    assert parse(with_buckets(size_buckets=[2000])).classes["interactive"].overtaken_at_most == 100
    text = summary(config)
    assert "interactive: weight=6, size_buckets=[500, 4000] (cost), max_overtaken=12" in text
    assert "batch: weight=1\n" in text  # no buckets: nothing said


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"size_buckets": [500, 400]}, "size_buckets: must be strictly increasing"),
        ({"size_buckets": [500, 500]}, "size_buckets: must be strictly increasing"),
        ({"size_buckets": []}, "size_buckets: must not be empty"),
        ({"size_buckets": [0, 4]}, "size_buckets[0]: must be > 0"),
        ({"size_buckets": [-1]}, "size_buckets[0]: must be > 0"),
        ({"size_buckets": [5, float("inf")]}, "size_buckets[1]: must be a finite number"),
        ({"size_buckets": [float("nan")]}, "size_buckets[0]: must be a finite number"),
        ({"size_buckets": ["500"]}, "size_buckets[0]: expected a number"),
        ({"size_buckets": 500}, "size_buckets: expected a list"),
        ({"size_buckets": [5], "max_overtaken": -1}, "max_overtaken: must be >= 0"),
        ({"size_buckets": [5], "max_overtaken": 1001}, "max_overtaken: must be <= 1000"),
        ({"size_buckets": [5], "max_overtaken": 2.5}, "max_overtaken: expected an integer"),
        ({"size_buckets": [5], "max_overtaken": True}, "max_overtaken: expected an integer"),
        ({"max_overtaken": 3}, "max_overtaken: only with size_buckets"),
    ],
)
def test_bad_size_buckets_fail_at_their_path(settings: dict[str, Any], line: str) -> None:
    assert error_lines(with_buckets(**settings)) == [f"classes.interactive.{line}"]


def test_seventeen_bounds_are_too_many_and_zero_overtakes_is_arrival_order() -> None:
    lines = error_lines(with_buckets(size_buckets=list(range(1, 18))))
    assert len(lines) == 1
    assert lines[0].startswith("classes.interactive.size_buckets: ")
    config = parse(with_buckets(size_buckets=list(range(1, 17)), max_overtaken=0))
    assert config.classes["interactive"].overtaking(100.0) == (16, 0)


def test_a_priority_class_has_no_size_buckets() -> None:
    data = with_band(system={**SYSTEM, "size_buckets": [100]})
    assert error_lines(data) == [
        "classes.system.size_buckets: a priority class is served in the strict band, in "
        "arrival order: size buckets order fair-queued classes only"
    ]


# --- a pool's extra paths (docs/design.md §8) ---------------------------------------------


def with_extra(*paths: Any) -> dict[str, Any]:
    data = base()
    data["pools"]["llama-8b"]["extra_paths"] = list(paths)
    return data


def test_extra_paths_are_read_with_their_cost_rules() -> None:
    config = parse(
        with_extra(
            {"path": "/v1/rerank", "cost": {"fixed": 50}},
            {"path": "/tokenize", "cost": {"input_fields": ["prompt", "messages"]}},
            {"path": "/v1/score", "cost": {"fixed": 5, "input_fields": ["text_1", "text_2"]}},
        )
    )
    pool = config.pools["llama-8b"]
    rerank, tokenize = pool.extra_path("/v1/rerank"), pool.extra_path("/tokenize")
    assert rerank is not None
    assert (rerank.cost.fixed, rerank.cost.input_fields) == (50, [])
    assert tokenize is not None
    assert tokenize.cost.input_fields == ["prompt", "messages"]
    assert pool.extra_path("/v1/other") is None
    assert config.pools["provider-a"].extra_paths == []
    # check-config shows each path's cost rule with its pool, and none for a pool without
    lines = summary(config).splitlines()
    assert (
        "  extra paths: /v1/rerank (50 tokens, as input); /tokenize (the text of prompt, "
        "messages, as input); /v1/score (5 tokens + the text of text_1, text_2, as input)"
    ) in lines
    assert sum(line.startswith("  extra paths: ") for line in lines) == 1


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"path": "v1/rerank", "cost": {"fixed": 1}}, "extra_paths[0].path: must be an absolute"),
        ({"path": "/v1/re%20rank", "cost": {"fixed": 1}}, "extra_paths[0].path: must be an"),
        ({"path": "/v1/../admin/state", "cost": {"fixed": 1}}, "extra_paths[0].path: must be"),
        ({"path": "/v1/rerank?x=1", "cost": {"fixed": 1}}, "extra_paths[0].path: must be"),
        ({"path": "/v1/chat/completions", "cost": {"fixed": 1}}, "path: is one of the proxy's"),
        ({"path": "/v1/responses", "cost": {"fixed": 1}}, "path: is one of the proxy's own"),
        ({"path": "/v1/models/x", "cost": {"fixed": 1}}, "path: is one of the proxy's own"),
        ({"path": "/admin/reload", "cost": {"fixed": 1}}, "path: is one of the proxy's own"),
        ({"path": "/metrics", "cost": {"fixed": 1}}, "path: is one of the proxy's own"),
        ({"path": "/v1/rerank", "cost": {}}, "extra_paths[0].cost: set fixed, input_fields"),
        ({"path": "/v1/rerank", "cost": {"fixed": 0}}, "extra_paths[0].cost: set fixed"),
        ({"path": "/v1/rerank", "cost": {"fixed": -1}}, "extra_paths[0].cost.fixed:"),
        ({"path": "/v1/rerank", "cost": {"fixed": "50"}}, "extra_paths[0].cost.fixed:"),
        ({"path": "/v1/rerank", "cost": {"input_fields": ["q", "q"]}}, "names a field twice"),
        ({"path": "/v1/rerank", "cost": {"input_fields": [""]}}, "cost.input_fields[0]:"),
        ({"path": "/v1/rerank", "cost": {"fixd": 1}}, "extra_paths[0].cost.fixd:"),
        ({"path": "/v1/rerank"}, "extra_paths[0].cost:"),
    ],
)
def test_a_bad_extra_path_fails_at_start_naming_its_field(
    extra: dict[str, Any], expected: str
) -> None:
    [line] = error_lines(with_extra(extra))
    assert line.startswith("pools.llama-8b.extra_paths[0]")
    assert expected in line


def test_an_extra_path_listed_twice_or_costing_more_than_a_request_may_is_refused() -> None:
    data = with_extra(
        {"path": "/v1/rerank", "cost": {"fixed": 1}},
        {"path": "/v1/rerank", "cost": {"fixed": 200_000}},
    )
    assert error_lines(data) == [
        "pools.llama-8b.extra_paths[1].path: the pool lists this path twice",
        "pools.llama-8b.extra_paths[1].cost.fixed: is above the pool's cost.max_request_tokens:"
        " every request would be refused",
    ]


def test_continuous_usage_is_off_by_default_and_on_for_a_vllm_pools_models() -> None:
    data = base()
    model = "meta-llama/Llama-3.1-8B-Instruct"
    assert parse(data).continuous_usage(model) is False
    data["pools"]["llama-8b"]["cost"] = {"continuous_usage": True}
    config = parse(data)
    assert (config.continuous_usage(model), config.continuous_usage("unknown")) == (True, False)
    models = Models.of(config)
    assert (models.continuous_usage(model), models.reports_stream_usage(model)) == (True, True)


@pytest.mark.parametrize("family", ["tgi", "openai", "llamacpp"])
def test_continuous_usage_outside_vllm_is_an_error_at_its_path(family: str) -> None:
    data = base()
    one = [{"url": "http://a:1", "slots": 1}]
    data["pools"]["llama-8b"].update(family=family, backends=one)
    data["pools"]["llama-8b"]["cost"] = {"continuous_usage": True}
    assert error_lines(data) == [
        "pools.llama-8b.cost.continuous_usage: continuous usage "
        f"(stream_options.continuous_usage_stats) is vLLM's: not for a pool of family '{family}'"
    ]
