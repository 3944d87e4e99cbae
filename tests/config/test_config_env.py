"""``${NAME}`` and ``${NAME:-default}`` in the config's string values (docs/design.md §7), and
the keys' names that the access log shows."""

from __future__ import annotations

import hashlib
import textwrap
from typing import Any

import pytest

from sfq_proxy.config import ConfigError, expand_env, parse_config
from sfq_proxy.config.summary import summary

ENV = {"HOST": "10.0.0.11", "PORT": "8000", "EMPTY": "", "TEAM": "team-a"}


def expand(data: Any, environ: dict[str, str] | None = None) -> Any:
    return expand_env(data, ENV if environ is None else environ)


def errors(data: Any, environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        expand(data, environ)
    return info.value.errors


def test_a_reference_is_replaced_anywhere_in_a_string() -> None:
    assert expand("http://${HOST}:${PORT}/v1") == "http://10.0.0.11:8000/v1"
    assert expand("${HOST}") == "10.0.0.11"
    assert expand("no reference, a $ alone, $HOST unbraced") == (
        "no reference, a $ alone, $HOST unbraced"
    )


def test_nested_mappings_and_lists_are_expanded_at_any_depth() -> None:
    data = {"pools": {"p": {"models": ["${TEAM}-model"], "backends": [{"url": "${HOST}"}]}}}
    assert expand(data) == {
        "pools": {"p": {"models": ["team-a-model"], "backends": [{"url": "10.0.0.11"}]}}
    }


def test_a_default_applies_when_unset_or_empty() -> None:
    assert expand("${UNSET:-fallback}") == "fallback"
    assert expand("${EMPTY:-fallback}") == "fallback"
    assert expand("${HOST:-fallback}") == "10.0.0.11"
    assert expand("${UNSET:-}") == ""  # an empty default is a default
    assert expand("${UNSET:-a:b/c d}") == "a:b/c d"


def test_a_set_but_empty_variable_without_default_is_empty() -> None:
    assert expand("x${EMPTY}y") == "xy"


def test_keys_and_non_strings_are_left_alone() -> None:
    data = {"${HOST}": 1, "n": 8080, "f": 1.5, "b": True, "none": None, "l": [1, False]}
    assert expand(data) == data


def test_dollar_dollar_brace_is_a_literal() -> None:
    assert expand("$${HOST}") == "${HOST}"
    assert expand("a$${UNSET:-x}b") == "a${UNSET:-x}b"  # not expanded, and no error
    assert expand("$$${HOST}") == "$${HOST}"  # "$" then "$${" → "$" + literal "${"


def test_a_value_is_expanded_once() -> None:
    assert expand("${INNER}", {"INNER": "${HOST}"}) == "${HOST}"


def test_an_unset_variable_is_an_error_naming_the_path_and_the_variable() -> None:
    data = {"pools": {"p": {"backends": [{"url": "ok"}, {"url": "http://${BACKEND_2}:80"}]}}}
    message = "environment variable BACKEND_2 is not set (and has no default)"
    assert errors(data) == [("pools.p.backends[1].url", message)]


def test_every_error_is_reported_at_once_and_never_a_value() -> None:
    data = {"a": "${ONE}", "b": ["${TWO}", "${}"], "c": "${HOST", "d": "${1X}", "e": "${HOST}"}
    found = errors(data)
    assert [path for path, _ in found] == ["a", "b[0]", "b[1]", "c", "d"]
    assert "ONE" in found[0][1]
    assert "TWO" in found[1][1]
    for _, message in found[2:]:
        assert message == "invalid ${...}: write ${NAME}, ${NAME:-default} or $${"
    assert not any(ENV["HOST"] in message for _, message in found)


CONFIG = """
listen: {host: "${LISTEN_HOST:-127.0.0.1}", port: 8080}
keys:
  - {key: "${TEAM_KEY}", org: "${TEAM}", classes: [batch]}
  - {key: sk-other, org: ops, classes: [batch], name: ci-bot}
pools:
  llama:
    models: ["${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"]
    backends:
      - url: http://${HOST}:${PORT}
        slots: 4
"""


def test_parse_config_expands_with_its_environ() -> None:
    secret = "sk-from-the-environment"
    config = parse_config(CONFIG, environ={**ENV, "TEAM_KEY": secret})
    assert config.listen.host == "127.0.0.1"
    assert config.keys[0].org == "team-a"
    assert config.pools["llama"].models == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert config.pools["llama"].backends[0].url == "http://10.0.0.11:8000"
    assert config.resolved_keys()[0].digest == hashlib.sha256(secret.encode()).digest()
    # a secret that came through ${} into a secret field is shown no more than a plain key
    assert secret not in summary(config) + repr(config) + config.model_dump_json()


def test_parse_config_reports_an_unset_variable_with_its_file() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(CONFIG, environ={"TEAM_KEY": "sk-x", "TEAM": "t"}, source="f.yaml")
    assert info.value.source == "f.yaml"
    assert str(info.value).splitlines() == [
        "pools.llama.backends[0].url: environment variable HOST is not set (and has no default)",
        "pools.llama.backends[0].url: environment variable PORT is not set (and has no default)",
    ]


def test_a_number_field_is_not_filled_from_the_environment() -> None:
    """Only strings are expanded, and strings are not coerced: ``port: ${PORT}`` is refused
    as a string where an integer is expected (docs/design.md §7)."""
    text = CONFIG.replace("port: 8080", 'port: "${PORT}"')
    with pytest.raises(ConfigError) as info:
        parse_config(text, environ={**ENV, "TEAM_KEY": "sk-x"})
    assert str(info.value) == "listen.port: expected an integer"


# --- the keys' names (the access log's `key`) -------------------------------------------


def test_a_key_is_named_by_its_name_else_its_org_and_index() -> None:
    config = parse_config(CONFIG, environ={**ENV, "TEAM_KEY": "sk-x"})
    assert [key.name for key in config.resolved_keys()] == ["team-a#0", "ci-bot"]
    assert "  keys[1]: name=ci-bot, org=ops, classes=[batch] (plain)\n" in summary(config)
    assert "  keys[0]: org=team-a, classes=[batch] (plain)\n" in summary(config)


def test_key_names_are_unique_and_safe() -> None:
    text = textwrap.dedent("""
        keys:
          - {key: sk-1, org: a, classes: [batch], name: same}
          - {key: sk-2, org: b, classes: [batch], name: same}
          - {key: sk-3, org: c, classes: [batch], name: "has space"}
        pools:
          p: {models: [m], backends: [{url: "http://127.0.0.1:1", slots: 1}]}
    """)
    with pytest.raises(ConfigError) as info:
        parse_config(text, environ={})
    message = str(info.value)
    assert "keys[2].name: must start with a letter or digit" in message
    with pytest.raises(ConfigError) as info:
        parse_config(text.replace('"has space"', "other"), environ={})
    assert str(info.value) == "keys[1].name: same name as keys[0]"
