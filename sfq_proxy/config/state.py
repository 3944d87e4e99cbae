"""The ``state:`` section: the dispatch state that every process and replica of one
fairness domain shares in Redis (standalone, behind Sentinel, or a Cluster;
docs/shared-state.md), and what a config must keep to for it (charges Redis's Lua numbers
count exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from .classes import ClassSpec
from .errors import Errors
from .fields import NonEmptyStr, StrictModel
from .keys import OrgSpec
from .pools import PoolSpec


class SentinelSpec(StrictModel):
    """Redis behind Sentinel: the sentinels to ask (``host:port``) for the primary of
    ``service``; its password, if any, from the environment variable ``password_env``."""

    hosts: list[NonEmptyStr] = Field(min_length=1)
    service: NonEmptyStr
    password_env: NonEmptyStr | None = None

    @field_validator("hosts")
    @classmethod
    def _host_port(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            name, _, port = host.rpartition(":")
            if not name or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{host!r} is not host:port")
        return hosts


class RedisState(StrictModel):
    """The dispatch state of every pool shared in Redis: processes and replicas pointing at
    one Redis form one fairness domain (docs/shared-state.md).

    ``redis`` is a redis-py URL (``redis://``, ``rediss://`` with TLS, ``unix://``), or the
    name of an environment variable holding it in ``redis_env`` (a URL may carry a
    password), or ``sentinel`` names the sentinels of a replicated Redis. ``cluster``
    connects to a Redis Cluster through the URL's node. A process whose
    heartbeat has not renewed its leases for ``lease_ttl_s`` loses them: Redis gives its
    slots and queued requests back, and the process stops what it ran under them.

    ``when_unreachable`` says what a process does while it cannot reach Redis:
    ``fail_closed`` refuses requests (503 with Retry-After, ``/readyz`` failing) and, after
    a TTL, ends what it runs; ``local`` schedules on its own, each backend's slots divided
    evenly among the replicas that were alive, and joins the shared state again when Redis
    is back (docs/shared-state.md, "When Redis is lost").
    """

    redis: NonEmptyStr | None = None
    redis_env: NonEmptyStr | None = None
    sentinel: SentinelSpec | None = None
    cluster: bool = False
    lease_ttl_s: float = Field(5.0, ge=0.5, le=300, allow_inf_nan=False)
    when_unreachable: Literal["fail_closed", "local"] = "fail_closed"

    @model_validator(mode="after")
    def _one_url(self) -> Self:
        if sum(x is not None for x in (self.redis, self.redis_env, self.sentinel)) != 1:
            raise ValueError("set exactly one of redis (a URL), redis_env or sentinel")
        if self.sentinel is not None and self.cluster:
            raise ValueError("a Sentinel-managed Redis is not a cluster")
        return self

    @property
    def heartbeat_s(self) -> float:
        """A third of the TTL: two heartbeats may be lost before a lease expires."""
        return self.lease_ttl_s / 3


# Redis's Lua numbers are doubles: meters stay exact integers while one charge (c_max over the
# smallest flow weight, in units of 2^-20) stays below 2^51 (dispatch.lua)
_SHARED_MAX_CHARGE = 2.0**31


def check_shared(
    pools: Mapping[str, PoolSpec], classes: Mapping[str, ClassSpec], orgs: Mapping[str, OrgSpec]
) -> Errors:
    """What the shared state needs: charges its Lua can count exactly. (A provider pool's
    rate is paced in Redis too, so every replica shares it: state/dispatch.lua.)"""
    weights = [c.weight for c in classes.values() if not c.priority] or [1.0]
    smallest = min(weights) * min([1.0, *(o.weight for o in orgs.values())])
    errors: Errors = []
    for name, pool in pools.items():
        cost = pool.cost
        largest = max(cost.input_weight, cost.output_weight) * cost.max_request_tokens
        if largest / smallest > _SHARED_MAX_CHARGE:
            errors.append((
                f"pools.{name}.cost.max_request_tokens",
                f"with state: redis, c_max ({largest:g}) over the smallest flow weight "
                f"({smallest:g}) must stay below 2^31: lower it, or raise that weight",
            ))  # fmt: skip
    return errors
