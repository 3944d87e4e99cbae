"""The root of the file, :class:`Config`, and the small sections of the process as a whole:
``listen``, ``retry``, ``calibration``, ``metrics``, and the single keys ``admin_key_env``,
``metrics_key_env``, ``drain_timeout_s`` and ``key_store_file`` (``tracing`` has a module of
its own).

``Config`` is where the sections meet: its validation runs every check across sections and
reads the secrets from the environment, and it answers what the rest of the proxy asks of
the config per request (``pool_for_model``, ``flow_weight``, ``org``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any, Self

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from .classes import (
    ENGINE_PRIORITY_FAMILIES,
    ClassSpec,
    check_key_classes,
    check_priority_band,
    check_size_buckets,
    default_classes,
)
from .errors import ConfigError, Errors
from .fields import Name, NonEmptyStr, NonNegativeSeconds, PositiveInt, Seconds, StrictModel
from .keys import (
    DEFAULT_ORG,
    Access,
    KeySpec,
    OrgSpec,
    ResolvedKey,
    check_access,
    check_orgs,
    effective_access,
    env_secret,
    resolve_keys,
)
from .limits import Limits
from .pools import (
    AffinitySpec,
    PoolSpec,
    check_backends,
    check_continuous_usage,
    check_extra_paths,
    check_models,
)
from .state import RedisState, check_shared
from .tracing import TracingSpec, tracing_headers
from .usage import UsageSpec


class Listen(StrictModel):
    """Address of the proxy's HTTP front end. Port 0 (ephemeral) is allowed for tests."""

    host: NonEmptyStr = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class RetrySpec(StrictModel):
    """Retries before anything reached the client (docs/design.md §5)."""

    max_attempts: int = Field(3, ge=1)
    budget_ratio: float = Field(0.1, ge=0, le=1)
    backoff_base_s: NonNegativeSeconds = 0.5
    backoff_max_s: NonNegativeSeconds = 8.0


class CalibrationSpec(StrictModel):
    """Learning of the cost estimates; ``state_file`` None keeps them in memory only.

    Learned values start from each pool's ``cost.chars_per_token`` and ``cost.output_ratio``;
    an org's own output ratio is used once it has ``min_org_samples`` completed requests.
    """

    state_file: NonEmptyStr | None = None
    half_life_requests: PositiveInt = 5000
    min_org_samples: PositiveInt = 50
    save_interval_s: Seconds = 60.0


class MetricsSpec(StrictModel):
    """Cardinality guard: orgs beyond this many share one ``org`` label value."""

    max_labelled_orgs: PositiveInt = 200


class Config(StrictModel):
    """The whole file. Cross-field checks and key resolution run at validation time.

    Validation reads ``environ`` from the pydantic validation context (``os.environ``
    when absent) to resolve ``key_env``; only the digests are kept. Cross-field errors
    are raised as :class:`ConfigError` directly, field errors as pydantic's
    ``ValidationError``; :func:`parse_config` turns both into ``ConfigError``.
    """

    listen: Listen = Listen()
    limits: Limits = Limits()
    keys: list[KeySpec] = Field(min_length=1)
    classes: dict[Name, ClassSpec] = Field(default_factory=default_classes, min_length=1)
    orgs: dict[Name, OrgSpec] = {}  # noqa: RUF012 -- pydantic copies it per instance
    pools: dict[Name, PoolSpec] = Field(min_length=1)
    retry: RetrySpec = RetrySpec()
    calibration: CalibrationSpec = CalibrationSpec()
    metrics: MetricsSpec = MetricsSpec()
    admin_key_env: NonEmptyStr | None = None
    # the variable holding the key GET /metrics requires; None: /metrics is open
    metrics_key_env: NonEmptyStr | None = None
    drain_timeout_s: NonNegativeSeconds = 30.0
    # None (``state: memory``, the default): each process its own scheduler; or Redis
    state: RedisState | None = None
    usage: UsageSpec = UsageSpec()
    # where keys made through the admin API persist in memory mode (docs/keys.md); with
    # state: redis they live in Redis, and this must be unset
    key_store_file: NonEmptyStr | None = None
    tracing: TracingSpec | None = None  # None: no spans, no OpenTelemetry imported

    _resolved: tuple[ResolvedKey, ...] = PrivateAttr(default=())
    _upstream_keys: dict[str, str] = PrivateAttr(default_factory=dict)
    _admin_digest: bytes | None = PrivateAttr(default=None)
    _metrics_digest: bytes | None = PrivateAttr(default=None)
    _pool_by_model: dict[str, str] = PrivateAttr(default_factory=dict)
    _redis_url: str | None = PrivateAttr(default=None)
    _redis_password: str | None = PrivateAttr(default=None)
    _tracing_headers: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_are_defaults(cls, data: Any) -> Any:
        """``orgs:`` with every entry commented out is null in YAML: treat it as absent."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("state", mode="before")
    @classmethod
    def _memory_is_none(cls, value: Any) -> Any:
        """``state: memory`` says what the default is; anything else must be a mapping."""
        if value == "memory":
            return None
        if not isinstance(value, dict):
            raise ValueError("must be memory, or a mapping with redis, redis_env or sentinel")
        return value

    @model_validator(mode="after")
    def _cross_check(self, info: ValidationInfo) -> Self:
        environ = (info.context or {}).get("environ", os.environ)
        errors, self._pool_by_model = check_models(self.pools)
        errors += check_backends(self.pools)
        errors += check_extra_paths(self.pools)
        errors += check_continuous_usage(self.pools)
        errors += check_key_classes(self.keys, self.classes)
        errors += check_priority_band(self.keys, self.classes, self.pools)
        errors += check_size_buckets(self.classes)
        errors += check_prices(self.pools, self.orgs, self.keys)
        errors += check_access(self.keys, self.orgs, self.pools, self._pool_by_model)
        errors += check_orgs(self.keys, self.orgs)
        key_errors, self._resolved = resolve_keys(self.keys, environ, self.key_access)
        errors += key_errors
        for name, pool in self.pools.items():
            if pool.upstream_key_env is not None:
                path = f"pools.{name}.upstream_key_env"
                secret = env_secret(environ, pool.upstream_key_env, path, errors)
                if secret:
                    self._upstream_keys[name] = secret
        if self.state is not None:
            errors += check_shared(self.pools, self.classes, self.orgs)
            if self.state.redis_env is not None:
                url = env_secret(environ, self.state.redis_env, "state.redis_env", errors)
                self._redis_url = url or None
            else:
                self._redis_url = self.state.redis
            sentinel = self.state.sentinel
            if sentinel is not None and sentinel.password_env is not None:
                path = "state.sentinel.password_env"
                self._redis_password = env_secret(environ, sentinel.password_env, path, errors)
        if self.state is not None and self.key_store_file is not None:
            errors.append(("key_store_file", _KEYS_IN_REDIS))
        if self.admin_key_env is not None:
            secret = env_secret(environ, self.admin_key_env, "admin_key_env", errors)
            self._admin_digest = hashlib.sha256(secret.encode()).digest() if secret else None
        if self.metrics_key_env is not None:
            secret = env_secret(environ, self.metrics_key_env, "metrics_key_env", errors)
            self._metrics_digest = hashlib.sha256(secret.encode()).digest() if secret else None
        self._tracing_headers = tracing_headers(self.tracing, environ, errors)
        if errors:
            raise ConfigError(errors)
        return self

    def org(self, name: str) -> OrgSpec:
        """The org's settings; an org without an entry has weight 1 and no caps."""
        return self.orgs.get(name, DEFAULT_ORG)

    def key_access(
        self, org: str, pools: Iterable[str] | None, models: Iterable[str] | None
    ) -> Access:
        """What a key of ``org`` that lists ``pools`` and ``models`` may use: see
        :func:`effective_access` (keys made through the admin API are resolved by it too)."""
        return effective_access(self.org(org), pools, models, self._pool_by_model)

    def api_key_errors(self, spec: KeySpec) -> Errors:
        """Why a key made through the admin API could not be in this config: the checks of
        the file's keys (classes defined and allowed, pools and models that exist and leave
        one to call, money budgets only with prices), with paths from the key itself
        (``classes[0]``); an error of a class (the priority band) has the path ``classes``."""
        i, keys = len(self.keys), [*self.keys, spec]
        errors = check_key_classes(keys, self.classes)
        errors += check_priority_band(keys, self.classes, self.pools)
        errors += check_access(keys, self.orgs, self.pools, self._pool_by_model)
        errors += check_prices(self.pools, {}, keys)  # a money budget needs prices
        own = f"keys[{i}]"
        return [
            (path.removeprefix(own).lstrip(".") or "org", message)
            if path.startswith(own)
            else ("classes", f"{path}: {message}")
            for path, message in errors
        ]

    def flow_weight(self, org: str, cls: str) -> float:
        """Weight of the flow (org, class, any pool) = class weight × org weight."""
        return self.classes[cls].weight * self.org(org).weight

    def pool_for_model(self, model: str) -> str | None:
        """Name of the pool serving ``model``, or None (the front end answers 404).

        Read through ``__pydantic_private__``: pydantic's lookup of a private attribute
        costs about 8 µs, and this runs for every request.
        """
        # pydantic types it ``dict[str, Any] | None``; a model with private attributes has it
        pool_by_model: dict[str, str] = self.__pydantic_private__["_pool_by_model"]  # type: ignore[index]
        return pool_by_model.get(model)

    def reports_stream_usage(self, model: str) -> bool:
        """Whether the servers of ``model``'s pool put usage in a stream that asks for it
        (an unknown model is refused later, with a 404)."""
        pool = self.pool_for_model(model)
        return pool is None or self.pools[pool].stream_usage

    def continuous_usage(self, model: str) -> bool:
        """Whether a stream to ``model``'s pool asks for usage on every chunk."""
        pool = self.pool_for_model(model)
        return pool is not None and self.pools[pool].cost.continuous_usage

    def owns_priority(self, model: str) -> bool:
        """Whether the ``priority`` of a request for ``model`` is the proxy's to set, not
        the client's: its pool's engine orders its queue by it (``ENGINE_PRIORITY_FAMILIES``)."""
        pool = self.pool_for_model(model)
        return pool is not None and self.pools[pool].family in ENGINE_PRIORITY_FAMILIES

    def engine_priority(self, cls: str, model: str) -> int | None:
        """The ``priority`` a request of class ``cls`` for ``model`` is sent with: its
        class's ``engine_priority`` where its pool's engine takes one; None: none."""
        value = self.classes[cls].engine_priority
        return value if value is not None and self.owns_priority(model) else None

    def affinity_for_model(self, model: str) -> AffinitySpec | None:
        """The affinity settings of ``model``'s pool (None: off, or an unknown model)."""
        pool = self.pool_for_model(model)
        return None if pool is None else self.pools[pool].affinity

    def upstream_key(self, pool: str) -> str | None:
        """The key the proxy sends to ``pool``'s backends (from ``upstream_key_env``)."""
        return self._upstream_keys.get(pool)

    def redis_url(self) -> str | None:
        """Where the shared state is (``state.redis`` or its ``redis_env``); None in memory
        or behind Sentinel."""
        return self._redis_url

    def redis_password(self) -> str | None:
        """The password of a Sentinel-managed Redis (``state.sentinel.password_env``)."""
        return self._redis_password

    def admin_digest(self) -> bytes | None:
        """SHA-256 of the admin key; None when ``admin_key_env`` is not set (admin API off)."""
        return self._admin_digest

    def metrics_digest(self) -> bytes | None:
        """SHA-256 of the key ``GET /metrics`` requires; None when ``metrics_key_env`` is
        not set (``/metrics`` is open)."""
        return self._metrics_digest

    def tracing_on(self) -> TracingSpec | None:
        """The ``tracing`` section when it is there and enabled; None: no tracing."""
        return self.tracing if self.tracing is not None and self.tracing.enabled else None

    def tracing_headers(self) -> dict[str, str]:
        """The headers each export of spans carries (``tracing.headers_env``, read)."""
        return self._tracing_headers

    def resolved_keys(self) -> list[ResolvedKey]:
        """The keys in file order, each with the SHA-256 digest of its secret."""
        return list(self._resolved)


_KEYS_IN_REDIS = "with state: redis, the admin API's keys are kept in Redis: remove it"


def check_prices(
    pools: Mapping[str, PoolSpec], orgs: Mapping[str, OrgSpec], keys: Iterable[KeySpec]
) -> Errors:
    """A price names one of its pool's models (or ``"*"``); a money budget needs some price,
    or it could never be spent (a pool without prices is a check-config warning)."""
    errors: Errors = [
        (f"pools.{name}.prices.{model}", "is not one of the pool's models, nor *")
        for name, pool in pools.items()
        for model in pool.prices
        if model != "*" and model not in pool.models
    ]
    if any(pool.prices for pool in pools.values()):
        return errors
    owners = [(f"orgs.{n}", o.budgets) for n, o in orgs.items()]
    owners += [(f"keys[{i}]", k.budgets) for i, k in enumerate(keys)]
    for path, budgets in owners:
        for j, budget in enumerate(budgets):
            if budget.money is not None:
                message = "a money budget needs prices: no pool has any (pools.<pool>.prices)"
                errors.append((f"{path}.budgets[{j}].money", message))
    return errors
