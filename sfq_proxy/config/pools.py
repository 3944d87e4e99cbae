"""Configuration: the YAML file of docs/design.md §7, validated with pydantic.

Every model is frozen and forbids unknown keys, so a typo is an error rather than a
silently ignored knob. Models use pydantic's *strict* mode: YAML already gives typed
scalars, so ``slots: "32"`` or ``priority: yes-please`` is reported instead of coerced
(an integer is still accepted where a float is expected).

Errors of any kind are raised as one :class:`ConfigError` listing ``(path, message)``
pairs, paths written like ``pools.llama-8b.backends[1].slots``. Other files of the same kind
(the lab's scenarios) use the same pieces, which are public for that: ``StrictModel``,
``read_yaml``, ``config_error`` and ``NAME_PATTERN``. No message ever contains
an input value, because the value might be a secret.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..core.fair_queue import (
    DEFAULT_MAX_OVERTAKEN,
    MAX_OVERTAKEN,
    MAX_SIZE_BUCKETS,
    size_bucket,
)
from ..core.inference_request import DEFAULT_CAPS, MAX_OUTPUT_TOKENS, Kind
from ..core.queue_memory import MIB, REQUEST_OVERHEAD_BYTES

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
_NAME_RULE = "must start with a letter or digit and use only letters, digits, '_', '.', '-'"

# Names of orgs, classes and pools end up in metric labels, headers and error paths,
# so they are kept to a safe alphabet.
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
# Bounds that keep every number derived from the config finite and every timer valid:
# a flow's weight (class × org) stays within [1e-6, 1e6], inside the fair queue's
# [1e-9, 1e9]; and the largest request (max body, max_tokens) at the largest cost weights
# stays below its MAX_COST.
Weight = Annotated[float, Field(ge=0.001, le=1000, allow_inf_nan=False)]
CostWeight = Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0, le=31_536_000, allow_inf_nan=False)]  # a year
NonNegativeSeconds = Annotated[float, Field(ge=0, le=31_536_000, allow_inf_nan=False)]
PerMinute = Annotated[float, Field(gt=0, le=1e12, allow_inf_nan=False)]
# a ceiling on one request's tokens, input + output: at the largest cost weight its cost
# stays far below the fair queue's MAX_COST
RequestTokens = Annotated[int, Field(gt=0, le=100_000_000)]
PartTokens = Annotated[int, Field(ge=0, le=10_000_000)]


class StrictModel(BaseModel):
    """Base of every config model: immutable, strict, and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Listen(StrictModel):
    """Address of the proxy's HTTP front end. Port 0 (ephemeral) is allowed for tests."""

    host: NonEmptyStr = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class Limits(StrictModel):
    """Request limits enforced before a request is parsed (413 above the body size) and as
    soon as its body is read (400 beyond the caps on its structure), where it is parsed,
    the memory this process may spend on requests waiting in its lines (design.md §6), and
    what a client may hold while its request is read: connections, and the time its head
    and body take (design.md §6, Slow senders)."""

    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0, le=1 << 30)
    queue_memory_mb: int = Field(512, ge=1, le=1 << 20)
    # None: what the file descriptors allow (http/connections.py); per peer, half of that
    max_connections: int | None = Field(None, gt=0, le=1 << 24)
    max_connections_per_peer: int | None = Field(None, gt=0, le=1 << 24)
    header_timeout_s: Seconds = 10.0
    body_timeout_s: Seconds = 30.0
    body_grace_s: NonNegativeSeconds = 5.0
    min_body_kib_per_s: float = Field(32.0, ge=0, le=1 << 20, allow_inf_nan=False)  # 0: off
    max_messages: int = Field(DEFAULT_CAPS.max_messages, gt=0, le=1_000_000)
    max_content_parts: int = Field(DEFAULT_CAPS.max_content_parts, gt=0, le=1_000_000)
    max_tools: int = Field(DEFAULT_CAPS.max_tools, gt=0, le=1_000_000)
    # the largest body parsed on the event loop; a larger one is parsed in a worker process
    parse_in_loop_bytes: int = Field(16 * 1024, ge=0, le=1 << 30)
    # what the proxy holds of one answer for a client slower than its backend (design.md §5)
    answer_buffer_mb: int = Field(32, ge=1, le=1 << 16)

    @model_validator(mode="after")
    def _one_request_fits(self) -> Self:
        """A body of ``max_body_bytes`` (held twice: as read and as rewritten) must fit, or
        such a request could never wait."""
        fits = -(-(2 * self.max_body_bytes + REQUEST_OVERHEAD_BYTES) // MIB)
        if self.queue_memory_mb < fits:
            raise ValueError(
                f"queue_memory_mb must be at least {fits} to hold one request of "
                "max_body_bytes (counted twice, as read and as rewritten, plus 16 KiB)"
            )
        return self

    @property
    def queue_memory_bytes(self) -> int:
        return self.queue_memory_mb * MIB

    @property
    def answer_buffer_bytes(self) -> int:
        return self.answer_buffer_mb * MIB


class BudgetSpec(StrictModel):
    """A cap on an org's or a key's tokens or money per UTC day or calendar month
    (docs/usage-and-budgets.md): requests are refused once it is used up; ``warn_at`` is the
    fraction at which it warns (a log line, the ``sfq_budget_used_ratio`` alert)."""

    period: Literal["day", "month"]
    tokens: int | None = Field(None, gt=0, le=10**15)
    money: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False)
    warn_at: float = Field(0.8, gt=0, lt=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_unit(self) -> Self:
        if (self.tokens is None) == (self.money is None):
            raise ValueError("needs exactly one of tokens, money")
        return self


def _one_budget_per_period_and_unit(budgets: list[BudgetSpec]) -> list[BudgetSpec]:
    """Two budgets of one period and unit: the smaller would be the only one that counts."""
    seen = [(b.period, b.tokens is None) for b in budgets]
    if len(set(seen)) != len(seen):
        raise ValueError("has two budgets of the same period and unit")
    return budgets


Budgets = Annotated[
    list[BudgetSpec], Field(max_length=4), AfterValidator(_one_budget_per_period_and_unit)
]
Price = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]


class PriceSpec(StrictModel):
    """What a million tokens cost, in the currency of money budgets."""

    prompt_per_1m: Price
    completion_per_1m: Price


class UsageSpec(StrictModel):
    """Where usage is kept (docs/usage-and-budgets.md): in memory mode the SQLite ``file``
    (None: in the process only, lost at restart); with ``state: redis``, in Redis, whose
    hourly buckets expire after ``redis_ttl_days``. Written every ``flush_s``."""

    file: NonEmptyStr | None = None
    flush_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False)
    redis_ttl_days: int = Field(400, ge=1, le=3650)


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
    budgets: Budgets = []

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


def _strictly_increasing(bounds: list[float]) -> list[float]:
    if any(b <= a for a, b in pairwise(bounds)):
        raise ValueError("must be strictly increasing")
    return bounds


# size buckets inside a flow (docs/design.md §3): ascending upper bounds of a request's cost,
# finite and positive; and how often one request may be overtaken
SizeBounds = Annotated[
    list[PositiveFloat],
    Field(min_length=1, max_length=MAX_SIZE_BUCKETS),
    AfterValidator(_strictly_increasing),
]
MaxOvertaken = Annotated[int, Field(ge=0, le=MAX_OVERTAKEN)]


class ClassSpec(StrictModel):
    """A workload class. Priority classes bypass SFQ (strict band, FIFO, capped).

    A priority class that some key grants must set ``max_in_flight``, ``max_queue_age_s``
    and ``max_queue_len``, and the band's caps must leave a slot of every pool to the fair
    queue (``Config`` checks it; see :func:`_check_priority_band`).
    """

    weight: Weight = 1.0
    priority: bool = False
    max_in_flight: PositiveInt | None = None
    max_queue_age_s: Seconds | None = None
    max_queue_len: PositiveInt | None = None
    max_request_tokens: RequestTokens | None = None  # tighter than the pool's, when set
    # a request's whole life, from admission: queued, then served (504 ``deadline`` before
    # the answer starts, a ``deadline`` error event in a stream); X-Request-Timeout may
    # only shorten it
    max_request_s: Seconds | None = None
    # size buckets inside a flow (docs/design.md §3): upper bounds of a request's cost for
    # buckets 0, 1, …; within a flow a smaller bucket may overtake, each request at most
    # max_overtaken times (Config checks the pair: _check_size_buckets); unset: the default
    # (None, so that a config dumped without its None fields loads again)
    size_buckets: SizeBounds | None = None
    max_overtaken: MaxOvertaken | None = None

    def overtaking(self, cost: float) -> tuple[int, int | None]:
        """A request of ``cost``'s size bucket and ``max_overtaken`` in this class, or
        ``(0, None)`` when its flows are FIFOs (no ``size_buckets``)."""
        if self.size_buckets is None or self.priority:
            return 0, None
        return size_bucket(cost, self.size_buckets), self.overtaken_at_most

    @property
    def overtaken_at_most(self) -> int:
        """``max_overtaken``, or its default."""
        return DEFAULT_MAX_OVERTAKEN if self.max_overtaken is None else self.max_overtaken


def default_classes() -> dict[str, ClassSpec]:
    """The classes of docs/design.md §2 with the values of §7, used when ``classes:`` is absent."""
    return {
        "system": ClassSpec(priority=True, max_in_flight=4, max_queue_age_s=5, max_queue_len=100),
        "interactive": ClassSpec(weight=6, max_queue_age_s=45, max_queue_len=1000),
        "batch": ClassSpec(weight=1, max_queue_age_s=7200, max_queue_len=100000),
    }


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
    budgets: Budgets = []


class WeightedCost(StrictModel):
    """The cost formula's weights (docs/design.md §4): ``input_weight·input +
    output_weight·max_tokens·output_ratio``. A pool's ``cost`` section extends it; the lab's
    scenarios use it as it is, so both are bounded and checked alike."""

    input_weight: CostWeight = 1.0
    output_weight: CostWeight = 1.0
    output_ratio: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _some_weight(self) -> Self:
        """With both weights zero every request would be free and SFQ would order nothing."""
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("input_weight and output_weight cannot both be 0")
        return self


class MediaTokens(StrictModel):
    """Input tokens a non-text content part is priced at, by kind. An image whose size the
    proxy can read (a ``data:`` URL) is priced by OpenAI's tile rule instead; a part of a
    kind not listed here is priced as a file."""

    image: PartTokens = 765  # OpenAI's rule for a 1024×1024 image at high detail
    audio: PartTokens = 1500
    file: PartTokens = 3000
    video: PartTokens = 10000


class CostSpec(WeightedCost):
    """Cost model of a pool: the weights, how its tokens are counted, and the bounds on
    what one request may ask for (docs/design.md §4)."""

    default_max_tokens: int = Field(512, gt=0, le=MAX_OUTPUT_TOKENS)
    tokenizer: NonEmptyStr | None = None
    chars_per_token: float = Field(4.0, ge=0.1, le=100, allow_inf_nan=False)
    tokens_per_message: float = Field(0.0, ge=0, le=1000, allow_inf_nan=False)
    media_tokens: MediaTokens = MediaTokens()
    max_request_tokens: RequestTokens = 131_072
    over_limit: Literal["refuse", "clamp"] = "refuse"
    inject_max_tokens: Literal["max_tokens", "max_completion_tokens", False] = "max_tokens"
    # a stream asks vLLM for its usage on every chunk (``stream_options.
    # continuous_usage_stats``): a client that leaves is billed the engine's counts so far.
    # Off by default: other servers may refuse the option, and the client sees those usages
    continuous_usage: bool = False


HealthMode = Literal["active", "passive"]
# The server software of a pool's backends, named only where the proxy must behave apart
# (docs/operations.md "Server families"): the health probe's default, and whether a stream
# reports its usage when asked.
Family = Literal["vllm", "llamacpp", "tgi", "openai"]
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
    path: str = "/health"
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

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        """The path is appended to the backend URL, so it must be absolute."""
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value


class TimeoutSpec(StrictModel):
    """Upstream timeouts: TCP/TLS connect, time to the response headers, and the longest
    silence after them (between a stream's chunks, or while a body arrives); and the
    client's: the longest it may take no byte of an answer it is being sent."""

    connect_s: Seconds = 5.0
    first_byte_s: Seconds = 300.0
    idle_s: Seconds = 60.0
    client_write_s: Seconds = 30.0


class BackendSpec(StrictModel):
    """One upstream server. ``name`` (metric label) defaults to the URL's ``host:port``.

    The URL's trailing slash is stripped so paths can be appended. Credentials in the URL
    are refused: they would leak into logs and metrics; use ``upstream_key_env``.
    """

    url: str
    slots: PositiveInt
    name: NonEmptyStr | None = Field(None, validate_default=True)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        """Catch typos at load time rather than as connection errors under load."""
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 -- raises ValueError on a malformed port
        except ValueError:
            raise ValueError("must be a valid http:// or https:// URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("must not contain credentials; use upstream_key_env")
        return value.rstrip("/")

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


# an HTTP field name (RFC 9110 token); never a credential, whose value has no business
# deciding placement
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


class AffinitySpec(StrictModel):
    """Prefix-cache-aware placement (docs/design.md §5, Affinity): a request goes to the
    backend its key ranks first (rendezvous hashing) unless that would put more than
    ``load_factor`` × the pool's average load on it. The key is a session's (the
    ``session_header``, else the body's ``user`` with ``use_user_field``), else a digest of
    the prompt's first ``prefix_chars`` characters (0: sessions only). Only digests are kept.
    """

    prefix_chars: int = Field(4096, ge=0, le=1_048_576)
    session_header: str | None = None
    use_user_field: bool = False
    load_factor: float = Field(1.25, ge=1, le=100, allow_inf_nan=False)

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


# The proxy's own paths, which no pool's ``extra_paths`` may take (http/app.py routes them):
# the inference routes (core/inference_request.py ``Kind``) and the rest.
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
    extra_paths: list[ExtraPathSpec] = Field(default_factory=list, max_length=64)
    # model (or "*": its other models) → price, for money (docs/usage-and-budgets.md)
    prices: dict[NonEmptyStr, PriceSpec] = {}

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
    def stream_usage(self) -> bool:
        """Whether a stream's usage is there when asked (``stream_options``): llama-cpp-python
        ignores the option, so its streams' output is counted from their events."""
        return self.family != "llamacpp"


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


class MetricsSpec(StrictModel):
    """Cardinality guard: orgs beyond this many share one ``org`` label value."""

    max_labelled_orgs: PositiveInt = 200


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


_Errors = list[tuple[str, str]]


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
    orgs: dict[Name, OrgSpec] = {}
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

    _resolved: tuple[ResolvedKey, ...] = PrivateAttr(default=())
    _upstream_keys: dict[str, str] = PrivateAttr(default_factory=dict)
    _admin_digest: bytes | None = PrivateAttr(default=None)
    _metrics_digest: bytes | None = PrivateAttr(default=None)
    _pool_by_model: dict[str, str] = PrivateAttr(default_factory=dict)
    _redis_url: str | None = PrivateAttr(default=None)
    _redis_password: str | None = PrivateAttr(default=None)

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
        errors, self._pool_by_model = _check_models(self.pools)
        errors += _check_backends(self.pools)
        errors += _check_extra_paths(self.pools)
        errors += _check_continuous_usage(self.pools)
        errors += _check_key_classes(self.keys, self.classes)
        errors += _check_priority_band(self.keys, self.classes, self.pools)
        errors += _check_size_buckets(self.classes)
        errors += _check_prices(self.pools, self.orgs, self.keys)
        errors += _check_access(self.keys, self.orgs, self.pools, self._pool_by_model)
        errors += _check_orgs(self.keys, self.orgs)
        key_errors, self._resolved = _resolve_keys(self.keys, environ, self.key_access)
        errors += key_errors
        for name, pool in self.pools.items():
            if pool.upstream_key_env is not None:
                path = f"pools.{name}.upstream_key_env"
                secret = _env_secret(environ, pool.upstream_key_env, path, errors)
                if secret:
                    self._upstream_keys[name] = secret
        if self.state is not None:
            errors += _check_shared(self.pools, self.classes, self.orgs)
            if self.state.redis_env is not None:
                url = _env_secret(environ, self.state.redis_env, "state.redis_env", errors)
                self._redis_url = url or None
            else:
                self._redis_url = self.state.redis
            sentinel = self.state.sentinel
            if sentinel is not None and sentinel.password_env is not None:
                path = "state.sentinel.password_env"
                self._redis_password = _env_secret(environ, sentinel.password_env, path, errors)
        if self.state is not None and self.key_store_file is not None:
            errors.append(("key_store_file", _KEYS_IN_REDIS))
        if self.admin_key_env is not None:
            secret = _env_secret(environ, self.admin_key_env, "admin_key_env", errors)
            self._admin_digest = hashlib.sha256(secret.encode()).digest() if secret else None
        if self.metrics_key_env is not None:
            secret = _env_secret(environ, self.metrics_key_env, "metrics_key_env", errors)
            self._metrics_digest = hashlib.sha256(secret.encode()).digest() if secret else None
        if errors:
            raise ConfigError(errors)
        return self

    def org(self, name: str) -> OrgSpec:
        """The org's settings; an org without an entry has weight 1 and no caps."""
        return self.orgs.get(name, _DEFAULT_ORG)

    def key_access(
        self, org: str, pools: Iterable[str] | None, models: Iterable[str] | None
    ) -> Access:
        """What a key of ``org`` that lists ``pools`` and ``models`` may use: see
        :func:`effective_access` (keys made through the admin API are resolved by it too)."""
        return effective_access(self.org(org), pools, models, self._pool_by_model)

    def api_key_errors(self, spec: KeySpec) -> _Errors:
        """Why a key made through the admin API could not be in this config: the checks of
        the file's keys (classes defined and allowed, pools and models that exist and leave
        one to call, money budgets only with prices), with paths from the key itself
        (``classes[0]``); an error of a class (the priority band) has the path ``classes``."""
        i, keys = len(self.keys), [*self.keys, spec]
        errors = _check_key_classes(keys, self.classes)
        errors += _check_priority_band(keys, self.classes, self.pools)
        errors += _check_access(keys, self.orgs, self.pools, self._pool_by_model)
        errors += _check_prices(self.pools, {}, keys)  # a money budget needs prices
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

    def resolved_keys(self) -> list[ResolvedKey]:
        """The keys in file order, each with the SHA-256 digest of its secret."""
        return list(self._resolved)


_DEFAULT_ORG = OrgSpec()
_KEYS_IN_REDIS = "with state: redis, the admin API's keys are kept in Redis: remove it"


def _check_models(pools: Mapping[str, PoolSpec]) -> tuple[_Errors, dict[str, str]]:
    """Each model must be served by one pool, or routing would be ambiguous."""
    errors: _Errors = []
    pool_by_model: dict[str, str] = {}
    for pool_name, pool in pools.items():
        for i, model in enumerate(pool.models):
            owner = pool_by_model.setdefault(model, pool_name)
            if owner != pool_name:
                message = f"model {model!r} is already served by pool {owner!r}"
                errors.append((f"pools.{pool_name}.models[{i}]", message))
    return errors, pool_by_model


def _check_backends(pools: Mapping[str, PoolSpec]) -> _Errors:
    """Backend URLs and names must be unique in a pool (slot accounting, metric labels), and
    a backend must not be given slots its server does not have."""
    errors: _Errors = []
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
    return errors


# llama-cpp-python serves one request at a time, and one that arrives while a stream runs
# ends that stream (--interrupt_requests): a second slot would cut streams short
_ONE_AT_A_TIME = (
    "a llamacpp server serves one request at a time (a second one ends the running stream): "
    "must be 1"
)


# Redis's Lua numbers are doubles: meters stay exact integers while one charge (c_max over the
# smallest flow weight, in units of 2^-20) stays below 2^51 (dispatch.lua)
_SHARED_MAX_CHARGE = 2.0**31


def _check_continuous_usage(pools: Mapping[str, PoolSpec]) -> _Errors:
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


def _check_extra_paths(pools: Mapping[str, PoolSpec]) -> _Errors:
    """A pool lists each extra path once, at a fixed cost a request may have at all."""
    errors: _Errors = []
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


def _check_shared(
    pools: Mapping[str, PoolSpec], classes: Mapping[str, ClassSpec], orgs: Mapping[str, OrgSpec]
) -> _Errors:
    """What the shared state needs: charges its Lua can count exactly. (A provider pool's
    rate is paced in Redis too, so every replica shares it: state/dispatch.lua.)"""
    weights = [c.weight for c in classes.values() if not c.priority] or [1.0]
    smallest = min(weights) * min([1.0, *(o.weight for o in orgs.values())])
    errors: _Errors = []
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


def _check_prices(
    pools: Mapping[str, PoolSpec], orgs: Mapping[str, OrgSpec], keys: Iterable[KeySpec]
) -> _Errors:
    """A price names one of its pool's models (or ``"*"``); a money budget needs some price,
    or it could never be spent (a pool without prices is a check-config warning)."""
    errors: _Errors = [
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


def _check_size_buckets(classes: Mapping[str, ClassSpec]) -> _Errors:
    """Size buckets order a fair-queued flow: the band is a FIFO of its own, and a
    ``max_overtaken`` without buckets would say something that never happens."""
    errors: _Errors = []
    for name, spec in classes.items():
        if spec.priority and spec.size_buckets is not None:
            errors.append((
                f"classes.{name}.size_buckets",
                "a priority class is served in the strict band, in arrival order: size "
                "buckets order fair-queued classes only",
            ))  # fmt: skip
        if spec.size_buckets is None and spec.max_overtaken is not None:
            errors.append((f"classes.{name}.max_overtaken", "only with size_buckets"))
    return errors


def _check_key_classes(keys: Iterable[KeySpec], classes: Mapping[str, ClassSpec]) -> _Errors:
    """A key may only grant classes that exist, else its requests could not be queued."""
    return [
        (f"keys[{i}].classes[{j}]", f"class {cls!r} is not defined")
        for i, key in enumerate(keys)
        for j, cls in enumerate(key.classes)
        if cls not in classes
    ]


def granted_classes(
    keys: Iterable[KeySpec], classes: Mapping[str, ClassSpec]
) -> dict[str, ClassSpec]:
    """The classes some key grants, in the order of ``classes``: the only ones that can run."""
    names = {cls for key in keys for cls in key.classes}
    return {name: spec for name, spec in classes.items() if name in names}


def pool_slots(pool: PoolSpec) -> int:
    """A pool's total slots as configured: the sum of its backends' slots."""
    return sum(backend.slots for backend in pool.backends)


def band_cap(classes: Mapping[str, ClassSpec]) -> int:
    """The most band requests running at once in one pool: the priority classes' caps."""
    return sum(spec.max_in_flight or 0 for spec in classes.values() if spec.priority)


# what a priority class must set, and why: the band is served before every fair-queued request
_BAND_NEEDS = {
    "max_in_flight": "an uncapped band can take every slot of a pool and starve the fair queue",
    "max_queue_age_s": "band requests that never expire, always served first, let the band "
    "hold the pool",
    "max_queue_len": "an unbounded band queue, always served first, lets the band hold the pool",
}


def _check_priority_band(
    keys: Iterable[KeySpec], classes: Mapping[str, ClassSpec], pools: Mapping[str, PoolSpec]
) -> _Errors:
    """The strict band must never starve a pool's fair queue.

    The band is served before every SFQ flow, so a priority class needs ``max_in_flight``,
    ``max_queue_age_s`` and ``max_queue_len``, and the ``max_in_flight`` of all priority
    classes together must stay below every pool's total slots (the smallest pool binds): at
    least one slot then always serves the fair queue. Only classes some key grants are
    checked, since no request can ever be of another class (the default ``system`` class is
    defined even where no key uses it). The slots are the configured ones: a backend out of
    rotation lowers them for a while.
    """
    band = {name: spec for name, spec in granted_classes(keys, classes).items() if spec.priority}
    errors = [
        (f"classes.{name}.{field}", f"a priority class needs {field}: {why}")
        for name, spec in band.items()
        for field, why in _BAND_NEEDS.items()
        if getattr(spec, field) is None
    ]
    capped = {name: spec.max_in_flight for name, spec in band.items() if spec.max_in_flight}
    total = sum(capped.values())
    smallest = min(pools, key=lambda name: pool_slots(pools[name]), default=None)
    if smallest is None or total < (slots := pool_slots(pools[smallest])):
        return errors
    parts = " + ".join(f"{name} {cap}" for name, cap in capped.items())
    message = (
        f"the priority band's max_in_flight total {total} ({parts}) leaves no slot of pool "
        f"{smallest!r} ({slots} slots) to the fair queue; it must be below every pool's slots"
    )
    return errors + [(f"classes.{name}.max_in_flight", message) for name in capped]


# what a key may use: its pools and its models, each None when unrestricted
Access = tuple[frozenset[str] | None, frozenset[str] | None]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to a mistyped ``word``, or ``""``
    when none is close: a suggestion, never a guess that is acted upon."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


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
) -> _Errors:
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


def _check_access(
    keys: Iterable[KeySpec],
    orgs: Mapping[str, OrgSpec],
    pools: Mapping[str, PoolSpec],
    served: Mapping[str, str],
) -> _Errors:
    """Every list of pools and models names what exists, and every org and key can still
    call some model: an empty intersection is a key that could use nothing. Only the first
    fault is told: lists with an unknown name are not judged empty too, nor the keys of an
    org whose lists are at fault."""
    errors: _Errors = []
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
        org = orgs.get(key.org, _DEFAULT_ORG)
        usable = usable_models(pools, effective_access(org, key.pools, key.models, served))
        if not usable and key.org not in faulty:
            errors.append((
                f"keys[{i}]",
                f"could use no model: its pools and models, within those of org "
                f"{key.org!r}, leave none",
            ))  # fmt: skip
    return errors


def _check_orgs(keys: Iterable[KeySpec], orgs: Mapping[str, OrgSpec]) -> _Errors:
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


def _resolve_keys(
    keys: Iterable[KeySpec],
    environ: Mapping[str, str],
    access: Callable[[str, Iterable[str] | None, Iterable[str] | None], Access],
) -> tuple[_Errors, tuple[ResolvedKey, ...]]:
    """Hash every key now, so the plain secret read from the environment is not kept.

    Values read from the environment are stripped: secrets mounted from files often
    end with a newline that no client would send. ``access`` gives each key's effective
    pools and models (:meth:`Config.key_access`).
    """
    errors: _Errors = []
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
            secret = _env_secret(environ, str(key.key_env), f"keys[{i}].key_env", errors)
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


def _env_secret(environ: Mapping[str, str], name: str, path: str, errors: _Errors) -> str:
    """The stripped value of ``name``, or "" after recording why it is unusable at ``path``."""
    secret = environ.get(name, "").strip()
    if not secret:
        state = "is empty" if name in environ else "is not set"
        errors.append((path, f"environment variable {name} {state}"))
    return secret


def format_number(value: float) -> str:
    """A number for humans: ``6`` rather than ``6.0``, ``200000`` rather than ``2e+05``."""
    return str(int(value)) if float(value).is_integer() else str(value)


class ConfigError(Exception):
    """Invalid configuration: ``errors`` is a list of ``(path, message)``.

    ``str()`` gives one ``path: message`` line per error (just the message when the path
    is empty, e.g. for an empty file). ``source`` names the file when known.
    """

    def __init__(self, errors: _Errors, source: str | None = None) -> None:
        super().__init__(errors)
        self.errors = list(errors)
        self.source = source

    def __str__(self) -> str:
        return "\n".join(f"{path}: {msg}" if path else msg for path, msg in self.errors)


_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
}
_BOUNDS = {  # error type -> (operator, ctx key holding the bound)
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}
_INTERNAL_LOC = re.compile(r"^[a-z-]+\[.*\]$")  # e.g. "function-after[...]", "tagged-union[...]"


def _error_path(loc: tuple[int | str, ...]) -> str:
    """``('pools', 'a', 'backends', 1, 'slots')`` → ``pools.a.backends[1].slots``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "[key]" and not _INTERNAL_LOC.match(part):
            path += f".{part}" if path else part
    return path


def _error_message(err: Mapping[str, Any]) -> str:
    """A short message for pydantic error ``err``. Never uses ``err['input']``."""
    kind, ctx = err["type"], err.get("ctx", {})
    if kind in _TYPE_NAMES:
        message = f"expected {_TYPE_NAMES[kind]}"
    elif kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        message = f"must be {op} {format_number(ctx[bound])}"
    elif kind == "missing":
        message = "required"
    elif kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "finite_number":
        message = "must be a finite number"
    elif kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        message = "must not be empty"
    elif kind == "string_pattern_mismatch" and ctx.get("pattern") == NAME_PATTERN:
        message = _NAME_RULE
    elif kind == "value_error":
        message = str(ctx["error"])
    else:
        message = err["msg"]
    return f"invalid name: {message}" if err["loc"][-1:] == ("[key]",) else message


def config_error(exc: ValidationError, source: str) -> ConfigError:
    """Pydantic's errors in the file's own vocabulary (paths and short messages)."""
    errors = [(_error_path(e["loc"]), _error_message(e)) for e in exc.errors()]
    return ConfigError(errors, source)


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe loader that refuses duplicate mapping keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str, source: str) -> dict[str, Any]:
    """YAML → mapping; errors give a line number but no snippet (it might hold a key)."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([(where, str(exc.problem or exc.context))], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", f"invalid YAML: {type(exc).__name__}")], source) from None
    if data is None:
        raise ConfigError([("", "the configuration is empty")], source)
    if not isinstance(data, dict):
        raise ConfigError([("", "the top level must be a mapping of sections")], source)
    return data


# ``${NAME}``, ``${NAME:-default}``, or ``$${``, a literal ``${``; anything else after a
# ``${`` (no name, no closing brace) is an error rather than text left as it was
_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)(\}?)")
_NAME_DEFAULT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def expand_env(data: Any, environ: Mapping[str, str], path: str = "") -> Any:
    """``data`` with ``${NAME}`` and ``${NAME:-default}`` in its string values replaced from
    ``environ`` (docs/design.md §7): in mappings' values and lists' items at any depth,
    never in mapping keys nor in numbers or booleans. ``${NAME:-default}`` takes the default
    when NAME is unset or empty, ``${NAME}`` is an error when NAME is unset; ``$${`` is a
    literal ``${``. A value is expanded once: what a variable holds is not expanded again.
    Every error names the field's path and the variable, never a value."""
    errors: _Errors = []
    expanded = _expand(data, environ, path, errors)
    if errors:
        raise ConfigError(errors)
    return expanded


def _expand(data: Any, environ: Mapping[str, str], path: str, errors: _Errors) -> Any:
    if isinstance(data, str):
        return _expand_text(data, environ, path, errors) if "${" in data else data
    if isinstance(data, dict):
        return {
            k: _expand(v, environ, f"{path}.{k}" if path else str(k), errors)
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [_expand(v, environ, f"{path}[{i}]", errors) for i, v in enumerate(data)]
    return data


def _expand_text(text: str, environ: Mapping[str, str], path: str, errors: _Errors) -> str:
    def replace(match: re.Match[str]) -> str:
        if match[0] == "$${":
            return "${"
        reference = _NAME_DEFAULT.fullmatch(match[1])
        if reference is None or not match[2]:
            errors.append((path, "invalid ${...}: write ${NAME}, ${NAME:-default} or $${"))
            return ""
        name, default = reference[1], reference[2]
        value = environ.get(name)
        if default is not None and not value:
            return default
        if value is None:
            errors.append((path, f"environment variable {name} is not set (and has no default)"))
            return ""
        return value

    return _REFERENCE.sub(replace, text)


def parse_config(
    text: str, environ: Mapping[str, str] | None = None, source: str = "<string>"
) -> Config:
    """Parse and validate YAML ``text``; ``environ`` (default ``os.environ``) expands
    ``${NAME}`` in its string values and resolves keys."""
    environ = os.environ if environ is None else environ
    try:
        data = expand_env(read_yaml(text, source), environ)
    except ConfigError as exc:
        exc.source = source
        raise
    context = {"environ": environ}
    try:
        return Config.model_validate(data, context=context)
    except ValidationError as exc:
        raise config_error(exc, source) from None
    except ConfigError as exc:
        exc.source = source
        raise


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate the YAML file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([("", f"cannot read {path}: {exc}")], str(path)) from None
    return parse_config(text, environ, source=str(path))


def default_config(environ: Mapping[str, str] | None = None) -> Config:
    """The demo configuration shipped in the package (``sfq_proxy/demo.yaml``), its
    variables from ``environ`` (never ``os.environ``): the admin key ``SFQ_DEMO_ADMIN_KEY``
    (a random one nobody knows when absent) and the simulated servers' ports."""
    text = resources.files("sfq_proxy").joinpath("demo.yaml").read_text(encoding="utf-8")
    environ = {"SFQ_DEMO_ADMIN_KEY": f"sk-demo-admin-{os.urandom(8).hex()}", **(environ or {})}
    return parse_config(text, environ=environ, source="sfq_proxy/demo.yaml")
