"""Who is calling and as what: the flow (org, class, pool) of a request (docs/design.md §2).

The org comes only from the API key and the class only from what that key allows; nothing
a client writes in a header or body can pick its org or raise its class.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NewType

from ..config import Config, ResolvedKey
from .errors import ApiError, cut

CLASS_HEADER = "X-Workload-Class"
# Where a client's key may be, in this order: the first of them present is read, and only
# it (docs/design.md §2). OpenAI's SDKs send the first, Azure OpenAI's the second,
# Anthropic-style clients the third.
KEY_HEADERS = ("Authorization", "api-key", "x-api-key")

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
    """Maps a bearer token to its key entry by the token's SHA-256 digest: the file's keys
    and those of the admin API's store (a file's key wins where both have a digest).

    A dict lookup, not a scan: it stays O(1) with thousands of keys, and its timing tells
    nothing usable, because a caller cannot choose the digest it probes with. It notes when
    each key was last used (``last_used``, by digest), in memory only: the shell persists
    it now and then, never per request.
    """

    def __init__(self, keys: Iterable[ResolvedKey], managed: Iterable[ResolvedKey] = ()) -> None:
        self.last_used: dict[bytes, float] = {}
        self._file = {key.digest: key for key in keys}
        self._keys = self._file
        self.manage(managed)

    def manage(self, managed: Iterable[ResolvedKey]) -> None:
        """Use ``managed`` as the admin API's keys from now on (the store changed)."""
        self._keys = {**{key.digest: key for key in managed}, **self._file}

    def reconfigure(self, keys: Iterable[ResolvedKey], managed: Iterable[ResolvedKey]) -> None:
        """A reload: the file's keys are ``keys``; ``managed``, the store's, resolved anew."""
        self._file = {key.digest: key for key in keys}
        self.manage(managed)

    def identify(self, headers: Mapping[str, str], now: float) -> ResolvedKey:
        """The key of a request with these ``headers`` (see :func:`credential`) at Unix time
        ``now``, or a 401: no key, an unknown or revoked one, or one that has expired."""
        token = credential(headers)
        if token is None:
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.")
        found = self._keys.get(key_digest(token))
        if found is None:
            raise ApiError(401, "Incorrect API key provided.")
        if found.expires is not None and now >= found.expires:
            raise ApiError(401, "This API key has expired.", code="key_expired")
        self.last_used[found.digest] = now
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
            raise ApiError(403, f"This key may not use workload class '{cut(requested_class)}'.")
        cls = requested_class
    pool = config.pool_for_model(model)
    if pool is None:
        raise ApiError(404, f"The model '{cut(model)}' does not exist or is not served here.")
    if not may_use(key, model, pool):
        raise ApiError(
            403,
            f"This key may not use the model '{model}' (pool '{pool}'); "
            f"it may use: {_allowed(key)}.",
            code="model_not_allowed",
        )
    return Flow(org=key.org, cls=cls, pool=pool)


def may_use(key: ResolvedKey, model: str, pool: str) -> bool:
    """Whether ``key`` may call ``model`` of ``pool``: its pool is allowed, and its models
    are unrestricted or list it (docs/access.md). Read from the key alone, so keys of the
    file and keys made through the admin API are held to the same rule."""
    return (key.pools is None or pool in key.pools) and (key.models is None or model in key.models)


def _allowed(key: ResolvedKey) -> str:
    """What a refused key may use, by name: its models when they are listed, else its
    pools. Only names its own access holds, nothing of other tenants. (An admin API key
    whose org a reload narrowed may be left with none.)"""
    kind, names = ("models", key.models) if key.models is not None else ("pools", key.pools)
    if not names:
        return "no model"
    return f"{kind} " + ", ".join(f"'{name}'" for name in sorted(names))


def credential(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: ``Authorization: Bearer <key>``, else the value of
    ``api-key``, else of ``x-api-key``. The first of these headers that is present decides,
    even when it holds no key (an ``Authorization: Basic …`` is then no key at all): a
    request gets one guess, never one per header."""
    authorization = headers.get(KEY_HEADERS[0])
    if authorization is not None:
        return _bearer(authorization)
    for name in KEY_HEADERS[1:]:
        value = headers.get(name)
        if value is not None:
            return value.strip() or None
    return None


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
