"""Keys made through the admin API (docs/keys.md): their record, the checks of a request that
creates or changes one, and the :class:`ResolvedKey` the :class:`Authenticator` looks up.

Sans-I/O: times are Unix seconds the caller passes; the secret is made by the shell, and
only its SHA-256 digest ever reaches a record. A request is checked against the config by
the same rules as the file's keys (:meth:`Config.api_key_errors`), so an API key can grant
nothing a key in the file could not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import AwareDatetime, Field, StringConstraints, ValidationError

from ..config import (
    NAME_PATTERN,
    Budgets,
    BudgetSpec,
    Config,
    ConfigError,
    KeySpec,
    ResolvedKey,
    StrictModel,
    config_error,
)
from .errors import ApiError, cut

ID_PREFIX = "k_"
MAX_LIFETIME_S = 10 * 365 * 86_400  # expires_in_s at most: ten years
MAX_ALIAS = 64
# how long a revoked key stays listed (marked revoked) before its store forgets it
REVOKED_KEPT_S = 30 * 86_400
LATEST = 253_402_300_799.0  # 9999-12-31T23:59:59Z: every time a store holds can be written out
_Time = Annotated[float, Field(ge=0, le=LATEST, allow_inf_nan=False)]
_Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN, max_length=MAX_ALIAS)]
_Model = Annotated[str, StringConstraints(min_length=1, max_length=256)]
_Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


@dataclass(frozen=True)
class KeyRecord:
    """A key of the admin API as its store keeps it: everything but the secret."""

    id: str
    alias: str
    org: str
    classes: tuple[str, ...]
    pools: tuple[str, ...] | None
    models: tuple[str, ...] | None
    created: float
    expires: float | None
    digest: bytes = field(repr=False)
    budgets: tuple[BudgetSpec, ...] = ()  # counted under its alias (docs/usage-and-budgets.md)
    # when it was revoked (Unix time): it works no more and is only listed, marked so, for
    # ``REVOKED_KEPT_S``; its alias is free for a new key. Kept by the store beside the
    # record (as ``last_used`` is), never in it
    revoked: float | None = None


def key_id(digest: bytes) -> str:
    """A key's public name: ``k_`` and the first 12 hex digits of its digest, enough to tell
    keys apart and far too few to find the key from."""
    return ID_PREFIX + digest.hex()[:12]


class _Fields(StrictModel):
    """A create or update request's body; on an update, a field left out is unchanged and
    ``null`` clears ``pools``, ``models``, ``budgets`` or the expiry."""

    alias: _Name | None = None
    org: _Name | None = None
    classes: list[_Name] | None = Field(None, min_length=1, max_length=32)
    pools: list[_Name] | None = Field(None, max_length=256)
    models: list[_Model] | None = Field(None, max_length=1024)
    expires_at: AwareDatetime | None = None
    expires_in_s: float | None = Field(None, gt=0, le=MAX_LIFETIME_S, allow_inf_nan=False)
    budgets: Budgets | None = None


def new_record(
    body: bytes, config: Config, records: Mapping[str, KeyRecord], digest: bytes, now: float
) -> KeyRecord:
    """The record a create request (JSON ``body``) asks for, or a 400 naming the field.

    ``classes`` defaults to the config's fair-queued classes (the first is the key's
    default class): a priority class is only ever granted on purpose."""
    fields = _parse(body)
    missing = [(name, "required") for name in ("alias", "org") if getattr(fields, name) is None]
    if missing:
        raise _invalid(missing)
    default = tuple(name for name, spec in config.classes.items() if not spec.priority)
    draft = KeyRecord(
        id=key_id(digest), alias=str(fields.alias), org=str(fields.org), classes=default,
        pools=None, models=None, created=now, expires=None, digest=digest,
    )  # fmt: skip
    return _checked(_applied(draft, fields, now), config, records)


def changed_record(
    record: KeyRecord, body: bytes, config: Config, records: Mapping[str, KeyRecord], now: float
) -> KeyRecord:
    """``record`` as an update request (JSON ``body``) changes it, or a 400 naming the field."""
    return _checked(_applied(record, _parse(body), now), config, records)


def _parse(body: bytes) -> _Fields:
    try:
        return _Fields.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(config_error(exc, "request").errors) from None


def _applied(record: KeyRecord, fields: _Fields, now: float) -> KeyRecord:
    """``record`` with what ``fields`` sets (``pools``, ``models``, ``budgets`` and the
    expiry may be set to null; the other fields may not)."""
    given = fields.model_fields_set
    required = ("alias", "org", "classes")
    nulls = [(n, "must not be null") for n in required if n in given and getattr(fields, n) is None]
    if {"expires_at", "expires_in_s"} <= given:
        nulls.append(("expires_in_s", "give expires_at or expires_in_s, not both"))
    if nulls:
        raise _invalid(nulls)
    changes: dict[str, Any] = {
        name: getattr(fields, name) for name in ("alias", "org") if name in given
    }
    for name in ("classes", "pools", "models"):
        if name in given:
            value = getattr(fields, name)
            changes[name] = None if value is None else tuple(value)
    if "budgets" in given:
        changes["budgets"] = tuple(fields.budgets or ())
    if "expires_at" in given:
        at = fields.expires_at
        changes["expires"] = None if at is None else at.timestamp()
        if at is not None and not now < at.timestamp() <= LATEST:
            raise _invalid([("expires_at", "must be in the future, before the year 10000")])
    elif fields.expires_in_s is not None:
        changes["expires"] = now + fields.expires_in_s
    return replace(record, **changes)


def _checked(record: KeyRecord, config: Config, records: Mapping[str, KeyRecord]) -> KeyRecord:
    """``record`` if the config could hold it as a key of its own file, and its alias is no
    other key's name (the file's or the API's), else a 400 naming the field."""
    spec = KeySpec(
        key_sha256=record.digest.hex(), org=record.org, classes=list(record.classes),
        pools=None if record.pools is None else list(record.pools),
        models=None if record.models is None else list(record.models),
        budgets=list(record.budgets),
    )  # fmt: skip
    errors = config.api_key_errors(spec)
    taken = {key.name for key in config.resolved_keys()}
    taken |= {other.alias for other in live(records.values()) if other.id != record.id}
    if record.alias in taken:
        errors.append(("alias", "another key has this name or alias"))
    if errors:
        raise _invalid(errors)
    return record


def _invalid(errors: Iterable[tuple[str, str]]) -> ApiError:
    # a path may name a field the request made up: quoted through ``cut``
    message = "; ".join(f"{cut(path)}: {text}" if path else text for path, text in errors)
    return ApiError(400, f"Invalid key: {message}", code="invalid_request")


def resolved(record: KeyRecord, config: Config) -> ResolvedKey | None:
    """What the :class:`Authenticator` looks ``record`` up as under ``config``: its access
    within its org's (``Config.key_access``), its classes those the config still defines
    (None when none is left: a reload removed them)."""
    classes = tuple(cls for cls in record.classes if cls in config.classes)
    if not classes:
        return None
    pools, models = config.key_access(record.org, record.pools, record.models)
    return ResolvedKey(
        index=-1, org=record.org, classes=classes, digest=record.digest, name=record.alias,
        pools=pools, models=models, expires=record.expires, managed=True,
    )  # fmt: skip


def in_force(records: Iterable[KeyRecord], config: Config) -> list[tuple[KeyRecord, ResolvedKey]]:
    """The records that work under ``config``, each with what it is looked up as. Not one
    whose classes a reload removed, nor one whose alias names a key of the file (a config
    rolled out to some of the replicas on a Redis only, see :func:`clashes`): usage and
    budgets count by name, and the two would share them."""
    names = {key.name for key in config.resolved_keys()}
    found = ((r, resolved(r, config)) for r in live(records) if r.alias not in names)
    return [(record, key) for record, key in found if key is not None]


def live(records: Iterable[KeyRecord]) -> list[KeyRecord]:
    """The records not revoked (a revoked one is only listed)."""
    return [record for record in records if record.revoked is None]


def clashes(config: Config, records: Iterable[KeyRecord]) -> ConfigError | None:
    """A config that names a key of its file like an API key's alias cannot be loaded: the
    access log and ``/admin/keys`` would not tell them apart. None when it can."""
    aliases = {record.alias: record.id for record in live(records)}
    errors = [
        (f"keys[{i}].name", f"is the alias of key {aliases[key.name]} of the admin API")
        for i, key in enumerate(config.keys)
        if key.name in aliases
    ]
    return ConfigError(errors) if errors else None


class _Stored(StrictModel):
    """A record as a store holds it (JSON): the digest in hex."""

    id: str
    alias: _Name
    org: _Name
    classes: list[_Name] = Field(min_length=1)
    pools: list[_Name] | None
    models: list[_Model] | None
    created: _Time
    expires: _Time | None
    digest: _Digest
    budgets: Budgets = Field(default_factory=list)  # none in older stores


def record_to_json(record: KeyRecord) -> dict[str, Any]:
    """What a store writes for ``record``: never a secret, only its digest."""
    return {
        "id": record.id, "alias": record.alias, "org": record.org,
        "classes": list(record.classes),
        "pools": None if record.pools is None else list(record.pools),
        "models": None if record.models is None else list(record.models),
        "created": record.created, "expires": record.expires, "digest": record.digest.hex(),
        "budgets": [budget_json(budget) for budget in record.budgets],
    }  # fmt: skip


def budget_json(budget: BudgetSpec) -> dict[str, Any]:
    """A budget as the stores and the admin API write it: its unit, not the other's null."""
    return budget.model_dump(exclude_none=True)


def record_from_json(data: Any) -> KeyRecord:
    """The record a store read back; ValueError (its path, never a value) when malformed."""
    try:
        stored = _Stored.model_validate(data)
    except ValidationError as exc:
        raise ValueError(str(config_error(exc, "store"))) from None
    digest = bytes.fromhex(stored.digest)
    if stored.id != key_id(digest):
        raise ValueError("id: does not match the digest")
    return KeyRecord(
        id=stored.id, alias=stored.alias, org=stored.org, classes=tuple(stored.classes),
        pools=None if stored.pools is None else tuple(stored.pools),
        models=None if stored.models is None else tuple(stored.models),
        created=stored.created, expires=stored.expires, digest=digest,
        budgets=tuple(stored.budgets),
    )  # fmt: skip
