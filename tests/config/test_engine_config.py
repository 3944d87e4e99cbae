"""The config of engine dispatch (docs/design.md §5 "Engine-aware dispatch", §7): a pool's
``dispatch`` section, a backend's ``slots: auto`` and ``capacity``, a class's
``engine_ceiling``; every error names the field's path."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from sfq_proxy.config import ConfigError, parse_config, pool_slots
from sfq_proxy.config.summary import summary

POOL = "pools.llama-8b"


def config(
    dispatch: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """One key, one pool (a vLLM backend of 8 slots), with ``dispatch`` and ``backend``'s
    fields set; ``top`` adds top-level sections."""
    pool: dict[str, Any] = {
        "models": ["m"],
        "backends": [{"url": "http://10.0.0.1:8000", "slots": 8, **(backend or {})}],
    }
    if dispatch is not None:
        pool["dispatch"] = dispatch
    return {
        "keys": [{"key": "sk-a", "org": "a", "classes": ["batch"]}],
        "pools": {"llama-8b": pool},
        **top,
    }


def errors(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(yaml.safe_dump(data), environ={})
    return str(info.value).splitlines()


def test_absent_is_static_dispatch_as_before() -> None:
    pool = parse_config(yaml.safe_dump(config()), environ={}).pools["llama-8b"]
    assert pool.dispatch.mode == "static"
    assert not pool.engine


def test_engine_mode_with_auto_slots_and_a_capacity() -> None:
    data = config({"mode": "engine", "allowance": 2}, {"slots": "auto", "capacity": 16})
    data["classes"] = {"batch": {"engine_ceiling": 0.9}, "system": {"priority": True}}
    parsed = parse_config(yaml.safe_dump(data), environ={})
    pool = parsed.pools["llama-8b"]
    assert pool.engine
    assert pool.backends[0].slots == "auto"
    assert pool_slots(pool) == 16  # the capacity stands for auto slots
    assert parsed.classes["batch"].engine_ceiling == 0.9
    text = summary(parsed)
    assert "slots auto, capacity 16" in text
    assert "dispatch: engine (reads /metrics every 0.5 s" in text
    assert "engine_ceiling=0.9" in text


@pytest.mark.parametrize(
    ("dispatch", "backend", "expected"),
    [
        (
            None,
            {"slots": "auto"},
            f"{POOL}.backends[0].slots: auto only with dispatch.mode: engine",
        ),
        (None, {"capacity": 4}, f"{POOL}.backends[0].capacity: only with dispatch.mode: engine"),
        (None, {"slots": "Auto"}, f"{POOL}.backends[0].slots: expected an integer, or auto"),
        ({"mode": "engines"}, None, f"{POOL}.dispatch.mode: "),
        (
            {"mode": "engine", "timeout_s": 2.0},
            None,
            f"{POOL}.dispatch.timeout_s: must be below max_age_s",
        ),
        ({"interval_s": 3.0}, None, f"{POOL}.dispatch.max_age_s: must be above interval_s"),
        ({"interval_s": 0.01}, None, f"{POOL}.dispatch.interval_s: must be >= 0.05"),
        ({"allowance": 0}, None, f"{POOL}.dispatch.allowance: must be >= 1"),
        ({"kv_ceiling": 1.5}, None, f"{POOL}.dispatch.kv_ceiling: must be <= 1"),
        ({"max_bytes": 100}, None, f"{POOL}.dispatch.max_bytes: must be >= 4096"),
        ({"metrics_path": "metrics"}, None, f"{POOL}.dispatch.metrics_path: must start with '/'"),
        ({"fallback_slots": 0}, None, f"{POOL}.dispatch.fallback_slots: must be > 0"),
    ],
)
def test_errors_name_the_field(
    dispatch: dict[str, Any] | None, backend: dict[str, Any] | None, expected: str
) -> None:
    lines = errors(config(dispatch, backend))
    assert any(line.startswith(expected) for line in lines), lines


@pytest.mark.parametrize("family", ["openai", "llamacpp"])
def test_engine_mode_reads_known_families_only(family: str) -> None:
    """A hosted API has no engine metrics, nor has llama-cpp-python's server."""
    data = config({"mode": "engine"})
    data["pools"]["llama-8b"]["family"] = family
    assert (
        f"{POOL}.dispatch.mode: engine dispatch reads the metrics of vllm, llama-server, tgi "
        f"servers, not of family '{family}'" in errors(data)
    )


def test_llama_server_is_a_family_of_its_own() -> None:
    """llama.cpp's C++ server: several slots, /health, its metrics for engine dispatch."""
    data = config({"mode": "engine"}, {"slots": "auto"})
    data["pools"]["llama-8b"]["family"] = "llama-server"
    pool = parse_config(yaml.safe_dump(data), environ={}).pools["llama-8b"]
    assert (pool.engine, pool.health.path, pool.stream_usage) == (True, "/health", True)


@pytest.mark.parametrize("ceiling", [0, 1.5, -0.5])
def test_a_class_ceiling_is_a_fraction(ceiling: float) -> None:
    data = config(classes={"batch": {"engine_ceiling": ceiling}})
    assert any(line.startswith("classes.batch.engine_ceiling: must be") for line in errors(data))


def test_engine_mode_is_accepted_with_shared_state() -> None:
    """The replicas' gates bound the leases in Redis (docs/design.md §5)."""
    data = config({"mode": "engine"}, state={"redis": "redis://127.0.0.1:6379/0"})
    assert parse_config(yaml.safe_dump(data), environ={}).pools[POOL.split(".")[1]].engine
