"""OpenTelemetry traces (docs/tracing.md) through a real gateway: the spans of real requests reach an
OTLP/HTTP receiver on loopback, with their ids, parents and attributes; the provider continues the
trace under the attempt's span; a collector that is down costs no request and counts its drops."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.harness import candidate, chat, envelope, metric_value, refused_port, wait_until
from tests.integration.test_access_log import wait_lines

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP (JSON) trace receiver: keeps every span it is sent, by span id."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((self.path, dict(self.headers)))
                for resource in json.loads(body)["resourceSpans"]:
                    service = attributes(resource["resource"])["service.name"]
                    for scope in resource["scopeSpans"]:
                        receiver.spans.extend({**span, "service": service} for span in scope["spans"])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, count: int) -> list[dict[str, Any]]:
        wait_until(lambda: len([s for s in self.spans if s["traceId"] == trace_id]) >= count,
                   f"{count} spans of trace {trace_id}")
        return [s for s in self.spans if s["traceId"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(holder: dict[str, Any]) -> dict[str, Any]:
    values = {}
    for pair in holder.get("attributes", []):
        value = pair["value"]
        (kind, raw), = value.items()
        values[pair["key"]] = int(raw) if kind == "intValue" else raw
    return values


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


def traced_gateway(gateway_factory, providers, endpoint: str, sample: float = 1.0, **tracing: Any):
    overlay = envelope([candidate("m", "provider-a"), candidate("m", "provider-b")], "deterministic")
    clusters = {name: [providers[name].address] for name in ("provider-a", "provider-b")}
    gateway = gateway_factory(clusters, overlay, extra={
        "access_log": {"path": "access.log"},
        "routing": {"retry": {"attempts": 2, "backoff": {"base": "1ms", "max": "2ms"}}},
        "tracing": {"endpoint": endpoint, "sample": sample, "flush_interval": "50ms", "service_name": "gw-test",
                    **tracing},
    })
    return gateway, os.path.join(gateway.directory, "access.log")


def upstream_traceparent(response) -> str | None:
    headers = {name.lower(): value for name, value in response.json()["mock_echo"]["headers"]}
    return headers.get("traceparent")


def test_a_sampled_client_trace_gets_the_request_and_attempt_spans(gateway_factory, providers, receiver):
    gateway, log_path = traced_gateway(gateway_factory, providers, f"http://127.0.0.1:{receiver.port}", sample=0.0)
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    response = chat(gateway.port, "m", headers=[("traceparent", parent), ("tracestate", "vendor=abc"),
                                                ("X-Mock-Echo", "1"), ("X-Request-Id", "traced")])
    assert response.status == 200

    spans = receiver.trace(CLIENT_TRACE, 2)
    assert len(spans) == 2, spans
    server = next(s for s in spans if s["kind"] == 2)
    attempt = next(s for s in spans if s["kind"] == 3)
    # The client's span is the request's parent; the request's span is the attempt's parent.
    assert server["parentSpanId"] == CLIENT_SPAN and attempt["parentSpanId"] == server["spanId"]
    assert server["service"] == "gw-test" and server["name"] == "chat m" == attempt["name"]
    assert int(server["startTimeUnixNano"]) <= int(attempt["startTimeUnixNano"])
    assert int(attempt["endTimeUnixNano"]) <= int(server["endTimeUnixNano"])
    request = attributes(server)
    assert {key: request[key] for key in ("gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model",
                                          "gen_ai.provider.name", "http.response.status_code", "gridgate.request_id",
                                          "gridgate.route.site", "gridgate.route.candidates")} == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "m", "gen_ai.response.model": "m",
        "gen_ai.provider.name": "provider-a", "http.response.status_code": 200, "gridgate.request_id": "traced",
        "gridgate.route.site": "site-provider-a", "gridgate.route.candidates": 2}
    assert server["traceState"] == attempt["traceState"] == "vendor=abc"  # the client's, carried as it came
    call = attributes(attempt)
    assert (call["gen_ai.provider.name"], call["server.address"], call["server.port"]) == (
        "provider-a", "127.0.0.1", int(providers["provider-a"].address.rsplit(":", 1)[1]))
    assert call["http.response.status_code"] == 200
    # The provider continues the trace under the attempt's span; the client's tracestate goes along.
    assert upstream_traceparent(response) == f"00-{CLIENT_TRACE}-{attempt['spanId']}-01"
    echoed = {name.lower(): value for name, value in response.json()["mock_echo"]["headers"]}
    assert echoed["tracestate"] == "vendor=abc"
    # The access line names the trace.
    line = next(line for line in wait_lines(log_path, 1) if line["request_id"] == "traced")
    assert line["trace_id"] == CLIENT_TRACE
    assert receiver.requests[0][0] == "/v1/traces"


def test_each_provider_attempt_has_its_span_and_its_own_traceparent(gateway_factory, providers, receiver):
    gateway, _ = traced_gateway(gateway_factory, providers, f"http://127.0.0.1:{receiver.port}")
    # provider-a (first, deterministic) answers 503: the request fails over to provider-b.
    response = chat(gateway.port, "m", headers=[("X-Mock-Echo", "1"), ("X-Mock-Status", "503"),
                                                ("X-Mock-Fault-For", "provider-a"), ("X-Request-Id", "moved")])
    assert (response.status, response.headers["x-gridgate-attempts"]) == (200, "2")
    trace_id = upstream_traceparent(response).split("-")[1]
    spans = receiver.trace(trace_id, 3)
    server = next(s for s in spans if s["kind"] == 2)
    attempts = sorted((s for s in spans if s["kind"] == 3), key=lambda s: int(s["startTimeUnixNano"]))
    assert "parentSpanId" not in server  # no client trace: the request's span is the root
    assert [attributes(s)["gen_ai.provider.name"] for s in attempts] == ["provider-a", "provider-b"]
    assert all(s["parentSpanId"] == server["spanId"] for s in attempts)
    assert attempts[0]["status"]["code"] == 2 and attributes(attempts[0])["http.response.status_code"] == 503
    assert attempts[1]["status"].get("code", 0) == 0
    assert upstream_traceparent(response) == f"00-{trace_id}-{attempts[1]['spanId']}-01"
    assert attributes(server)["gridgate.attempts"] == 2


def test_an_unsampled_client_trace_is_left_alone(gateway_factory, providers, receiver):
    gateway, log_path = traced_gateway(gateway_factory, providers, f"http://127.0.0.1:{receiver.port}", sample=1.0)
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    response = chat(gateway.port, "m", headers=[("traceparent", parent), ("X-Mock-Echo", "1"),
                                                ("X-Request-Id", "unsampled")])
    assert response.status == 200
    assert upstream_traceparent(response) == parent  # forwarded as it came
    # A traced request after it is exported, the unsampled one never is.
    assert chat(gateway.port, "m", headers=[("X-Mock-Echo", "1")]).status == 200
    wait_until(lambda: receiver.spans, "the next request's spans")
    assert not [s for s in receiver.spans if s["traceId"] == CLIENT_TRACE]
    line = next(line for line in wait_lines(log_path, 1) if line["request_id"] == "unsampled")
    assert "trace_id" not in line


def test_a_collector_that_is_down_costs_no_request_and_counts_the_drops(gateway_factory, providers):
    gateway, _ = traced_gateway(gateway_factory, providers, f"http://127.0.0.1:{refused_port()}", queue_size=4,
                                timeout="200ms")
    statuses = [chat(gateway.port, "m").status for _ in range(20)]
    assert statuses == [200] * 20
    dropped = wait_until(lambda: metric_value(gateway.admin_port, "gridgate_trace_spans_dropped_total") >= 40 or None,
                         "40 dropped spans (2 per request)")
    assert dropped


def test_tracing_off_sends_no_traceparent_of_its_own(gateway_factory, providers):
    overlay = envelope([candidate("m", "provider-a")])
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay)
    response = chat(gateway.port, "m", headers=[("X-Mock-Echo", "1")])
    assert response.status == 200 and upstream_traceparent(response) is None
    assert metric_value(gateway.admin_port, "gridgate_trace_spans_dropped_total") == 0


def test_a_gateway_refusal_is_traced_with_its_code_and_a_cut_stream_as_an_error(mock_provider, gateway_factory,
                                                                                 receiver):
    cut = mock_provider("cut", mid_reset_rate=1.0, tokens=40)
    overlay = envelope([candidate("m", "cut")])
    gateway = gateway_factory({"cut": [cut.address]}, overlay, extra={
        "access_log": {"path": "access.log"},
        "tracing": {"endpoint": f"http://127.0.0.1:{receiver.port}", "sample": 1.0, "flush_interval": "50ms"}})
    log_path = os.path.join(gateway.directory, "access.log")
    assert chat(gateway.port, "nope", headers=[("X-Request-Id", "unknown")]).status == 404
    assert chat(gateway.port, "m", headers=[("X-Request-Id", "cut")], stream=True).status == 200
    lines = {line["request_id"]: line for line in wait_lines(log_path, 2)}

    (refused,) = receiver.trace(lines["unknown"]["trace_id"], 1)  # no provider was tried: no attempt span
    assert refused["status"] == {}  # a 4xx is the client's error, not the span's
    assert {key: attributes(refused)[key] for key in ("http.response.status_code", "error.type")} == {
        "http.response.status_code": 404, "error.type": "model_not_found"}
    spans = receiver.trace(lines["cut"]["trace_id"], 2)
    server = next(s for s in spans if s["kind"] == 2)
    attempt = next(s for s in spans if s["kind"] == 3)
    assert server["status"]["code"] == 2 and attributes(server)["error.type"] == "upstream_reset"
    assert attempt["status"]["code"] == 2 and attributes(attempt)["error.type"] == "upstream_reset"
