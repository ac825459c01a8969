"""The pure parts of tracing (docs/tracing.md): W3C traceparent parsing and writing, the OTLP/JSON
encoding of spans, and the exporter's bounded queue."""

from __future__ import annotations

import json

import pytest

from gateway.config import Tracing
from gateway.tracing.context import Parent, parse_traceparent, traceparent
from gateway.tracing.otlp import SPAN_KIND_CLIENT, SPAN_KIND_SERVER, STATUS_ERROR, OtlpEncoder, Span
from workers.span_export import SpanExporter

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


@pytest.mark.parametrize(("header", "parent"), [
    (f"00-{TRACE}-{SPAN}-01", Parent(TRACE, SPAN, True)),
    (f"00-{TRACE}-{SPAN}-00", Parent(TRACE, SPAN, False)),
    (f"00-{TRACE}-{SPAN}-09", Parent(TRACE, SPAN, True)),  # other flag bits are ignored
    (f" 00-{TRACE}-{SPAN}-01 ", Parent(TRACE, SPAN, True)),
    (f"01-{TRACE}-{SPAN}-01-future", Parent(TRACE, SPAN, True)),  # a later version may add fields
])
def test_a_valid_traceparent_is_read(header: str, parent: Parent) -> None:
    assert parse_traceparent(header.encode()) == parent


@pytest.mark.parametrize("header", [
    None, "", "garbage", f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
    f"ff-{TRACE}-{SPAN}-01", f"00-{'0' * 32}-{SPAN}-01", f"00-{TRACE}-{'0' * 16}-01",
    f"00-{TRACE.upper()}-{SPAN}-01", f"00-{TRACE[:-1]}g-{SPAN}-01", f"00-{TRACE}-{SPAN}-0x", f"00_{TRACE}-{SPAN}-01",
    f"01-{TRACE}-{SPAN}-01x",
])
def test_an_invalid_traceparent_is_ignored(header: str | None) -> None:
    assert parse_traceparent(None if header is None else header.encode()) is None


def test_our_traceparent_is_sampled_and_names_the_span() -> None:
    value = traceparent(TRACE, SPAN)
    assert value == f"00-{TRACE}-{SPAN}-01".encode()
    assert parse_traceparent(value) == Parent(TRACE, SPAN, True)


def test_spans_encode_as_otlp_json() -> None:
    root = Span(TRACE, SPAN, "", "chat m", SPAN_KIND_SERVER, 1_700_000_000_000_000_000, 1_700_000_000_500_000_000,
                [("gen_ai.request.model", "m \"quoted\" é"), ("gridgate.attempts", 2), ("flag", True),
                 ("score", 0.25)], trace_state="vendor=1")
    child = Span(TRACE, "1111111111111111", SPAN, "chat m", SPAN_KIND_CLIENT, 1, 2, [("a", "b")],
                 deferred=(lambda n: [("later", n)], (7,)))
    child.status_code, child.status_message = STATUS_ERROR, "provider-a: answered 503"
    document = json.loads(OtlpEncoder("gw", [("host.name", "h1")]).encode([root, child]))
    (resource,) = document["resourceSpans"]
    assert resource["resource"]["attributes"] == [
        {"key": "service.name", "value": {"stringValue": "gw"}}, {"key": "host.name", "value": {"stringValue": "h1"}}]
    (scope,) = resource["scopeSpans"]
    assert scope["scope"] == {"name": "gridgate"}
    first, second = scope["spans"]
    assert first == {
        "traceId": TRACE, "spanId": SPAN, "name": "chat m", "kind": 2,
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000500000000",
        "attributes": [
            {"key": "gen_ai.request.model", "value": {"stringValue": "m \"quoted\" é"}},
            {"key": "gridgate.attempts", "value": {"intValue": "2"}},
            {"key": "flag", "value": {"boolValue": True}},
            {"key": "score", "value": {"doubleValue": 0.25}},
        ],
        "status": {}, "traceState": "vendor=1",
    }  # a root span has no parentSpanId
    assert second["parentSpanId"] == SPAN and second["kind"] == 3
    assert second["status"] == {"code": 2, "message": "provider-a: answered 503"}
    assert second["attributes"] == [{"key": "a", "value": {"stringValue": "b"}},
                                    {"key": "later", "value": {"intValue": "7"}}]  # made by the encoder


def test_the_queue_is_bounded_and_counts_what_it_drops() -> None:
    # A collector nobody listens on, and a flush interval the test never reaches: only the queue acts.
    exporter = SpanExporter(Tracing(endpoint="http://127.0.0.1:9", queue_size=3, batch_size=100, flush_interval=60.0))
    try:
        spans = [Span(TRACE, f"{n:016x}", "", "x", SPAN_KIND_SERVER, 1, 2) for n in range(1, 6)]
        exporter.submit(spans[:2])
        exporter.submit(spans[2:4])  # 2 + 2 > 3: both dropped, whole
        exporter.submit(spans[4:])
        assert (len(exporter._queue), exporter.dropped_full, exporter.dropped) == (3, 2, 2)
    finally:
        exporter.close(timeout=5.0)  # its last export fails (nothing listens): those spans count as dropped
    assert exporter.dropped == 5 and exporter.exported == 0


def test_the_traces_url() -> None:
    assert Tracing(endpoint="http://c:4318").traces_url() == "http://c:4318/v1/traces"
    assert Tracing(endpoint="http://c:4318/").traces_url() == "http://c:4318/v1/traces"
    assert Tracing(endpoint="https://c/otlp/v1/traces").traces_url() == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="endpoint"):
        Tracing(endpoint="c:4318")


def test_identity_attributes_name_the_kind_and_a_jwts_issuer_never_a_subject():
    from workers.tracing import identity_attributes

    issuers = {"jwt:okta": "https://example.okta.com/oauth2/default"}
    assert identity_attributes("jwt:okta", issuers) == [
        ("gridgate.identity", "jwt:okta"), ("gridgate.identity.kind", "jwt"),
        ("gridgate.identity.issuer", "https://example.okta.com/oauth2/default")]
    assert identity_attributes("mtls", issuers) == [("gridgate.identity", "mtls"), ("gridgate.identity.kind", "mtls")]
    assert identity_attributes("previous_secret", issuers) == [("gridgate.identity", "previous_secret"),
                                                               ("gridgate.identity.kind", "api_key")]
