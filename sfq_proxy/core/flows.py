"""Who is calling and as what: the flow (org, class, pool) of a request (docs/design.md §2).

The org comes only from the API key and the class only from what that key allows; nothing
a client writes in a header or body can pick its org or raise its class.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NewType

from ..config import Config, ResolvedKey
from .errors import ApiError

CLASS_HEADER = "X-Workload-Class"

FlowId = NewType("FlowId", str)
"""A flow's name in its pool's fair queue, ``org/class``. Made by :func:`flow_id` alone and
read back by :func:`org_and_class`; names cannot hold a "/", so it splits back exactly.
Ties between equal meters go to the smaller id."""


def flow_id(org: str, cls: str) -> FlowId:
    return FlowId(f"{org}/{cls}")


def org_and_class(flow: str) -> tuple[str, str]:
    """The org and class a :data:`FlowId` was made of."""
    org, _, cls = flow.partition("/")
    return org, cls


@dataclass(frozen=True, slots=True)
class Flow:
    org: str
    cls: str
    pool: str

    @property
    def key(self) -> tuple[str, str, str]:
        """Its labels in the metrics: (org, class, pool)."""
        return self.org, self.cls, self.pool

    @property
    def id(self) -> FlowId:
        """The flow's name in the fair queue; its order breaks ties between equal meters."""
        return flow_id(self.org, self.cls)


class Authenticator:
    """Maps a bearer token to its key entry by the token's SHA-256 digest.

    A dict lookup, not a scan: it stays O(1) with thousands of keys, and its timing tells
    nothing usable, because a caller cannot choose the digest it probes with.
    """

    def __init__(self, keys: list[ResolvedKey]) -> None:
        self._keys = {key.digest: key for key in keys}

    def identify(self, authorization: str | None) -> ResolvedKey:
        token = _bearer(authorization)
        if token is None:
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.")
        found = self._keys.get(key_digest(token))
        if found is None:
            raise ApiError(401, "Incorrect API key provided.")
        return found


def key_digest(token: str) -> bytes:
    """SHA-256 of a key as the client sent it. aiohttp keeps header bytes that are not
    UTF-8 as surrogate escapes: they are hashed as the bytes they were, never an error."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def classify(config: Config, key: ResolvedKey, requested_class: str | None, model: str) -> Flow:
    """The flow of a request by ``key`` for ``model``, asking for ``requested_class``."""
    cls = key.classes[0]
    if requested_class:
        if requested_class not in key.classes:
            raise ApiError(403, f"This key may not use workload class '{requested_class}'.")
        cls = requested_class
    pool = config.pool_for_model(model)
    if pool is None:
        raise ApiError(404, f"The model '{model}' does not exist or is not served here.")
    return Flow(org=key.org, cls=cls, pool=pool)


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
