"""Configuration: the YAML file of docs/design.md §7, validated with pydantic.

The lowest layer of the proxy: it imports nothing else of ``sfq_proxy``, and the rest
imports its names from here (``from sfq_proxy.config import Config``).
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
