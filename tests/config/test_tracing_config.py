"""The ``tracing:`` section (config/tracing.py): what it accepts, the path of what it refuses,
the collector's headers from the environment, and check-config's line, which shows no secret."""

from __future__ import annotations

from typing import Any

import pytest
from proxy_lab import config_yaml

from sfq_proxy.config import ConfigError, parse_config
from sfq_proxy.config import tracing as tracing_module
from sfq_proxy.config.summary import summary

ENDPOINT = "http://collector:4318/v1/traces"


def parse(tracing: Any, environ: dict[str, str] | None = None) -> Any:
    return parse_config(config_yaml(["http://127.0.0.1:9"], tracing=tracing), environ=environ or {})


def errors(tracing: Any, environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse(tracing, environ)
    return info.value.errors


def test_absent_or_disabled_is_off_and_present_is_on_with_its_defaults() -> None:
    assert parse_config(config_yaml(["http://127.0.0.1:9"]), environ={}).tracing_on() is None
    assert parse({"endpoint": ENDPOINT, "enabled": False}).tracing_on() is None
    spec = parse({"endpoint": ENDPOINT}).tracing_on()
    assert spec is not None
    assert (spec.service_name, spec.sample_ratio, spec.export_timeout_s) == ("sfq-proxy", 1.0, 10.0)
    assert (spec.max_queue_size, spec.max_export_batch_size, spec.schedule_delay_s) == (
        2048,
        512,
        5.0,
    )


@pytest.mark.parametrize(
    ("tracing", "path"),
    [
        ({}, "tracing.endpoint"),
        ({"endpoint": "collector:4318"}, "tracing.endpoint"),
        ({"endpoint": "ftp://collector/v1/traces"}, "tracing.endpoint"),
        ({"endpoint": "http://user:secret@collector:4318/v1/traces"}, "tracing.endpoint"),
        ({"endpoint": ENDPOINT, "sample_ratio": 1.5}, "tracing.sample_ratio"),
        ({"endpoint": ENDPOINT, "max_queue_size": 0}, "tracing.max_queue_size"),
        ({"endpoint": ENDPOINT, "export_timeout_s": 0}, "tracing.export_timeout_s"),
        ({"endpoint": ENDPOINT, "max_queue_size": 8, "max_export_batch_size": 9}, "tracing"),
        ({"endpoint": ENDPOINT, "headers_env": {"bad header": "X"}}, "tracing.headers_env"),
        ({"endpoint": ENDPOINT, "sampler": "always"}, "tracing.sampler"),
    ],
)
def test_a_bad_field_is_named_by_its_path(tracing: dict[str, Any], path: str) -> None:
    found = errors(tracing)
    assert [p for p, _ in found if p.startswith(path)], found


def test_headers_come_from_the_environment_and_are_never_shown() -> None:
    tracing = {"endpoint": ENDPOINT, "headers_env": {"Authorization": "OTLP_AUTH"}}
    assert errors(tracing) == [
        ("tracing.headers_env.Authorization", "environment variable OTLP_AUTH is not set")
    ]
    config = parse(tracing, {"OTLP_AUTH": "Bearer otlp-secret"})
    assert config.tracing_headers() == {"Authorization": "Bearer otlp-secret"}
    shown = summary(config)
    assert "otlp-secret" not in shown
    assert "otlp-secret" not in repr(config)
    line = next(line for line in shown.splitlines() if line.startswith("tracing:"))
    assert ENDPOINT in line
    assert "Authorization from env OTLP_AUTH" in line


def test_tracing_without_its_packages_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing_module, "_PACKAGES", ("opentelemetry.not_installed",))
    assert errors({"endpoint": ENDPOINT}) == [
        ("tracing", "needs the OpenTelemetry packages: install sfq-proxy[tracing]")
    ]
    assert parse({"endpoint": ENDPOINT, "enabled": False}).tracing_on() is None


@pytest.mark.parametrize(
    "value",
    ["otlp-secret\nx", "otlp-secret\rInjected: 1", "otlp\x00secret", "otlp\x7fsecret", "otlp-€"],
)
def test_a_header_value_no_http_header_can_carry_is_refused_without_quoting_it(
    value: str,
) -> None:
    """A newline, a control character or a character beyond latin-1: the exporter would
    fail every export, logging its error with the value; refused at start, by path."""
    found = errors(
        {"endpoint": ENDPOINT, "headers_env": {"X-Token": "OTLP_TOKEN"}}, {"OTLP_TOKEN": value}
    )
    assert [path for path, _ in found] == ["tracing.headers_env.X-Token"], found
    assert "OTLP_TOKEN" in found[0][1]
    assert "otlp" not in str(found)
    assert parse({"endpoint": ENDPOINT, "headers_env": {"X-Token": "T"}}, {"T": "otlp-é ok"})
