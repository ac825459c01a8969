"""Spans, and their OTLP/HTTP JSON encoding (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding).

A ``Span`` is what the request path builds: a few ids, two clock readings and its attributes as
(key, value) pairs. ``encode_spans`` turns a batch into one ``ExportTraceServiceRequest`` body on the
exporter's thread. JSON, not protobuf: the collector accepts both on ``/v1/traces``
(``Content-Type: application/json``), msgspec encodes it in C, and no protobuf runtime is needed.
The OTLP JSON mapping writes ids as lowercase hex, 64-bit integers as decimal strings and enums as
numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
STATUS_UNSET = 0
STATUS_ERROR = 2
SCOPE_NAME = "gridgate"

AttributeValue = str | int | float | bool


class Span(msgspec.Struct, gc=False):
    """One finished (or, until ``end_ns`` is set, running) span.

    ``deferred``: ``(function, values)`` whose call returns more attributes, made by the encoder (the
    exporter's thread) rather than by the request path; the values must not change after the span ends.
    """

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
    deferred: tuple[Callable[..., list[tuple[str, AttributeValue]]], tuple] | None = None
    trace_state: str = ""  # the client's W3C tracestate, carried as it came


# -- the OTLP JSON shapes ------------------------------------------------------------------------------
# Attributes are most of a span's bytes and of its encoding time: each is written as JSON bytes from a
# cached key prefix and the value's msgspec encoding (a quarter of the cost of a Struct per attribute),
# and a span's list goes into the document as ``msgspec.Raw``.
class _Status(msgspec.Struct, omit_defaults=True):
    code: int = STATUS_UNSET
    message: str = ""


class _Span(msgspec.Struct, omit_defaults=True):
    traceId: str  # noqa: N815 - OTLP's field names
    spanId: str  # noqa: N815
    name: str
    kind: int
    startTimeUnixNano: str  # noqa: N815
    endTimeUnixNano: str  # noqa: N815
    attributes: msgspec.Raw
    status: _Status
    parentSpanId: str = ""  # noqa: N815
    traceState: str = ""  # noqa: N815


class _Scope(msgspec.Struct):
    name: str


class _ScopeSpans(msgspec.Struct):
    scope: _Scope
    spans: list[_Span]


class _Resource(msgspec.Struct):
    attributes: msgspec.Raw


class _ResourceSpans(msgspec.Struct):
    resource: _Resource
    scopeSpans: list[_ScopeSpans]  # noqa: N815


class _Export(msgspec.Struct):
    resourceSpans: list[_ResourceSpans]  # noqa: N815


_json = msgspec.json.encode
_MAX_KEYS = 1024  # attribute names are a fixed set; bounded all the same


class _AttributeWriter:
    """``[(key, value), ...]`` -> the OTLP JSON array of ``KeyValue`` (one per encoder: not shared by threads)."""

    __slots__ = ("_prefixes",)

    def __init__(self) -> None:
        self._prefixes: dict[str, bytes] = {}

    def _prefix(self, key: str) -> bytes:
        prefix = self._prefixes.get(key)
        if prefix is None:
            if len(self._prefixes) >= _MAX_KEYS:
                self._prefixes.clear()
            prefix = self._prefixes[key] = b'{"key":' + _json(key) + b',"value":{"'
        return prefix

    def __call__(self, pairs: list[tuple[str, AttributeValue]]) -> msgspec.Raw:
        parts = []
        prefix_of = self._prefixes.get
        for key, value in pairs:
            prefix = prefix_of(key) or self._prefix(key)
            kind = type(value)
            if kind is str:
                parts.append(prefix + b'stringValue":' + _json(value) + b"}}")
            elif kind is bool:
                parts.append(prefix + (b'boolValue":true}}' if value else b'boolValue":false}}'))
            elif kind is int:
                parts.append(prefix + b'intValue":"%d"}}' % value)
            else:
                parts.append(prefix + b'doubleValue":' + _json(float(value)) + b"}}")
        return msgspec.Raw(b"[" + b",".join(parts) + b"]")


class OtlpEncoder:
    """Encodes batches of spans of one service (its resource attributes are built once)."""

    def __init__(self, service_name: str, resource: list[tuple[str, AttributeValue]] | None = None) -> None:
        self._attributes = _AttributeWriter()
        self._resource = _Resource(self._attributes([("service.name", service_name), *(resource or [])]))
        self._scope = _Scope(SCOPE_NAME)
        self._encode = msgspec.json.Encoder().encode

    def encode(self, spans: list[Span]) -> bytes:
        """One ``ExportTraceServiceRequest`` (OTLP/JSON) carrying ``spans``."""
        attributes = self._attributes
        body = [
            _Span(s.trace_id, s.span_id, s.name, s.kind, str(s.start_ns), str(s.end_ns),
                  attributes(s.attributes if s.deferred is None else [*s.attributes, *s.deferred[0](*s.deferred[1])]),
                  _Status(s.status_code, s.status_message), s.parent_span_id, s.trace_state)
            for s in spans
        ]
        return self._encode(_Export([_ResourceSpans(self._resource, [_ScopeSpans(self._scope, body)])]))
