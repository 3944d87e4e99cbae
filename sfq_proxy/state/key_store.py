"""Where the admin API's keys persist (docs/keys.md): a JSON file the proxy owns in memory
mode (``key_store_file``), or Redis when the state is shared.

Each store holds a snapshot, ``records`` (id → :class:`KeyRecord`), which the
:class:`~sfq_proxy.core.flows.Authenticator` is built from: a request never waits on the
store. A change is written first and applied to the snapshot before the admin API answers,
so the next request to this process sees it; other processes on the same Redis hear of it
on a channel, and re-read the version counter every ``poll_s`` in case a message was lost.
Only digests are stored, never a secret. ``last_used`` times are written now and then
(``Proxy`` flushes them every ``LAST_USED_SAVE_S`` and at shutdown), not per request.

A revoked key's record moves out of the keys in force, with the time it was revoked, and
stays there for ``REVOKED_KEPT_S`` (the list marks it); a revocation forgets those older
than that. Out, not marked in place: during a rolling update a replica of an older version
shares the Redis (or, rolled back, reads the file), and it takes every record it finds
among the keys for a key in force.
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from ..config import ConfigError
from ..core.errors import ApiError
from ..core.keys import (
    LATEST,
    REVOKED_KEPT_S,
    KeyRecord,
    live,
    record_from_json,
    record_to_json,
)
from .atomic_file import write_atomically

log = logging.getLogger(__name__)
LAST_USED_SAVE_S = 60.0
POLL_MAX_S = 2.0  # the safety net's period at most, whatever lease_ttl_s is
# every key under one hash tag: one slot of a Redis Cluster, so one script can touch them all
BY_ID, VERSION, USED = "sfq:{keys}:by_id", "sfq:{keys}:version", "sfq:{keys}:last_used"
REVOKED = "sfq:{keys}:revoked"  # id → {"revoked": when, "key": its record}
CHANNEL = "sfq:{keys}:changed"
_ABSENT, _PRESENT, _ALIAS_TAKEN = -1, -2, -3

_PUT = """
local exists = redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1
if ARGV[4] == 'new' and (exists or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1) then
  return -2
end
if ARGV[4] == 'old' and not exists then return -1 end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] and cjson.decode(all[i + 1]).alias == ARGV[3] then return -3 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local version = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', ARGV[5], version)
return version
"""
# the record moves as it was written (cjson would turn an empty list into an object)
_REVOKE = """
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record then return -1 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], '{"revoked": ' .. ARGV[3] .. ', "key": ' .. record .. '}')
local revoked = redis.call('HGETALL', KEYS[4])
for i = 1, #revoked, 2 do
  if cjson.decode(revoked[i + 1]).revoked < tonumber(ARGV[4]) then
    redis.call('HDEL', KEYS[3], revoked[i])
    redis.call('HDEL', KEYS[4], revoked[i])
  end
end
local version = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', ARGV[2], version)
return version
"""
_SNAPSHOT = """
return {redis.call('GET', KEYS[2]) or '0', redis.call('HGETALL', KEYS[1]),
        redis.call('HGETALL', KEYS[3])}
"""
_USED = """
for i = 1, #ARGV, 2 do
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > old and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return 0
"""


class KeyStore(ABC):
    """What both stores share: the snapshot, and telling the proxy it changed."""

    def __init__(self) -> None:
        self.records: dict[str, KeyRecord] = {}
        self.on_change: Callable[[], None] = lambda: None

    @abstractmethod
    async def start(self) -> None:
        """Read what the store holds before the first request."""

    @abstractmethod
    async def follow(self) -> None:
        """Keep the snapshot up to date with other processes' changes (Redis only)."""

    @abstractmethod
    async def create(self, record: KeyRecord) -> None:
        """Add ``record``, whose id and alias no other key has."""

    @abstractmethod
    async def update(self, record: KeyRecord) -> None:
        """Replace the key of ``record.id`` by ``record``."""

    @abstractmethod
    async def revoke(self, key_id: str, now: float) -> bool:
        """Revoke a key at ``now`` (Unix time); False when the store has no such key in
        force. Those revoked more than ``REVOKED_KEPT_S`` ago are forgotten."""

    @abstractmethod
    async def refresh(self) -> None:
        """Read the store again (another process may have made the key asked for)."""

    @abstractmethod
    async def last_used(self) -> dict[str, float]:
        """The ``last_used`` times written so far, by key id."""

    @abstractmethod
    async def save_last_used(self, times: Mapping[str, float]) -> None:
        """Keep the later of each written time and ``times`` (by key id)."""

    def _apply(self, records: dict[str, KeyRecord]) -> None:
        self.records = records
        self.on_change()


def _raise_if_cancelled() -> None:
    """A cancellation redis-py swallowed is raised again: a call cancelled at the wrong
    instant can return normally (redis/redis-py#2028), and the loop that made it would go
    on for good, though its task still counts the cancellation (``cancelling()``)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def unavailable(what: str) -> ApiError:
    return ApiError(
        503, f"The key store is unavailable ({what}); nothing changed.",
        code="key_store_unavailable", retry_after=1,
    )  # fmt: skip


class FileKeyStore(KeyStore):
    """The keys in a JSON file, replaced atomically at each change (mode 0600: it holds
    digests, which are no secret, but nothing else needs to read it). A missing file is no
    key yet; one that cannot be read is a configuration error, as a bad config is: starting
    without the keys would refuse every client the API made a key for."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._used: dict[str, float] = {}
        if not path.parent.is_dir():  # found now, not at the first key made
            message = f"the directory of {path} does not exist"
            raise ConfigError([("key_store_file", message)])
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError([("key_store_file", f"cannot read {path}: {err}")]) from None
        try:
            self.records, self._used = _decode(text)
        except (ValueError, RecursionError) as err:
            message = f"{path} is not a key store this proxy wrote ({err}): fix or move it"
            raise ConfigError([("key_store_file", message)]) from None

    async def start(self) -> None:
        """Nothing more to read: the file was read when the proxy was built."""

    async def follow(self) -> None:
        """Nothing to follow: this process is the file's only writer."""

    async def refresh(self) -> None:
        """The snapshot is the file: every change went through this process."""

    async def create(self, record: KeyRecord) -> None:
        self._write({**self.records, record.id: record}, self._used)

    async def update(self, record: KeyRecord) -> None:
        self._write({**self.records, record.id: record}, self._used)

    async def revoke(self, key_id: str, now: float) -> bool:
        record = self.records.get(key_id)
        if record is None or record.revoked is not None:
            return False
        records = _unforgotten(self.records, now - REVOKED_KEPT_S)
        records[key_id] = replace(record, revoked=now)
        self._write(records, {i: t for i, t in self._used.items() if i in records})
        return True

    async def last_used(self) -> dict[str, float]:
        return dict(self._used)

    async def save_last_used(self, times: Mapping[str, float]) -> None:
        used = _later(self._used, times, self.records)
        if used != self._used:
            self._write(self.records, used)

    def _write(self, records: dict[str, KeyRecord], used: dict[str, float]) -> None:
        """Replace the file, then the snapshot: a failed write changes nothing."""
        data: dict[str, Any] = {
            "keys": [record_to_json(r) for r in live(records.values())],
            "last_used": used,
        }
        if revoked := [revoked_to_json(r) for r in records.values() if r.revoked is not None]:
            data["revoked"] = revoked  # absent when none: an older version reads the file
        try:
            write_atomically(self.path, json.dumps(data, allow_nan=False, indent=1), 0o600)
        except OSError as err:
            log.warning("cannot write the key store %s: %s", self.path, err)
            raise unavailable(f"cannot write {self.path.name}") from None
        self._used = used
        self._apply(records)


def _decode(text: str) -> tuple[dict[str, KeyRecord], dict[str, float]]:
    data = json.loads(text)
    if not isinstance(data, dict) or not {"keys", "last_used"} <= set(data) <= _FILE_FIELDS:
        raise ValueError("expected an object with keys, last_used (and revoked)")
    records = {}
    for field, read in (("keys", record_from_json), ("revoked", revoked_from_json)):
        items = data.get(field, [])  # no revoked: none
        if not isinstance(items, list):
            raise ValueError(f"{field} must be a list")
        for i, item in enumerate(items):
            try:
                record = read(item)
            except ValueError as err:
                raise ValueError(f"{field}[{i}]: {err}") from None
            records[record.id] = record
    used = data["last_used"]
    if not isinstance(used, dict) or not all(map(_is_time, used.values())):
        raise ValueError("last_used must map key ids to numbers")
    return records, {i: float(t) for i, t in used.items() if i in records}


_FILE_FIELDS = {"keys", "last_used", "revoked"}


def revoked_to_json(record: KeyRecord) -> dict[str, Any]:
    """A revoked key as a store keeps it, apart from the keys in force."""
    return {"revoked": record.revoked, "key": record_to_json(record)}


def revoked_from_json(data: Any) -> KeyRecord:
    """The revoked key a store read back; ValueError (its path) when malformed."""
    if not isinstance(data, dict) or set(data) != {"revoked", "key"}:
        raise ValueError("expected an object with revoked and key")
    if not _is_time(data["revoked"]):
        raise ValueError("revoked: must be a time")
    return replace(record_from_json(data["key"]), revoked=float(data["revoked"]))


def _is_time(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= LATEST


def _unforgotten(records: Mapping[str, KeyRecord], forget: float) -> dict[str, KeyRecord]:
    """``records`` but those revoked before ``forget``."""
    return {i: r for i, r in records.items() if r.revoked is None or r.revoked >= forget}


def _later(
    old: Mapping[str, float], new: Mapping[str, float], records: Mapping[str, KeyRecord]
) -> dict[str, float]:
    """Each key's later time of ``old`` and ``new``, for keys that still exist."""
    merged = dict(old)
    for key_id, when in new.items():
        if key_id in records and when > merged.get(key_id, float("-inf")):
            merged[key_id] = when
    return merged


class RedisKeyStore(KeyStore):
    """The keys in Redis (one hash, field id → JSON record), a version counter bumped and
    published by the script that makes each change, so that every process sees it."""

    def __init__(self, redis: Redis | RedisCluster, poll_s: float) -> None:
        super().__init__()
        self.redis = redis
        self.poll_s = poll_s
        self.version = -1

    async def start(self) -> None:
        try:
            await self.refresh()
        except RedisError as err:
            raise ConfigError([("state", f"cannot read the keys from Redis: {err}")]) from err

    async def create(self, record: KeyRecord) -> None:
        await self._put(record, "new")

    async def update(self, record: KeyRecord) -> None:
        await self._put(record, "old")

    async def revoke(self, key_id: str, now: float) -> bool:
        keys, forget = [BY_ID, VERSION, USED, REVOKED], now - REVOKED_KEPT_S
        done = await self._call(_REVOKE, keys, [key_id, CHANNEL, repr(now), repr(forget)])
        if done == _ABSENT:
            return False
        records = _unforgotten(self.records, forget)
        if key_id in records:
            records[key_id] = replace(records[key_id], revoked=now)
        self._applied(records, done)
        return True

    async def refresh(self) -> None:
        version, fields, revoked = await self.redis.eval(_SNAPSHOT, 3, BY_ID, VERSION, REVOKED)
        version = int(version)
        if version < self.version:  # a later snapshot was applied meanwhile
            return
        records = _read(fields, record_from_json)
        records.update(_read(revoked, revoked_from_json))  # none is in both; if so, revoked
        self.version = version
        self._apply(records)

    async def follow(self) -> None:
        """Re-read the keys whenever another process publishes a change, and every
        ``poll_s`` when the version moved without a message (one lost while Redis was
        away); Redis unreachable: the snapshot stays as it was, and it tries again."""
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    await self.refresh()  # what changed before the subscription
                    while True:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=self.poll_s
                        )
                        if message is not None or await self._moved():
                            await self.refresh()
                        _raise_if_cancelled()
            except (RedisError, OSError) as err:
                log.warning("key store: Redis unreachable (%s); keys as last read", err)
                await asyncio.sleep(self.poll_s)

    async def last_used(self) -> dict[str, float]:
        try:
            times = await self.redis.hgetall(USED)
        except RedisError as err:
            raise unavailable(f"Redis: {err}") from None
        return {_text(i): float(t) for i, t in times.items()}

    async def save_last_used(self, times: Mapping[str, float]) -> None:
        args = [str(part) for item in times.items() for part in item]
        if args:
            await self.redis.eval(_USED, 2, USED, BY_ID, *args)

    async def _moved(self) -> bool:
        version = await self.redis.get(VERSION)
        return int(version or 0) != self.version

    async def _put(self, record: KeyRecord, must: str) -> None:
        data = json.dumps(record_to_json(record), allow_nan=False)
        done = await self._call(
            _PUT, [BY_ID, VERSION, REVOKED], [record.id, data, record.alias, must, CHANNEL]
        )
        if done == _ALIAS_TAKEN:
            raise ApiError(400, "Invalid key: alias: another key has this name or alias")
        if done == _ABSENT:
            raise ApiError(404, f"No key {record.id}: it was revoked.", code="key_not_found")
        if done == _PRESENT:
            raise ApiError(409, f"Key {record.id} exists already.")
        self._applied({**self.records, record.id: record}, done)

    async def _call(self, script: str, keys: list[str], args: list[str]) -> int:
        """Run a change's script: the version it made, or why it made none (< 0)."""
        try:
            return int(await self.redis.eval(script, len(keys), *keys, *args))
        except RedisError as err:
            log.warning("key store: Redis unreachable: %s", err)
            raise unavailable(f"Redis: {err}") from None

    def _applied(self, records: dict[str, KeyRecord], version: int) -> None:
        """This process's own change, applied before the admin API answers (no round trip).
        When it follows the snapshot's version directly, a snapshot read before it is not
        applied over it; else the version stays, and the next look reads every change."""
        if version == self.version + 1:
            self.version = version
        self._apply(records)


def _read(fields: list[Any], read: Callable[[Any], KeyRecord]) -> dict[str, KeyRecord]:
    """The records of a hash's ``HGETALL`` (id, JSON, …), each as ``read`` makes it."""
    records = {}
    for i in range(1, len(fields), 2):
        try:
            record = read(json.loads(fields[i]))
        except (ValueError, RecursionError) as err:  # one bad entry must not hide the rest
            log.warning("key store: skipping a malformed key in Redis: %s", err)
            continue
        records[record.id] = record
    return records


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def usage_times(store: KeyStore, used: Mapping[bytes, float]) -> dict[str, float]:
    """The ``last_used`` times of ``store``'s keys among ``used`` (by digest), by key id."""
    by_digest = {record.digest: record.id for record in store.records.values()}
    return {by_digest[d]: t for d, t in used.items() if d in by_digest}
