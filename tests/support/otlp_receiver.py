"""An OpenTelemetry collector's stand-in: a real OTLP/HTTP traces receiver.

It accepts ``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest`` (decoded with
``opentelemetry-proto``, as a collector does), answers the protobuf response a collector
sends, and keeps every span it was sent, decoded, with the raw bodies (for what must not be
in them). Serve its ``app()`` with ``Lab.serve``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

PROTOBUF = "application/x-protobuf"
SERVER = Span.SPAN_KIND_SERVER
ERROR = Status.STATUS_CODE_ERROR
UNSET = Status.STATUS_CODE_UNSET


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a trace's root
    start_ns: int
    end_ns: int
    status: int
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        return app

    def by_request(self) -> dict[str, ReceivedSpan]:
        """The spans by their ``sfq.request_id``; two of one request fail here."""
        found: dict[str, ReceivedSpan] = {}
        for span in self.spans:
            request_id = span.attributes["sfq.request_id"]
            assert request_id not in found, f"two spans of request {request_id}"
            found[request_id] = span
        return found

    async def _traces(self, request: web.Request) -> web.Response:
        if request.content_type != PROTOBUF:
            return web.Response(status=415)
        body = await request.read()
        self.bodies.append(body)
        message = ExportTraceServiceRequest.FromString(body)
        for resource_spans in message.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                self.spans += [_span(span, resource) for span in scope_spans.spans]
        answer = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type=PROTOBUF)


def _span(span: Span, resource: dict[str, Any]) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        kind=span.kind,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        status=span.status.code,
        status_message=span.status.message,
        attributes=_attributes(span.attributes),
        resource=resource,
    )


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair) for pair in pairs}


def _value(pair: KeyValue) -> Any:
    kind = pair.value.WhichOneof("value")
    return getattr(pair.value, kind) if kind else None
