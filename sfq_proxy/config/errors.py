"""How a bad config is told: :class:`ConfigError`, one ``(path, message)`` pair per fault,
paths written like ``pools.llama-8b.backends[1].slots``, and pydantic's errors put in those
words (:func:`config_error`).

A module of its own because both sides raise it: the models (``Config``'s checks across
sections) and the loader, which builds ``Config``; each imports it from here. No message
ever contains an input value, because the value might be a secret.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from .fields import NAME_PATTERN, NAME_RULE

# what every check returns: (path, message) pairs, in the order they are told
Errors = list[tuple[str, str]]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to a mistyped ``word``, or ``""``
    when none is close: a suggestion, never a guess that is acted upon."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def format_number(value: float) -> str:
    """A number for humans: ``6`` rather than ``6.0``, ``200000`` rather than ``2e+05``."""
    return str(int(value)) if float(value).is_integer() else str(value)


class ConfigError(Exception):
    """Invalid configuration: ``errors`` is a list of ``(path, message)``.

    ``str()`` gives one ``path: message`` line per error (just the message when the path
    is empty, e.g. for an empty file). ``source`` names the file when known.
    """

    def __init__(self, errors: Errors, source: str | None = None) -> None:
        super().__init__(errors)
        self.errors = list(errors)
        self.source = source

    def __str__(self) -> str:
        return "\n".join(f"{path}: {msg}" if path else msg for path, msg in self.errors)


_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
}
_BOUNDS = {  # error type -> (operator, ctx key holding the bound)
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}
_INTERNAL_LOC = re.compile(r"^[a-z-]+\[.*\]$")  # e.g. "function-after[...]", "tagged-union[...]"


def _error_path(loc: tuple[int | str, ...]) -> str:
    """``('pools', 'a', 'backends', 1, 'slots')`` → ``pools.a.backends[1].slots``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "[key]" and not _INTERNAL_LOC.match(part):
            path += f".{part}" if path else part
    return path


def _error_message(err: Mapping[str, Any]) -> str:
    """A short message for pydantic error ``err``. Never uses ``err['input']``."""
    kind, ctx = err["type"], err.get("ctx", {})
    if kind in _TYPE_NAMES:
        message = f"expected {_TYPE_NAMES[kind]}"
    elif kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        message = f"must be {op} {format_number(ctx[bound])}"
    elif kind == "missing":
        message = "required"
    elif kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "finite_number":
        message = "must be a finite number"
    elif kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        message = "must not be empty"
    elif kind == "string_pattern_mismatch" and ctx.get("pattern") == NAME_PATTERN:
        message = NAME_RULE
    elif kind == "value_error":
        message = str(ctx["error"])
    else:
        message = err["msg"]
    return f"invalid name: {message}" if err["loc"][-1:] == ("[key]",) else message


def config_error(exc: ValidationError, source: str) -> ConfigError:
    """Pydantic's errors in the file's own vocabulary (paths and short messages)."""
    errors = [(_error_path(e["loc"]), _error_message(e)) for e in exc.errors()]
    return ConfigError(errors, source)
