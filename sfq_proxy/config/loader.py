"""From text to a :class:`Config`: YAML read safely (a duplicate key is an error),
``${VAR}`` expanded from the environment, the result validated, and the demo config
shipped in the package.

Apart from the models because other files of the same kind (the lab's scenarios) are read
with the same :func:`read_yaml` and :func:`expand_env`, and because the models need none
of it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .errors import ConfigError, Errors, config_error
from .proxy import Config


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe loader that refuses duplicate mapping keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str, source: str) -> dict[str, Any]:
    """YAML → mapping; errors give a line number but no snippet (it might hold a key)."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([(where, str(exc.problem or exc.context))], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", f"invalid YAML: {type(exc).__name__}")], source) from None
    if data is None:
        raise ConfigError([("", "the configuration is empty")], source)
    if not isinstance(data, dict):
        raise ConfigError([("", "the top level must be a mapping of sections")], source)
    return data


# ``${NAME}``, ``${NAME:-default}``, or ``$${``, a literal ``${``; anything else after a
# ``${`` (no name, no closing brace) is an error rather than text left as it was
_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)(\}?)")
_NAME_DEFAULT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def expand_env(data: Any, environ: Mapping[str, str], path: str = "") -> Any:
    """``data`` with ``${NAME}`` and ``${NAME:-default}`` in its string values replaced from
    ``environ`` (docs/design.md §7): in mappings' values and lists' items at any depth,
    never in mapping keys nor in numbers or booleans. ``${NAME:-default}`` takes the default
    when NAME is unset or empty, ``${NAME}`` is an error when NAME is unset; ``$${`` is a
    literal ``${``. A value is expanded once: what a variable holds is not expanded again.
    Every error names the field's path and the variable, never a value."""
    errors: Errors = []
    expanded = _expand(data, environ, path, errors)
    if errors:
        raise ConfigError(errors)
    return expanded


def _expand(data: Any, environ: Mapping[str, str], path: str, errors: Errors) -> Any:
    if isinstance(data, str):
        return _expand_text(data, environ, path, errors) if "${" in data else data
    if isinstance(data, dict):
        return {
            k: _expand(v, environ, f"{path}.{k}" if path else str(k), errors)
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [_expand(v, environ, f"{path}[{i}]", errors) for i, v in enumerate(data)]
    return data


def _expand_text(text: str, environ: Mapping[str, str], path: str, errors: Errors) -> str:
    def replace(match: re.Match[str]) -> str:
        if match[0] == "$${":
            return "${"
        reference = _NAME_DEFAULT.fullmatch(match[1])
        if reference is None or not match[2]:
            errors.append((path, "invalid ${...}: write ${NAME}, ${NAME:-default} or $${"))
            return ""
        name, default = reference[1], reference[2]
        value = environ.get(name)
        if default is not None and not value:
            return default
        if value is None:
            errors.append((path, f"environment variable {name} is not set (and has no default)"))
            return ""
        return value

    return _REFERENCE.sub(replace, text)


def parse_config(
    text: str, environ: Mapping[str, str] | None = None, source: str = "<string>"
) -> Config:
    """Parse and validate YAML ``text``; ``environ`` (default ``os.environ``) expands
    ``${NAME}`` in its string values and resolves keys."""
    environ = os.environ if environ is None else environ
    try:
        data = expand_env(read_yaml(text, source), environ)
    except ConfigError as exc:
        exc.source = source
        raise
    context = {"environ": environ}
    try:
        return Config.model_validate(data, context=context)
    except ValidationError as exc:
        raise config_error(exc, source) from None
    except ConfigError as exc:
        exc.source = source
        raise


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate the YAML file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([("", f"cannot read {path}: {exc}")], str(path)) from None
    return parse_config(text, environ, source=str(path))


def default_config(environ: Mapping[str, str] | None = None) -> Config:
    """The demo configuration shipped in the package (``sfq_proxy/demo.yaml``), its
    variables from ``environ`` (never ``os.environ``): the admin key ``SFQ_DEMO_ADMIN_KEY``
    (a random one nobody knows when absent) and the simulated servers' ports."""
    text = resources.files("sfq_proxy").joinpath("demo.yaml").read_text(encoding="utf-8")
    environ = {"SFQ_DEMO_ADMIN_KEY": f"sk-demo-admin-{os.urandom(8).hex()}", **(environ or {})}
    return parse_config(text, environ=environ, source="sfq_proxy/demo.yaml")
