"""Spans, and their OTLP/HTTP JSON encoding (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding).

A ``Span`` is what the request path builds: a few ids, two clock readings and its attributes as
(key, value) pairs. ``encode_spans`` turns a batch into one ``ExportTraceServiceRequest`` body on the
exporter's thread. JSON, not protobuf: the collector accepts both on ``/v1/traces``
(``Content-Type: application/json``), msgspec encodes it in C, and no protobuf runtime is needed.
The OTLP JSON mapping writes ids as lowercase hex, 64-bit integers as decimal strings and enums as
numbers.
"""

from __future__ import annotations

import msgspec

SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
STATUS_UNSET = 0
STATUS_ERROR = 2
SCOPE_NAME = "gridgate"

AttributeValue = str | int | float | bool


class Span(msgspec.Struct, gc=False):
    """One finished (or, until ``end_ns`` is set, running) span."""

    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # 16 hex, "" for a root span
    name: str
    kind: int
    start_ns: int  # Unix epoch nanoseconds
    end_ns: int = 0
    attributes: list[tuple[str, AttributeValue]] = []
    status_code: int = STATUS_UNSET
    status_message: str = ""


# -- the OTLP JSON shapes ------------------------------------------------------------------------------
class _Value(msgspec.Struct, omit_defaults=True):
    stringValue: str | None = None  # noqa: N815 - OTLP's field names
    intValue: str | None = None  # noqa: N815
    doubleValue: float | None = None  # noqa: N815
    boolValue: bool | None = None  # noqa: N815


class _KeyValue(msgspec.Struct):
    key: str
    value: _Value


class _Status(msgspec.Struct, omit_defaults=True):
    code: int = STATUS_UNSET
    message: str = ""


class _Span(msgspec.Struct, omit_defaults=True):
    traceId: str  # noqa: N815
    spanId: str  # noqa: N815
    name: str
    kind: int
    startTimeUnixNano: str  # noqa: N815
    endTimeUnixNano: str  # noqa: N815
    attributes: list[_KeyValue]
    status: _Status
    parentSpanId: str = ""  # noqa: N815


class _Scope(msgspec.Struct):
    name: str


class _ScopeSpans(msgspec.Struct):
    scope: _Scope
    spans: list[_Span]


class _Resource(msgspec.Struct):
    attributes: list[_KeyValue]


class _ResourceSpans(msgspec.Struct):
    resource: _Resource
    scopeSpans: list[_ScopeSpans]  # noqa: N815


class _Export(msgspec.Struct):
    resourceSpans: list[_ResourceSpans]  # noqa: N815


def _value(value: AttributeValue) -> _Value:
    kind = type(value)
    if kind is str:
        return _Value(stringValue=value)  # type: ignore[arg-type]
    if kind is bool:
        return _Value(boolValue=value)  # type: ignore[arg-type]
    if kind is int:
        return _Value(intValue=str(value))
    return _Value(doubleValue=float(value))


def _attributes(pairs: list[tuple[str, AttributeValue]]) -> list[_KeyValue]:
    return [_KeyValue(key, _value(value)) for key, value in pairs]


class OtlpEncoder:
    """Encodes batches of spans of one service (its resource attributes are built once)."""

    def __init__(self, service_name: str, resource: list[tuple[str, AttributeValue]] | None = None) -> None:
        self._resource = _Resource(_attributes([("service.name", service_name), *(resource or [])]))
        self._scope = _Scope(SCOPE_NAME)
        self._encode = msgspec.json.Encoder().encode

    def encode(self, spans: list[Span]) -> bytes:
        """One ``ExportTraceServiceRequest`` (OTLP/JSON) carrying ``spans``."""
        body = [
            _Span(s.trace_id, s.span_id, s.name, s.kind, str(s.start_ns), str(s.end_ns), _attributes(s.attributes),
                  _Status(s.status_code, s.status_message), s.parent_span_id)
            for s in spans
        ]
        return self._encode(_Export([_ResourceSpans(self._resource, [_ScopeSpans(self._scope, body)])]))
