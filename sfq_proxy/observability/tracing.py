"""OpenTelemetry traces (docs/tracing.md): one span per inference request, of kind SERVER,
from its arrival to its answer's end, the child of the client's valid ``traceparent``
(``http/trace_context.py`` decides which is valid). The span's context goes upstream in the
client's place, so that a backend's own spans (vLLM's ``--otlp-traces-endpoint``) hang
below the proxy's.

Its attributes are the access record's (``access_log.py``), read once at the request's end:
the access line and the span say the same, from one place. Never a prompt, never a key, and
what a client writes freely (its model, the path) is cut as an access line cuts it.

Imported only when the config's ``tracing`` is on (``http/proxy.py``): a proxy without it
pays neither the import (~90 ms) nor a span. The SDK's ``BatchSpanProcessor`` exports from a
thread of its own; a request only appends its ended span to a bounded queue, so a dead
collector costs that queue's memory (spans dropped when it is full), never a request's wait.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import (
    Link,
    Span,
    SpanKind,
    Status,
    StatusCode,
    TraceState,
    format_trace_id,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from ..config import Kind, TracingSpec
from ..core.errors import cut
from .access_log import AccessRecord
from .process_metrics import version

log = logging.getLogger(__name__)
# a client's tracestate that OpenTelemetry cannot parse is dropped (W3C allows it), and the
# API would log a warning quoting it: a line per request, of a client's text
logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)
End = Callable[[AccessRecord], None]  # ends a request's span with what its record says
_PROPAGATOR = TraceContextTextMapPropagator()
# the HTTP methods the semantic conventions name; any other is "_OTHER"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "PATCH"})
# the access record's fields as span attributes: OpenTelemetry's semantic conventions where
# they have a name for it (HTTP, GenAI), else under ``sfq.``
_ATTRIBUTES = (
    ("request_id", "sfq.request_id"),
    ("org", "sfq.org"),
    ("key", "sfq.key"),  # the key's name, never the key
    ("cls", "sfq.class"),
    ("pool", "sfq.pool"),
    ("backend", "sfq.backend"),
    ("outcome", "sfq.outcome"),
    ("reason", "sfq.reason"),
    ("cost", "sfq.cost.charged"),
    ("cost_actual", "sfq.cost.actual"),
    ("queue_wait_s", "sfq.queue_wait_s"),
    ("upstream_s", "sfq.upstream_s"),
    ("retries", "sfq.retries"),
    ("status", "http.response.status_code"),
    ("prompt_tokens", "gen_ai.usage.input_tokens"),
    ("completion_tokens", "gen_ai.usage.output_tokens"),
)


class Tracing:
    """This process's tracer provider (with ``serve --workers N``, each worker has its own)
    and the spans of its requests."""

    def __init__(self, spec: TracingSpec, headers: Mapping[str, str]) -> None:
        # which process of ``serve --workers N`` sent a span: each has its own provider
        resource = Resource.create(
            {
                "service.name": spec.service_name,
                "service.version": version(),
                "process.pid": os.getpid(),
            }
        )
        sampler = _Drawn(spec.sample_ratio)
        # shut down by the proxy's lifecycle, within the drain's bound; at exit the SDK's
        # own would wait up to 30 s for a collector that does not answer
        self._provider = TracerProvider(resource=resource, sampler=sampler, shutdown_on_exit=False)
        exporter = OTLPSpanExporter(
            endpoint=spec.endpoint, headers=dict(headers), timeout=spec.export_timeout_s
        )
        processor = BatchSpanProcessor(
            exporter,
            max_queue_size=spec.max_queue_size,
            schedule_delay_millis=spec.schedule_delay_s * 1000,
            max_export_batch_size=spec.max_export_batch_size,
        )
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("sfq_proxy", version())

    def start(
        self, method: str, path: str, kind: Kind, client: Mapping[str, str]
    ) -> tuple[End, str, dict[str, str]]:
        """A request's span, begun now: the child of ``client`` (the client's valid trace
        context, ``trace_context``), else a new trace's root. Returns what ends it, its
        trace id (for the access log) and the trace context to send upstream in place of
        the client's."""
        method = method if method in _METHODS else "_OTHER"
        route = None if kind is Kind.EXTRA else kind.value  # an extra path: any path
        attributes: dict[str, Any] = {"http.request.method": method, "url.path": cut(path)}
        if route is not None:
            attributes["http.route"] = route
        span = self._tracer.start_span(
            method if route is None else f"{method} {route}",
            context=_PROPAGATOR.extract(client) if client else None,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        upstream: dict[str, str] = {}
        _PROPAGATOR.inject(upstream, context=set_span_in_context(span))
        return partial(_end, span), format_trace_id(span.get_span_context().trace_id), upstream

    def close(self) -> concurrent.futures.Future[None]:
        """Export the spans still queued and stop, in a thread of its own: the SDK waits for
        a collector that does not answer as long as ``export_timeout_s``, and the caller
        bounds its own wait (the drain's). Done when the last export is."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def shut_down() -> None:
            try:
                self._provider.shutdown()
            except Exception:
                log.exception("tracing: the last spans could not be exported")
            finally:
                done.set_result(None)

        threading.Thread(target=shut_down, name="sfq-tracing-close", daemon=True).start()
        return done


class _Drawn(Sampler):
    """Keeps a span with probability ``ratio``, drawn by the proxy, whoever started its
    trace: the ratio is the operator's, and a client can neither raise it nor hide from it.
    OpenTelemetry's parent-based sampler keeps whatever a client's ``traceparent`` flags
    sampled (a flood of them, even refused their key, would each cost ~100 µs of CPU and a
    place in the export queue); its ratio sampler decides by the trace id's low 64 bits,
    which a client's ``traceparent`` writes (ending in zeros: kept at any ratio above 0)."""

    def __init__(self, ratio: float) -> None:
        self._ratio = ratio

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = get_current_span(parent_context).get_span_context()
        state = parent.trace_state if parent.is_valid else None  # the client's goes on
        if random.random() < self._ratio:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, state)
        return SamplingResult(Decision.DROP, None, state)

    def get_description(self) -> str:
        return f"Drawn{{{self._ratio}}}"


def _end(span: Span, record: AccessRecord) -> None:
    """The span's attributes from ``record``, and its status: an error for a failure (the
    answer did not come whole) and for a 5xx, as the HTTP conventions say of a server's
    span; a client's error (4xx) or a request it cancelled is no error of the server's."""
    if span.is_recording():  # sampled: a span not kept is ended and nothing more
        attributes = {
            name: value
            for field, name in _ATTRIBUTES
            if (value := getattr(record, field)) is not None
        }
        if record.model is not None:  # the client's text
            attributes["gen_ai.request.model"] = cut(record.model)
        if record.outcome == "failed" or (record.status or 0) >= 500:
            attributes["error.type"] = record.reason or str(record.status)
            span.set_status(Status(StatusCode.ERROR, record.reason))
        span.set_attributes(attributes)
    span.end()
