"""The ``keys:`` and ``orgs:`` sections: who may call, as which org, and what each key and
org may use (docs/access.md).

One module, because what a key may use is its org's lists met with its own, and an org is
checked by the keys that name it. A key's secret is hashed as soon as it is read
(:func:`resolve_keys`): only digests are kept.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Self

from pydantic import Field, SecretStr, field_validator, model_validator

from .errors import Errors, did_you_mean
from .fields import Name, NonEmptyStr, PerMinute, PositiveInt, StrictModel, Weight
from .pools import PoolSpec
from .usage import Budgets


class KeySpec(StrictModel):
    """An API key: who may call, as which org, with which classes (the first is default).

    Exactly one of ``key_env`` (environment variable, read at load time), ``key``
    (plain text, for local use) or ``key_sha256`` (hex digest of the key) is given.
    ``name`` is what the access log calls it (default ``<org>#<index in keys>``).
    """

    key_env: NonEmptyStr | None = None
    key: SecretStr | None = Field(None, min_length=1)
    key_sha256: str | None = None
    org: Name
    classes: list[Name] = Field(min_length=1)
    name: Name | None = None
    # what it may use, within its org's own lists (docs/access.md); None: no restriction
    pools: list[Name] | None = None
    models: list[NonEmptyStr] | None = None
    budgets: Budgets = []  # noqa: RUF012 -- pydantic copies it per instance

    @field_validator("key_sha256")
    @classmethod
    def _normalise_digest(cls, value: str | None) -> str | None:
        """Accept either hex case; store lowercase so digests compare equal."""
        if value is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise ValueError("must be 64 hexadecimal digits (a SHA-256 digest)")
        return None if value is None else value.lower()

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        """Several sources would be ambiguous; none would leave the key unusable."""
        given = [n for n in ("key_env", "key", "key_sha256") if getattr(self, n) is not None]
        if len(given) != 1:
            found = f" (found {', '.join(given)})" if given else ""
            raise ValueError(f"needs exactly one of key_env, key, key_sha256{found}")
        return self

    @property
    def source(self) -> str:
        """Where the secret comes from, for humans; never the secret itself."""
        if self.key_env is not None:
            return f"from env {self.key_env}"
        return "sha256" if self.key_sha256 is not None else "plain"


class OrgSpec(StrictModel):
    """Per-organisation share (weight), concurrency cap and rate limits, and what its keys
    may use at most (``pools``, ``models``; None: no restriction; docs/access.md).

    ``keys_from_api`` says its keys are made through the admin API: an entry no key of the
    file uses is then expected rather than an error (a typo of another org's name).
    """

    weight: Weight = 1.0
    max_in_flight: PositiveInt | None = None
    rpm: PerMinute | None = None
    tpm: PerMinute | None = None
    pools: list[Name] | None = None
    models: list[NonEmptyStr] | None = None
    keys_from_api: bool = False
    budgets: Budgets = []  # noqa: RUF012 -- pydantic copies it per instance


@dataclass(frozen=True)
class ResolvedKey:
    """A key ready for lookup: the SHA-256 ``digest`` of the secret, never the secret."""

    index: int
    org: str
    classes: tuple[str, ...]
    digest: bytes = field(repr=False)
    # the access log's name for it: keys[i].name, else "<org>#<i>"
    name: str = field(default="", compare=False)
    pools: frozenset[str] | None = None  # the pools it may use; None: every pool
    models: frozenset[str] | None = None  # the models it may use; None: every model
    expires: float | None = None  # when it stops working (Unix time); None: never
    managed: bool = False  # made through the admin API (a store), not read from the file


DEFAULT_ORG = OrgSpec()


# what a key may use: its pools and its models, each None when unrestricted
Access = tuple[frozenset[str] | None, frozenset[str] | None]


def _meet(outer: Iterable[str] | None, inner: Iterable[str] | None) -> frozenset[str] | None:
    """The intersection of two lists of names, None standing for "no restriction"."""
    if outer is None or inner is None:
        given = inner if outer is None else outer
        return None if given is None else frozenset(given)
    return frozenset(outer) & frozenset(inner)


def effective_access(
    org: OrgSpec,
    pools: Iterable[str] | None,
    models: Iterable[str] | None,
    pool_by_model: Mapping[str, str],
) -> Access:
    """What a key of ``org`` listing ``pools`` and ``models`` may use: at each level the
    intersection of the org's list and the key's, so that a key never widens its org. The
    models are then kept to those of the allowed pools, so that ``models`` alone says what
    may be called whenever it is set (docs/access.md)."""
    allowed_pools, allowed_models = _meet(org.pools, pools), _meet(org.models, models)
    if allowed_pools is not None and allowed_models is not None:
        allowed_models = frozenset(
            m for m in allowed_models if pool_by_model.get(m) in allowed_pools
        )
    return allowed_pools, allowed_models


def usable_models(pools: Mapping[str, PoolSpec], access: Access) -> dict[str, list[str]]:
    """Each pool of ``pools`` that ``access`` reaches, with its models that it may call."""
    allowed_pools, allowed_models = access
    usable = {
        name: [m for m in spec.models if allowed_models is None or m in allowed_models]
        for name, spec in pools.items()
        if allowed_pools is None or name in allowed_pools
    }
    return {name: models for name, models in usable.items() if models}


def _check_lists(
    path: str, spec: KeySpec | OrgSpec, pools: Mapping[str, PoolSpec], served: Mapping[str, str]
) -> Errors:
    """Each pool and model ``spec`` lists exists: a typo would otherwise narrow silently."""
    errors = [
        (f"{path}.pools[{j}]", f"pool {pool!r} is not defined{did_you_mean(pool, pools)}")
        for j, pool in enumerate(spec.pools or ())
        if pool not in pools
    ]
    errors += [
        (f"{path}.models[{j}]", f"no pool serves model {model!r}{did_you_mean(model, served)}")
        for j, model in enumerate(spec.models or ())
        if model not in served
    ]
    return errors


def check_access(
    keys: Iterable[KeySpec],
    orgs: Mapping[str, OrgSpec],
    pools: Mapping[str, PoolSpec],
    served: Mapping[str, str],
) -> Errors:
    """Every list of pools and models names what exists, and every org and key can still
    call some model: an empty intersection is a key that could use nothing. Only the first
    fault is told: lists with an unknown name are not judged empty too, nor the keys of an
    org whose lists are at fault."""
    errors: Errors = []
    faulty: set[str] = set()
    for name, org in orgs.items():
        wrong = _check_lists(f"orgs.{name}", org, pools, served)
        if not wrong and not usable_models(pools, effective_access(org, None, None, served)):
            wrong = [(f"orgs.{name}", "its pools and models leave no model to use")]
        if wrong:
            errors += wrong
            faulty.add(name)
    for i, key in enumerate(keys):
        if wrong := _check_lists(f"keys[{i}]", key, pools, served):
            errors += wrong
            continue
        org = orgs.get(key.org, DEFAULT_ORG)
        usable = usable_models(pools, effective_access(org, key.pools, key.models, served))
        if not usable and key.org not in faulty:
            errors.append((
                f"keys[{i}]",
                f"could use no model: its pools and models, within those of org "
                f"{key.org!r}, leave none",
            ))  # fmt: skip
    return errors


def check_orgs(keys: Iterable[KeySpec], orgs: Mapping[str, OrgSpec]) -> Errors:
    """An ``orgs`` entry no key uses is most often a typo of the org's name, which leaves
    the real org without its caps; one whose keys come from the admin API says so."""
    used = {key.org for key in keys}
    return [
        (f"orgs.{name}", f"no key uses this org{did_you_mean(name, used) or _NO_KEY_HINT}")
        for name, org in orgs.items()
        if name not in used and not org.keys_from_api
    ]


_NO_KEY_HINT = (
    ": give a key this org, or set keys_from_api: true if its keys are made through the admin API"
)


def resolve_keys(
    keys: Iterable[KeySpec],
    environ: Mapping[str, str],
    access: Callable[[str, Iterable[str] | None, Iterable[str] | None], Access],
) -> tuple[Errors, tuple[ResolvedKey, ...]]:
    """Hash every key now, so the plain secret read from the environment is not kept.

    Values read from the environment are stripped: secrets mounted from files often
    end with a newline that no client would send. ``access`` gives each key's effective
    pools and models (:meth:`Config.key_access`).
    """
    errors: Errors = []
    resolved: list[ResolvedKey] = []
    first_index: dict[bytes, int] = {}
    named: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key.name is not None and (same := named.setdefault(key.name, i)) != i:
            errors.append((f"keys[{i}].name", f"same name as keys[{same}]"))
        if key.key_sha256 is not None:
            digest = bytes.fromhex(key.key_sha256)
        elif key.key is not None:
            digest = hashlib.sha256(key.key.get_secret_value().encode()).digest()
        else:
            secret = env_secret(environ, str(key.key_env), f"keys[{i}].key_env", errors)
            if not secret:
                continue
            digest = hashlib.sha256(secret.encode()).digest()
        first = first_index.setdefault(digest, i)
        if first != i:
            errors.append((f"keys[{i}]", f"duplicates the key of keys[{first}]"))
        name = key.name or f"{key.org}#{i}"
        pools, models = access(key.org, key.pools, key.models)
        resolved.append(ResolvedKey(i, key.org, tuple(key.classes), digest, name, pools, models))
    return errors, tuple(resolved)


def env_secret(environ: Mapping[str, str], name: str, path: str, errors: Errors) -> str:
    """The stripped value of ``name``, or "" after recording why it is unusable at ``path``."""
    secret = environ.get(name, "").strip()
    if not secret:
        state = "is empty" if name in environ else "is not set"
        errors.append((path, f"environment variable {name} {state}"))
    return secret
