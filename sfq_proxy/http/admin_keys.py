"""The admin API's keys (docs/keys.md): create (the secret shown once), list, update, revoke.

Every route is behind the admin key (``app._admin``). The file's keys are listed too, as
``source: config``, and are read-only here: they change by editing the config. A secret
exists only in the answer to its create; the store, the logs and every list hold its
SHA-256 digest or the id made from it. Each key is listed with what it may use in fact
(``access``: its classes the config still has, its lists met with its org's) and its
``status`` (active, expired, revoked, or inactive: not in force here): the page shows
those, not only what the key itself lists.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from ..config import Config, ResolvedKey
from ..core.errors import ApiError
from ..core.keys import KeyRecord, budget_json, changed_record, in_force, new_record
from ..state.key_store import KeyStore, unavailable, usage_times
from .proxy import Proxy

SECRET_PREFIX = "sk-sfq-"
MAX_BODY_BYTES = 64 * 1024
AdminHandler = Callable[[Proxy, web.Request], Awaitable[web.StreamResponse]]


async def list_keys(proxy: Proxy, request: web.Request) -> web.Response:
    """Every key, the file's first; never a secret or a digest."""
    used, now = proxy.auth.last_used, proxy.wall()
    keys = [
        _file_key(proxy, key, used.get(key.digest), now) for key in proxy.config.resolved_keys()
    ]
    if proxy.keys is not None:
        times = await _last_used(proxy.keys, proxy.auth.last_used)
        keys += [
            _api_key(proxy.config, record, times.get(record.id), now)
            for record in _sorted(proxy.keys)
        ]
    return web.json_response({"keys": keys})


async def create_key(proxy: Proxy, request: web.Request) -> web.Response:
    """A new key; its secret is in this answer and nowhere else, ever."""
    store = _store(proxy)
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    digest = hashlib.sha256(secret.encode()).digest()
    body = await _body(request)
    record = new_record(body, proxy.config, store.records, digest, proxy.wall())
    await store.create(record)
    key = _api_key(proxy.config, record, None, proxy.wall())
    return web.json_response({"key": key, "secret": secret}, status=201)


async def update_key(proxy: Proxy, request: web.Request) -> web.Response:
    store, record = await _found(proxy, request.match_info["id"])
    body = await _body(request)
    changed = changed_record(record, body, proxy.config, store.records, proxy.wall())
    await store.update(changed)
    times = await _last_used(store, proxy.auth.last_used)
    return web.json_response(
        {"key": _api_key(proxy.config, changed, times.get(changed.id), proxy.wall())}
    )


async def revoke_key(proxy: Proxy, request: web.Request) -> web.Response:
    """The key stops working for this process's next request (applied before answering),
    and within milliseconds on the others sharing its Redis (docs/keys.md)."""
    store, record = await _found(proxy, request.match_info["id"])
    if not await store.revoke(record.id, proxy.wall()):
        raise _not_found(record.id)
    return web.json_response({"revoked": record.id})


ROUTES: list[tuple[str, str, AdminHandler]] = [
    ("GET", "/admin/keys", list_keys),
    ("POST", "/admin/keys", create_key),
    ("PATCH", "/admin/keys/{id}", update_key),
    ("DELETE", "/admin/keys/{id}", revoke_key),
]


def _store(proxy: Proxy) -> KeyStore:
    if proxy.keys is None:
        raise ApiError(
            409,
            "Keys cannot be made through the API: this proxy has no key store. Set "
            "key_store_file in the config (or state: redis, where Redis keeps them).",
            code="key_store_off",
        )
    return proxy.keys


async def _found(proxy: Proxy, key_id: str) -> tuple[KeyStore, KeyRecord]:
    """The store and the key ``key_id`` names: a file's key is read-only (409); one made a
    moment ago on another process is looked for once more in the store before a 404."""
    if any(key.name == key_id for key in proxy.config.resolved_keys()):
        raise ApiError(
            409,
            f"Key {key_id} is defined in the config file: edit the file (and reload) to "
            "change or remove it.",
            code="read_only",
        )
    store = _store(proxy)
    if key_id not in store.records:
        try:
            await store.refresh()
        except RedisError as err:
            raise unavailable(f"Redis: {err}") from None
    record = store.records.get(key_id)
    if record is None:
        raise _not_found(key_id)
    if record.revoked is not None:
        raise ApiError(404, f"No key {key_id}: it was revoked.", code="key_not_found")
    return store, record


def _not_found(key_id: str) -> ApiError:
    return ApiError(404, f"No key {key_id[:64]!r}.", code="key_not_found")


async def _body(request: web.Request) -> bytes:
    """The request's body, small as a key's fields are."""
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise ApiError(413, f"A key's fields fit in {MAX_BODY_BYTES} bytes.")
    body = await request.content.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, f"A key's fields fit in {MAX_BODY_BYTES} bytes.")
    return body


async def _last_used(store: KeyStore, used: Mapping[bytes, float]) -> dict[str, float]:
    """When each of the store's keys was last used: what was written (by any process, with
    Redis), or what this process saw since, whichever is later."""
    times = await store.last_used()
    for key_id, when in usage_times(store, used).items():
        times[key_id] = max(when, times.get(key_id, when))
    return times


def _sorted(store: KeyStore) -> list[KeyRecord]:
    return sorted(store.records.values(), key=lambda record: (record.created, record.id))


def _api_key(
    config: Config, record: KeyRecord, last_used: float | None, now: float
) -> dict[str, Any]:
    """A key of the API's; ``classes``, ``pools`` and ``models`` as it lists them,
    ``access`` as ``config`` resolves them."""
    pools, models = config.key_access(record.org, record.pools, record.models)
    classes = tuple(cls for cls in record.classes if cls in config.classes)
    working = bool(in_force([record], config))
    return {
        "id": record.id,
        "alias": record.alias,
        "org": record.org,
        "classes": list(record.classes),
        "pools": _names(record.pools),
        "models": _names(record.models),
        "access": _access(classes, pools, models),
        "status": _status(record.expires, record.revoked, now, working=working),
        "created": _iso(record.created),
        "expires": _iso(record.expires),
        "revoked": _iso(record.revoked),
        "last_used": _iso(last_used),
        "source": "api",
        "budgets": [budget_json(budget) for budget in record.budgets],
    }


def _file_key(
    proxy: Proxy, key: ResolvedKey, last_used: float | None, now: float
) -> dict[str, Any]:
    """A key of the file as its entry lists it, and what it may use in fact (``access``,
    resolved when the file was read); ``last_used``: this process's own view."""
    spec = proxy.config.keys[key.index]
    return {
        "id": key.name,
        "alias": key.name,
        "org": key.org,
        "classes": list(key.classes),
        "pools": _names(spec.pools),
        "models": _names(spec.models),
        "access": _access(key.classes, key.pools, key.models),
        "status": _status(key.expires, None, now),
        "created": None,
        "expires": _iso(key.expires),
        "revoked": None,
        "last_used": _iso(last_used),
        "source": "config",
        "budgets": [budget_json(budget) for budget in spec.budgets],
    }


def _names(names: tuple[str, ...] | list[str] | None) -> list[str] | None:
    return None if names is None else list(names)


def _access(
    classes: tuple[str, ...], pools: frozenset[str] | None, models: frozenset[str] | None
) -> dict[str, Any]:
    """The classes, pools and models a key may use in fact (None: every one), the latter
    sorted."""
    return {"classes": list(classes), "pools": None if pools is None else sorted(pools),
            "models": None if models is None else sorted(models)}  # fmt: skip


def _status(
    expires: float | None, revoked: float | None, now: float, *, working: bool = True
) -> str:
    """Whether a key works: ``revoked``; ``inactive`` (not ``working``: not in force here,
    its classes all removed by a reload, or its alias a name of this process's file);
    ``expired`` (as the authenticator judges it); else ``active``."""
    if revoked is not None:
        return "revoked"
    if not working:
        return "inactive"
    return "expired" if expires is not None and now >= expires else "active"


def _iso(when: float | None) -> str | None:
    """A Unix time as ISO-8601 in UTC, to the second."""
    if when is None:
        return None
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
