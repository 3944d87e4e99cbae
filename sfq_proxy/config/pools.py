"""The ``pools:`` section: backends serving the same models, one scheduler each
(docs/design.md §1): their servers, health, timeouts, rate limits and placement, and the
checks across a pool's entries (a model served once, backends' URLs and names unique).

A pool's ``cost`` is in ``cost.py``, its ``extra_paths`` in ``paths.py``, its ``prices``
in ``usage.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .cost import CostSpec
from .errors import Errors
from .fields import (
    HEADER_NAME_PATTERN,
    NonEmptyStr,
    NonNegativeSeconds,
    PerMinute,
    PositiveInt,
    Seconds,
    StrictModel,
    http_url,
)
from .paths import ExtraPathSpec
from .usage import PriceSpec

HealthMode = Literal["active", "passive"]
# The server software of a pool's backends, named only where the proxy must behave apart
# (docs/operations.md "Server families"): the health probe's default, and whether a stream
# reports its usage when asked, and which metrics engine dispatch reads. ``llama-server`` is
# llama.cpp's own C++ server (``/health``, ``--parallel`` slots, its ``--metrics`` and
# ``/props``); ``llamacpp`` is llama-cpp-python's (one request at a time, no metrics).
Family = Literal["vllm", "llama-server", "llamacpp", "tgi", "openai"]
# where each family answers a probe without queueing behind generation: llama-cpp-python
# has no /health, and every route with the model's lock (/v1/models too) cuts a running
# stream; FastAPI's own /openapi.json takes no lock
_HEALTH_PATHS: dict[str, str] = {"llamacpp": "/openapi.json"}
# failures in a row that take a backend out, by mode: an active pool's probe is the judge
# (one failure, as before), while a passive pool's backend is often a provider's only one,
# so a lone 5xx must not take it out (Envoy's outlier detection also waits for 5)
_DEFAULT_FAILURES: dict[str, int] = {"active": 1, "passive": 5}
# the fields that describe the probe request: set on a passive pool, they are a mistake
_PROBE_FIELDS = ("path", "method", "send_key")


def _absolute(value: str) -> str:
    """A path appended to a backend's URL must be absolute."""
    if not value.startswith("/"):
        raise ValueError("must start with '/'")
    return value


BackendPath = Annotated[str, AfterValidator(_absolute)]


class HealthSpec(StrictModel):
    """How a pool judges its backends' health (docs/design.md §5).

    ``active``: a probe of every backend each ``interval_s``; a backend taken out comes back
    at its first good probe after ``cooldown_s``. ``passive``: no probe; a backend taken out
    is trusted again once ``cooldown_s`` is over. In both, ``consecutive_failures`` failures
    in a row (failed probes, connect errors, 5xx answers) take a backend out; a success
    resets the count. A pool with ``upstream_key_env`` is passive unless it says otherwise
    (see :class:`PoolSpec`); ``consecutive_failures`` defaults to 1 when active, 5 when
    passive.
    """

    mode: HealthMode = "active"
    path: BackendPath = "/health"
    method: Literal["GET", "HEAD"] = "GET"
    send_key: bool = True  # send the pool's upstream key (if any) with the probe
    interval_s: Seconds = 5.0
    cooldown_s: NonNegativeSeconds = 10.0
    timeout_s: Seconds = 2.0
    consecutive_failures: PositiveInt = 1

    @model_validator(mode="before")
    @classmethod
    def _failures_by_mode(cls, data: Any) -> Any:
        """The default streak depends on the mode; an explicit one is kept."""
        if isinstance(data, dict) and "consecutive_failures" not in data:
            mode = data.get("mode", "active")
            default = _DEFAULT_FAILURES.get(mode) if isinstance(mode, str) else None
            if default is not None:
                return {**data, "consecutive_failures": default}
        return data

    @model_validator(mode="after")
    def _no_probe_when_passive(self) -> Self:
        if self.mode == "passive":
            for field in _PROBE_FIELDS:
                if field in self.model_fields_set:
                    raise ValueError(
                        f"{field} is for active probes; set mode: active to probe (a pool "
                        "with upstream_key_env or family openai is passive by default)"
                    )
        return self


class TimeoutSpec(StrictModel):
    """Upstream timeouts: TCP/TLS connect, time to the response headers, and the longest
    silence after them (between a stream's chunks, or while a body arrives); and the
    client's: the longest it may take no byte of an answer it is being sent."""

    connect_s: Seconds = 5.0
    first_byte_s: Seconds = 300.0
    idle_s: Seconds = 60.0
    client_write_s: Seconds = 30.0


def _slots(value: Any) -> Any:
    """A positive integer or ``auto``, told in one message rather than as a union's two."""
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("expected an integer, or auto")
    if value <= 0:
        raise ValueError("must be > 0")
    return value


# a backend's static concurrency, or ``auto``: as many as its engine's readings allow
# (engine dispatch only, docs/design.md §5 "Engine-aware dispatch")
Slots = Annotated[int | Literal["auto"], BeforeValidator(_slots)]


class BackendSpec(StrictModel):
    """One upstream server. ``name`` (metric label) defaults to the URL's ``host:port``.

    The URL's trailing slash is stripped so paths can be appended. Credentials in the URL
    are refused: they would leak into logs and metrics; use ``upstream_key_env``.
    ``capacity``: the requests its engine runs at once, when the operator knows it (engine
    dispatch only: the gate then needs not learn it).
    """

    url: str
    slots: Slots
    name: NonEmptyStr | None = Field(None, validate_default=True)
    capacity: PositiveInt | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return http_url(value, "upstream_key_env").rstrip("/")

    @field_validator("name")
    @classmethod
    def _default_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A stable, readable metric label without asking the operator for one."""
        url = info.data.get("url")
        if value is not None or url is None:
            return value
        parts = urlsplit(url)
        host = f"[{parts.hostname}]" if ":" in str(parts.hostname) else parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{host}:{port}"


def api_base(url: str) -> str:
    """Where a backend's API paths (``/v1/chat/completions``…) and its health path go: its
    URL without a trailing ``/v1``, so that ``https://api.openai.com/v1`` (as providers
    write it) and ``http://10.0.0.11:8000`` (as vLLM is) both get ``/v1/...`` once. Any
    other path prefix is kept (``https://gw.example/openai/v1`` → ``/openai``)."""
    return url[: -len("/v1")] if urlsplit(url).path.endswith("/v1") else url


def without_credentials(url: str) -> str:
    """``url`` as it may be shown (an error message, check-config): its password left out."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


class RateSpec(StrictModel):
    """Rate limits of a provider pool, shared by every flow of the pool."""

    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None


# a session header: never a credential, whose value has no business deciding placement
_HEADER_NAME = re.compile(HEADER_NAME_PATTERN)
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


class AffinitySpec(StrictModel):
    """Prefix-cache-aware placement (docs/design.md §5, Affinity): a request goes to the
    backend its key ranks first (rendezvous hashing) unless that would put more than
    ``load_factor`` × the pool's average load, plus ``slack`` requests, on it. The key is a
    session's (the ``session_header``, else the body's ``user`` with ``use_user_field``),
    else a digest of the prompt's first ``prefix_chars`` characters (0: sessions only). Only
    digests are kept.
    """

    prefix_chars: int = Field(4096, ge=0, le=1_048_576)
    session_header: str | None = None
    use_user_field: bool = False
    load_factor: float = Field(1.25, ge=1, le=100, allow_inf_nan=False)
    # requests a backend may run above ⌈load_factor × average⌉ for its keys: at light load
    # that ceiling is 1 or 2, and without slack a third of later turns leave their cache;
    # 2 keeps 98 % of them (bench/affinity_slack.py, docs/design.md §5 Affinity)
    slack: int = Field(2, ge=0, le=1_000_000)

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not _HEADER_NAME.fullmatch(value):
            raise ValueError("must be an HTTP header name")
        if value.lower() in _CREDENTIAL_HEADERS:
            raise ValueError("must not be a credential header")
        return value

    @model_validator(mode="after")
    def _some_key(self) -> Self:
        if self.prefix_chars == 0 and self.session_header is None and not self.use_user_field:
            raise ValueError(
                "with prefix_chars 0 no request has a key: set session_header or use_user_field"
            )
        return self


DispatchMode = Literal["static", "engine"]
# the families whose /metrics core/engine_metrics.parse reads (not a hosted provider's)
ENGINE_FAMILIES = ("vllm", "llama-server", "tgi")


class DispatchSpec(StrictModel):
    """How a pool decides that a backend may take one more request (docs/design.md §5,
    "Engine-aware dispatch"). ``static``: while it has a free slot. ``engine``: while its
    engine's own ``/metrics`` (read every ``interval_s``) say it would run the request at
    once, or hold at most ``allowance`` waiting; a reading older than ``max_age_s`` falls
    back to static slots. The bounds are the draft's: a scrape per backend at most 20 a
    second, a body of at most 64 MiB."""

    mode: DispatchMode = "static"
    interval_s: float = Field(0.5, ge=0.05, le=60, allow_inf_nan=False)
    timeout_s: Seconds = 1.0
    max_age_s: Seconds = 2.0
    allowance: int = Field(1, ge=1, le=1000)
    kv_ceiling: float | None = Field(0.95, gt=0, le=1, allow_inf_nan=False)
    settle_s: float = Field(0.05, ge=0, le=10, allow_inf_nan=False)
    fallback_slots: PositiveInt = 1
    max_bytes: int = Field(1 << 20, ge=4096, le=64 << 20)
    metrics_path: BackendPath = "/metrics"


class PoolSpec(StrictModel):
    """Backends serving the same models; one scheduler each (docs/design.md §1)."""

    models: list[NonEmptyStr] = Field(min_length=1)
    cost: CostSpec = CostSpec()
    health: HealthSpec = HealthSpec()
    timeouts: TimeoutSpec = TimeoutSpec()
    backends: list[BackendSpec] = Field(min_length=1)
    upstream_key_env: NonEmptyStr | None = None
    rate: RateSpec | None = None
    family: Family = "vllm"
    affinity: AffinitySpec | None = None  # None: every request to the least loaded backend
    dispatch: DispatchSpec = DispatchSpec()
    extra_paths: list[ExtraPathSpec] = Field(default_factory=list, max_length=64)
    # model (or "*": its other models) → price, for money (docs/usage-and-budgets.md)
    prices: dict[NonEmptyStr, PriceSpec] = {}  # noqa: RUF012 -- pydantic copies it per instance

    def extra_path(self, path: str) -> ExtraPathSpec | None:
        """The pool's rule for ``path``, if it lists it in ``extra_paths``."""
        for extra in self.extra_paths:
            if extra.path == path:
                return extra
        return None

    @model_validator(mode="before")
    @classmethod
    def _health_by_family(cls, data: Any) -> Any:
        """Health defaults where servers differ; what ``health`` sets is kept. A hosted
        provider (``family: openai``, or any pool with ``upstream_key_env``) rarely has an
        open ``/health``: passive. llama-cpp-python has none: its probe path is another."""
        if not isinstance(data, dict) or not isinstance(data.get("health", {}), dict):
            return data
        health, family = dict(data.get("health", {})), data.get("family")
        if "mode" not in health and (
            family == "openai" or data.get("upstream_key_env") is not None
        ):
            health["mode"] = "passive"
        default_path = _HEALTH_PATHS.get(family) if isinstance(family, str) else None
        if default_path and health.get("mode", "active") == "active" and "path" not in health:
            health["path"] = default_path
        return {**data, "health": health}

    @property
    def engine(self) -> bool:
        """Whether dispatch reads the engines' own metrics (``dispatch.mode: engine``)."""
        return self.dispatch.mode == "engine"

    def slots_of(self, backend: BackendSpec) -> int:
        """A backend's slots where a number is needed before its engine says (the band's
        check, check-config's shares, the descriptors' reserve): ``slots``, or for ``auto``
        its ``capacity``, else ``dispatch.fallback_slots`` (what it runs on stale readings
        until a capacity is learned)."""
        if isinstance(backend.slots, int):
            return backend.slots
        return backend.capacity or self.dispatch.fallback_slots

    @property
    def stream_usage(self) -> bool:
        """Whether a stream's usage is there when asked (``stream_options``): llama-cpp-python
        ignores the option, so its streams' output is counted from their events."""
        return self.family != "llamacpp"


def check_models(pools: Mapping[str, PoolSpec]) -> tuple[Errors, dict[str, str]]:
    """Each model must be served by one pool, or routing would be ambiguous."""
    errors: Errors = []
    pool_by_model: dict[str, str] = {}
    for pool_name, pool in pools.items():
        for i, model in enumerate(pool.models):
            owner = pool_by_model.setdefault(model, pool_name)
            if owner != pool_name:
                message = f"model {model!r} is already served by pool {owner!r}"
                errors.append((f"pools.{pool_name}.models[{i}]", message))
    return errors, pool_by_model


def check_backends(pools: Mapping[str, PoolSpec]) -> Errors:
    """Backend URLs and names must be unique in a pool (slot accounting, metric labels), and
    a backend must not be given slots its server does not have."""
    errors: Errors = []
    for pool_name, pool in pools.items():
        urls: dict[str, int] = {}
        names: dict[str | None, int] = {}
        for i, backend in enumerate(pool.backends):
            path = f"pools.{pool_name}.backends[{i}]"
            if (first := urls.setdefault(api_base(backend.url), i)) != i:  # /v1 or not
                errors.append((f"{path}.url", f"same url as backends[{first}]"))
            elif (first := names.setdefault(backend.name, i)) != i:
                errors.append((f"{path}.name", f"same name as backends[{first}]"))
            if pool.family == "llamacpp" and backend.slots != 1:
                errors.append((f"{path}.slots", _ONE_AT_A_TIME))
    return errors + check_dispatch(pools)


def check_dispatch(pools: Mapping[str, PoolSpec]) -> Errors:
    """Engine dispatch reads what a known server family's ``/metrics`` says, on a timeline
    that makes sense (a scrape ends before its reading would be stale, and one lost scrape
    is no fallback); ``slots: auto`` and ``capacity`` mean nothing without it."""
    errors: Errors = []
    for name, pool in pools.items():
        path, dispatch = f"pools.{name}.dispatch", pool.dispatch
        if pool.engine and pool.family not in ENGINE_FAMILIES:
            message = f"engine dispatch reads the metrics of {', '.join(ENGINE_FAMILIES)} servers"
            errors.append((f"{path}.mode", f"{message}, not of family {pool.family!r}"))
        if dispatch.timeout_s >= dispatch.max_age_s:
            errors.append((f"{path}.timeout_s", "must be below max_age_s"))
        if dispatch.max_age_s <= dispatch.interval_s:
            errors.append((f"{path}.max_age_s", "must be above interval_s"))
        if pool.engine:
            continue
        for i, backend in enumerate(pool.backends):
            path = f"pools.{name}.backends[{i}]"
            if backend.slots == "auto":
                errors.append((f"{path}.slots", f"auto {_ENGINE_ONLY}; else a number"))
            if backend.capacity is not None:
                errors.append((f"{path}.capacity", _ENGINE_ONLY))
    return errors


_ENGINE_ONLY = "only with dispatch.mode: engine (its engine's readings decide)"


# llama-cpp-python serves one request at a time, and one that arrives while a stream runs
# ends that stream (--interrupt_requests): a second slot would cut streams short
_ONE_AT_A_TIME = (
    "a llamacpp server serves one request at a time (a second one ends the running stream): "
    "must be 1"
)


def check_continuous_usage(pools: Mapping[str, PoolSpec]) -> Errors:
    """Usage on every chunk is vLLM's option: another server may refuse the request."""
    return [
        (
            f"pools.{name}.cost.continuous_usage",
            f"continuous usage (stream_options.continuous_usage_stats) is vLLM's: "
            f"not for a pool of family {pool.family!r}",
        )
        for name, pool in pools.items()
        if pool.cost.continuous_usage and pool.family != "vllm"
    ]


def check_extra_paths(pools: Mapping[str, PoolSpec]) -> Errors:
    """A pool lists each extra path once, at a fixed cost a request may have at all."""
    errors: Errors = []
    for name, pool in pools.items():
        seen: set[str] = set()
        for i, extra in enumerate(pool.extra_paths):
            path = f"pools.{name}.extra_paths[{i}]"
            if extra.path in seen:
                errors.append((f"{path}.path", "the pool lists this path twice"))
            seen.add(extra.path)
            if extra.cost.fixed > pool.cost.max_request_tokens:
                errors.append((
                    f"{path}.cost.fixed",
                    "is above the pool's cost.max_request_tokens: every request would be refused",
                ))  # fmt: skip
    return errors


def pool_slots(pool: PoolSpec) -> int:
    """A pool's total slots as configured: the sum of its backends' slots (``slots_of``)."""
    return sum(pool.slots_of(backend) for backend in pool.backends)
