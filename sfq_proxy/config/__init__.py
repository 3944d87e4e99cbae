"""Configuration: the YAML file of docs/design.md §7, validated with pydantic.

The lowest layer of the proxy: it imports nothing else of ``sfq_proxy``, and the rest
imports its names from here (``from sfq_proxy.config import Config``: the names of
``__all__``) rather than from the modules below.

One module per section of the file, each importing only modules listed before it:

- ``fields``: the strict base model and the bounded field types every section uses;
- ``errors``: :class:`ConfigError` and pydantic's errors told as ``(path, message)``;
- ``limits``, ``usage`` (budgets and prices), ``paths`` (the proxy's own paths and a
  pool's extra ones), ``cost``: sections, and parts of sections, the others are made of;
- ``pools``, ``keys`` (with ``orgs``), ``classes``, ``state``, ``tracing``: the sections
  made of those, each with its checks; a check that reads another section sits with the
  later one;
- ``proxy``: the root :class:`Config` and the small sections of the process as a whole;
  its validation runs every check (and those that read several sections, such as a money
  budget needing some price);
- ``loader``: YAML text to a ``Config`` (``${VAR}`` expansion, the demo config);
- ``summary``: what ``sfq-proxy check-config`` prints (imported as
  ``sfq_proxy.config.summary``, not re-exported here).

Errors of any kind are raised as one :class:`ConfigError` listing ``(path, message)``
pairs, paths written like ``pools.llama-8b.backends[1].slots``. Other files of the same kind
(the lab's scenarios) use the same pieces, which are public for that: ``StrictModel``,
``read_yaml``, ``config_error`` and ``NAME_PATTERN``. No message ever contains an input
value, because the value might be a secret.
"""

from .classes import (
    DEFAULT_MAX_OVERTAKEN,
    MAX_OVERTAKEN,
    MAX_SIZE_BUCKETS,
    ClassSpec,
    MaxOvertaken,
    SizeBounds,
    band_cap,
    default_classes,
    granted_classes,
    size_bucket,
)
from .cost import CostSpec, MediaTokens, WeightedCost
from .errors import ConfigError, config_error, did_you_mean, format_number
from .fields import (
    NAME_PATTERN,
    Name,
    NonEmptyStr,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    StrictModel,
)
from .keys import Access, KeySpec, OrgSpec, ResolvedKey, effective_access, usable_models
from .limits import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_OUTPUT_TOKENS,
    MAX_TOOLS,
    MIB,
    REQUEST_OVERHEAD_BYTES,
    Limits,
)
from .loader import default_config, expand_env, load_config, parse_config, read_yaml
from .paths import ExtraCostSpec, ExtraPathSpec, Kind
from .pools import (
    AffinitySpec,
    BackendSpec,
    DispatchSpec,
    Family,
    HealthSpec,
    PoolSpec,
    RateSpec,
    TimeoutSpec,
    api_base,
    pool_slots,
    without_credentials,
)
from .proxy import CalibrationSpec, Config, Listen, MetricsSpec, RetrySpec
from .state import RedisState, SentinelSpec
from .tracing import TracingSpec
from .usage import Budgets, BudgetSpec, PriceSpec, UsageSpec

__all__ = [
    "DEFAULT_MAX_OVERTAKEN",
    "MAX_CONTENT_PARTS",
    "MAX_MESSAGES",
    "MAX_OUTPUT_TOKENS",
    "MAX_OVERTAKEN",
    "MAX_SIZE_BUCKETS",
    "MAX_TOOLS",
    "MIB",
    "NAME_PATTERN",
    "REQUEST_OVERHEAD_BYTES",
    "Access",
    "AffinitySpec",
    "BackendSpec",
    "BudgetSpec",
    "Budgets",
    "CalibrationSpec",
    "ClassSpec",
    "Config",
    "ConfigError",
    "CostSpec",
    "DispatchSpec",
    "ExtraCostSpec",
    "ExtraPathSpec",
    "Family",
    "HealthSpec",
    "KeySpec",
    "Kind",
    "Limits",
    "Listen",
    "MaxOvertaken",
    "MediaTokens",
    "MetricsSpec",
    "Name",
    "NonEmptyStr",
    "NonNegativeFloat",
    "OrgSpec",
    "PoolSpec",
    "PositiveFloat",
    "PositiveInt",
    "PriceSpec",
    "RateSpec",
    "RedisState",
    "ResolvedKey",
    "RetrySpec",
    "SentinelSpec",
    "SizeBounds",
    "StrictModel",
    "TimeoutSpec",
    "TracingSpec",
    "UsageSpec",
    "WeightedCost",
    "api_base",
    "band_cap",
    "config_error",
    "default_classes",
    "default_config",
    "did_you_mean",
    "effective_access",
    "expand_env",
    "format_number",
    "granted_classes",
    "load_config",
    "parse_config",
    "pool_slots",
    "read_yaml",
    "size_bucket",
    "usable_models",
    "without_credentials",
]
