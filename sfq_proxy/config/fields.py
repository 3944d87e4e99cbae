"""The pieces every section is made of: the strict base model and the bounded field types.

Every model is frozen and forbids unknown keys, so a typo is an error rather than a
silently ignored knob. Models use pydantic's *strict* mode: YAML already gives typed
scalars, so ``slots: "32"`` or ``priority: yes-please`` is reported instead of coerced
(an integer is still accepted where a float is expected).

The bounds sit together because they hold together: a flow's weight is a class's times an
org's, and a request's cost comes from a pool's weights and a class's or pool's ceiling, so
each is chosen with the others in view. Other files of the same kind (the lab's scenarios)
build on ``StrictModel`` and ``NAME_PATTERN`` too.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
NAME_RULE = "must start with a letter or digit and use only letters, digits, '_', '.', '-'"
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"  # an HTTP field name (RFC 9110 token)

# Names of orgs, classes and pools end up in metric labels, headers and error paths,
# so they are kept to a safe alphabet.
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
HeaderName = Annotated[str, StringConstraints(pattern=HEADER_NAME_PATTERN)]
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
# Bounds that keep every number derived from the config finite and every timer valid:
# a flow's weight (class × org) stays within [1e-6, 1e6], inside the fair queue's
# [1e-9, 1e9]; and the largest request (max body, max_tokens) at the largest cost weights
# stays below its MAX_COST.
Weight = Annotated[float, Field(ge=0.001, le=1000, allow_inf_nan=False)]
CostWeight = Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0, le=31_536_000, allow_inf_nan=False)]  # a year
NonNegativeSeconds = Annotated[float, Field(ge=0, le=31_536_000, allow_inf_nan=False)]
PerMinute = Annotated[float, Field(gt=0, le=1e12, allow_inf_nan=False)]
# a ceiling on one request's tokens, input + output: at the largest cost weight its cost
# stays far below the fair queue's MAX_COST
RequestTokens = Annotated[int, Field(gt=0, le=100_000_000)]
PartTokens = Annotated[int, Field(ge=0, le=10_000_000)]


class StrictModel(BaseModel):
    """Base of every config model: immutable, strict, and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def http_url(value: str, secrets_field: str) -> str:
    """``value``, if it is an http:// or https:// URL with a host and no credentials (a URL
    is shown by check-config and in logs: secrets go in ``secrets_field``); else ValueError,
    caught at load time rather than as a connection error under load."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a malformed port
    except ValueError:
        raise ValueError("must be a valid http:// or https:// URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"must not contain credentials; use {secrets_field}")
    return value
