"""The ``tracing:`` section: OpenTelemetry traces of the inference requests, sent over
OTLP/HTTP to a collector (docs/tracing.md). Absent (or ``enabled: false``), the proxy
neither imports the OpenTelemetry packages nor starts a span.

The collector's credentials are no part of the file: ``headers_env`` names, per header, the
environment variable holding its value, read at load like every other secret.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib.util import find_spec
from typing import Self

from pydantic import Field, field_validator, model_validator

from .errors import Errors
from .fields import HeaderName, NonEmptyStr, StrictModel, http_url
from .keys import env_secret

# what a header's value may hold here: printable latin-1, what HTTP carries as it is. A
# newline or a control character fails each export, and the exporter logs its error with
# the value in it
_HEADER_VALUE = re.compile(r"[\x20-\x7e\xa0-\xff]*")
# what the proxy imports when tracing is on: the SDK and its OTLP/HTTP exporter
_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


class TracingSpec(StrictModel):
    """Where spans go and how many: ``endpoint`` is the collector's OTLP/HTTP traces URL
    (``http://collector:4318/v1/traces``); a span is kept with probability ``sample_ratio``,
    a client's trace alike (its ``traceparent``'s sampled flag does not decide). Spans
    wait in a queue of ``max_queue_size`` (full: the newest are dropped, a request never
    waits) and leave in batches of ``max_export_batch_size`` every ``schedule_delay_s``,
    each export given up after ``export_timeout_s``."""

    enabled: bool = True
    endpoint: str
    service_name: NonEmptyStr = "sfq-proxy"
    sample_ratio: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    headers_env: dict[HeaderName, NonEmptyStr] = {}  # noqa: RUF012 -- pydantic copies it
    export_timeout_s: float = Field(10.0, gt=0, le=300, allow_inf_nan=False)
    schedule_delay_s: float = Field(5.0, gt=0, le=300, allow_inf_nan=False)
    max_queue_size: int = Field(2048, ge=1, le=1_000_000)
    max_export_batch_size: int = Field(512, ge=1, le=1_000_000)

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        return http_url(value, "headers_env")

    @model_validator(mode="after")
    def _batch_fits_the_queue(self) -> Self:
        if self.max_export_batch_size > self.max_queue_size:
            raise ValueError("max_export_batch_size must not exceed max_queue_size")
        return self


def tracing_headers(
    spec: TracingSpec | None, environ: Mapping[str, str], errors: Errors
) -> dict[str, str]:
    """The headers every export carries, read from the environment; with tracing on, an
    error at ``tracing`` when the OpenTelemetry packages are missing (the proxy would
    otherwise fail at its first request, not at start)."""
    if spec is None or not spec.enabled:
        return {}
    if not all(_installed(name) for name in _PACKAGES):
        message = "needs the OpenTelemetry packages: install sfq-proxy[tracing]"
        errors.append(("tracing", message))
    return {
        header: _header_value(environ, variable, f"tracing.headers_env.{header}", errors)
        for header, variable in spec.headers_env.items()
    }


def _header_value(environ: Mapping[str, str], variable: str, path: str, errors: Errors) -> str:
    """The secret in ``variable``, or "" after recording at ``path`` why no header can carry
    it (without quoting it: the error is printed)."""
    value = env_secret(environ, variable, path, errors)
    if not _HEADER_VALUE.fullmatch(value):
        problem = "a control character or one beyond latin-1, which no HTTP header carries"
        errors.append((path, f"environment variable {variable} holds {problem}"))
        return ""
    return value


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
