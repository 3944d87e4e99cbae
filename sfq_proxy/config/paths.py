"""The proxy's own paths, and the others a pool's backends serve (``pools.<pool>.extra_paths``)
at the cost each says.

Apart from the pools because an extra path must never take one of the proxy's own paths:
the two lists are checked against each other here. The inference routes are :class:`Kind`,
which the core reads requests by (``core/inference_request.py`` re-exports it): it is
defined here, in the lowest layer, so that the config needs nothing of the core.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Self

from pydantic import Field, StringConstraints, field_validator, model_validator

from .fields import StrictModel
from .limits import MAX_OUTPUT_TOKENS


class Kind(Enum):
    """What a request is, by its route (the value: the path it is served at and sent to)."""

    CHAT = "/v1/chat/completions"
    COMPLETION = "/v1/completions"
    EMBEDDING = "/v1/embeddings"
    RESPONSES = "/v1/responses"
    EXTRA = "extra_paths"  # a pool's other paths: the request's path is sent (``path``)

    @property
    def generates(self) -> bool:
        """Whether it generates output, which it is charged for and bounded in."""
        return self not in (Kind.EMBEDDING, Kind.EXTRA)


# The proxy's own paths, which no pool's ``extra_paths`` may take (http/app.py routes them):
# the inference routes (``Kind``) and the rest.
PROXY_PATHS = frozenset(
    {kind.value for kind in Kind if kind.value.startswith("/")}
    | {"/v1/models", "/metrics", "/healthz", "/readyz"}
)
PROXY_PATH_PREFIXES = ("/v1/models/", "/admin/")
# a path as a client writes it, decoded: segments of RFC 3986 pchar, no percent-escape
_EXTRA_PATH = re.compile(r"(?:/[A-Za-z0-9._~!$&'()*+,;=:@-]+)+")
FieldName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class ExtraCostSpec(StrictModel):
    """What one request to an extra path counts, in input tokens (docs/design.md §4):
    ``fixed`` tokens, plus the text of the body's top-level ``input_fields`` (strings
    anywhere in them, counted as a prompt's; integers in arrays, one token id each). Such
    paths generate nothing the proxy can bound: no output is charged."""

    fixed: int = Field(0, ge=0, le=MAX_OUTPUT_TOKENS)
    input_fields: list[FieldName] = Field(default_factory=list, max_length=16)

    @model_validator(mode="after")
    def _some_cost(self) -> Self:
        if not self.fixed and not self.input_fields:
            raise ValueError("set fixed, input_fields or both: a request must cost something")
        if len(set(self.input_fields)) != len(self.input_fields):
            raise ValueError("input_fields names a field twice")
        return self


class ExtraPathSpec(StrictModel):
    """Another OpenAI-compatible path the pool's backends serve (``/v1/rerank``,
    ``/tokenize``…): POSTed JSON with a ``model``, relayed like the inference routes, at
    the cost its ``cost`` rule says."""

    path: str = Field(max_length=256)
    cost: ExtraCostSpec

    @field_validator("path")
    @classmethod
    def _a_free_path(cls, value: str) -> str:
        if not _EXTRA_PATH.fullmatch(value) or any(
            segment in (".", "..") for segment in value.split("/")
        ):
            raise ValueError(
                "must be an absolute path of plain segments (letters, digits, '-._~' and "
                "the like; no '%', '?', '#', '.' or '..' segments), such as /v1/rerank"
            )
        if value in PROXY_PATHS or value.startswith(PROXY_PATH_PREFIXES):
            raise ValueError("is one of the proxy's own paths")
        return value
