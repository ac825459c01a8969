"""The access log (docs/operations.md#access-log) through a real gateway: one JSON line per request,
matching the traffic."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from datetime import datetime
from typing import Any

from tests.harness import Client, candidate, chat, envelope, raw_exchange, refused_port, request, status_of

FIELDS = (
    "ts", "request_id", "tenant", "method", "path", "status", "capability", "provider", "stable_id",
    "selection_group", "selection_mode", "affinity", "attempts", "endpoint", "overlay_revision", "bytes_in",
    "bytes_out", "tokens_prompt", "tokens_completion", "overhead_ms", "first_byte_ms", "duration_ms", "error",
)
# The route evidence, on the lines of routed requests drawn by access_log.evidence_sample (0.01 by default,
# 1.0 in these tests).
EVIDENCE = ("site", "admission_state", "candidates", "excluded")
KEY = "sk-access-log-secret"
PROMPT = "a prompt the log must never hold"
AUTH = [("Authorization", f"Bearer {KEY}")]


def read_lines(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as handle:
            return [json.loads(line) for line in handle if line.startswith(b"{")]
    except FileNotFoundError:
        return []


def wait_lines(path: str, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        lines = read_lines(path)
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def ask(port: int, request_id: str, headers: list[tuple[str, str]] = AUTH, **fields: Any):
    return chat(port, "m", headers=[*headers, ("X-Request-Id", request_id)],
                messages=[{"role": "user", "content": PROMPT}], **fields)


def access_gateway(loopback_gateway_factory, providers, **access_log: Any):
    overlay = envelope([candidate("m", "provider-a"), candidate("m", "provider-b")], "roundRobin")
    clusters = {name: [providers[name].address] for name in ("provider-a", "provider-b")}
    key_hash = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
    gateway = loopback_gateway_factory(clusters, overlay, extra={
        "auth": {"keys": [{"tenant": "team-a", "key": key_hash}]},
        "access_log": {"path": "access.log", "evidence_sample": 1.0, **access_log},
    })
    return gateway, os.path.join(gateway.directory, "access.log")


def test_lines_carry_every_field_and_match_the_traffic(loopback_gateway_factory, providers):
    gateway, path = access_gateway(loopback_gateway_factory, providers)
    served = [ask(gateway.port, "ok-0"), Client(gateway.port).request(
        "POST", "/v1/chat/completions?key=query-secret", {"model": "m", "messages": [{"role": "user", "content": PROMPT}]},
        [*AUTH, ("X-Request-Id", "ok-1")])]
    failed = ask(gateway.port, "upstream-500", headers=[*AUTH, ("X-Mock-Status", "500")])
    models = Client(gateway.port).request("GET", "/v1/models", headers=AUTH)
    unknown = chat(gateway.port, "no-such-model", headers=[*AUTH, ("X-Request-Id", "unknown-model")])
    anonymous = ask(gateway.port, "no-key", headers=[])
    malformed = raw_exchange(gateway.port, b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n")
    assert [r.status for r in served] == [200, 200] and failed.status == 500 and models.status == 200
    assert unknown.status == 404 and anonymous.status == 401 and status_of(malformed) == 400

    lines = wait_lines(path, 7)
    assert len(lines) == 7, lines
    for line in lines:
        assert tuple(line) == (FIELDS + EVIDENCE if line["provider"] is not None else FIELDS)
        assert datetime.fromisoformat(line["ts"].replace("Z", "+00:00")).tzinfo is not None
    by_id = {line["request_id"]: line for line in lines}

    for response, request_id in zip(served, ("ok-0", "ok-1"), strict=True):
        line = by_id[request_id]
        assert line["status"] == 200 and line["error"] is None
        assert (line["tenant"], line["method"], line["path"]) == ("team-a", "POST", "/v1/chat/completions")
        assert line["capability"] == "m" and line["attempts"] == 1
        assert line["provider"] == response.headers["x-gridgate-provider"]
        assert line["stable_id"] == response.headers["x-gridgate-stable-id"]
        assert line["selection_mode"] == "roundRobin" and line["affinity"] == "none"
        assert line["overlay_revision"] == response.headers["x-gridgate-overlay-revision"]
        assert line["endpoint"] == providers[line["provider"]].address
        assert line["bytes_out"] == len(response.body) and line["bytes_in"] > len(PROMPT)
        assert 0 < line["overhead_ms"] <= line["first_byte_ms"] <= line["duration_ms"]
        assert (line["site"], line["admission_state"]) == (f"site-{line['provider']}", "new_and_existing")
        assert (line["candidates"], line["excluded"]) == (2, {})
    assert {by_id["ok-0"]["provider"], by_id["ok-1"]["provider"]} == {"provider-a", "provider-b"}

    upstream_error = by_id["upstream-500"]
    assert upstream_error["status"] == 500 and upstream_error["provider"] in ("provider-a", "provider-b")
    assert upstream_error["error"] is None  # the provider's answer, passed through

    listing = by_id[models.headers["x-request-id"]]
    assert (listing["status"], listing["path"], listing["provider"]) == (200, "/v1/models", None)
    assert listing["bytes_out"] == len(models.body)

    assert (by_id["unknown-model"]["status"], by_id["unknown-model"]["tenant"]) == (404, "team-a")
    assert by_id["unknown-model"]["error"] == unknown.json()["error"]["code"]
    assert (by_id["no-key"]["status"], by_id["no-key"]["tenant"], by_id["no-key"]["error"]) == (
        401, None, "invalid_api_key")
    rejected = by_id[None]
    assert (rejected["status"], rejected["method"], rejected["error"]) == (400, None, "invalid_request")

    with open(path, "rb") as handle:
        text = handle.read()
    assert KEY.encode() not in text and PROMPT.encode() not in text and b"query-secret" not in text


def test_sample_zero_logs_only_errors(loopback_gateway_factory, providers):
    gateway, path = access_gateway(loopback_gateway_factory, providers, sample=0.0)
    assert [ask(gateway.port, f"ok-{i}").status for i in range(3)] == [200, 200, 200]
    assert ask(gateway.port, "failed", headers=[*AUTH, ("X-Mock-Status", "503")]).status == 503
    assert ask(gateway.port, "refused", headers=[]).status == 401
    # Lines keep the order of the requests: had a success been logged, it would come first.
    assert [(line["request_id"], line["status"]) for line in wait_lines(path, 2)] == [("failed", 503), ("refused", 401)]


def test_sigusr1_reopens_the_file_for_logrotate(gateway_factory, providers):
    gateway, path = access_gateway(gateway_factory, providers)
    workers = gateway.worker_pids()
    assert ask(gateway.port, "before").status == 200
    assert [line["request_id"] for line in wait_lines(path, 1)] == ["before"]
    os.rename(path, path + ".1")
    assert ask(gateway.port, "after-rename").status == 200  # still goes to the renamed file
    gateway.signal(signal.SIGUSR1)  # to the supervisor, as logrotate's postrotate does
    deadline = time.monotonic() + 5
    sent = 0
    while not read_lines(path) and time.monotonic() < deadline:
        assert ask(gateway.port, f"after-reopen-{sent}").status == 200
        sent += 1
        time.sleep(0.05)
    while len(read_lines(path + ".1")) + len(read_lines(path)) < 2 + sent and time.monotonic() < deadline:
        time.sleep(0.02)  # the last lines may still be in the worker's buffer
    rotated = [line["request_id"] for line in read_lines(path + ".1")]
    fresh = [line["request_id"] for line in read_lines(path)]
    assert rotated[:2] == ["before", "after-rename"]
    assert fresh and all(request_id.startswith("after-reopen-") for request_id in fresh)
    assert sorted(rotated[2:] + fresh) == sorted(f"after-reopen-{i}" for i in range(sent))  # none lost
    assert gateway.worker_pids() == workers  # nobody died of the signal


def test_standard_output_by_default(gateway_factory, providers):
    overlay = envelope([candidate("m", "provider-a")])
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay)
    status, headers, _ = request("127.0.0.1", gateway.port, "GET", "/v1/models")
    assert status == 200
    lines = wait_lines(gateway.log_path, 1)  # the harness captures stdout (and stderr) in gateway.log
    assert [(line["request_id"], line["path"], line["tenant"]) for line in lines] == [
        (headers["x-request-id"], "/v1/models", "anonymous")]


def test_failover_and_cut_streams_are_logged_with_attempts_and_errors(mock_provider, loopback_gateway_factory):
    bad = mock_provider("bad", fail_rate=1.0, fail_status=502)
    good = mock_provider("good")
    cut = mock_provider("cut", mid_reset_rate=1.0, tokens=40)
    overlay = envelope([candidate("m", "bad"), candidate("m", "good"), candidate("s", "cut"), candidate("x", "dead"),
                        candidate("x", "bad")], "deterministic")
    clusters = {"bad": [bad.address], "good": [good.address], "cut": [cut.address], "dead": [f"127.0.0.1:{refused_port()}"]}
    gateway = loopback_gateway_factory(clusters, overlay, extra={
        "routing": {"retry": {"attempts": 3, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}},
        "access_log": {"path": "access.log"},
    })
    path = os.path.join(gateway.directory, "access.log")
    moved = chat(gateway.port, "m", headers=[("X-Request-Id", "moved")])
    streamed = chat(gateway.port, "s", headers=[("X-Request-Id", "cut")], stream=True)
    failed = chat(gateway.port, "x", headers=[("X-Request-Id", "failed")])
    assert (moved.status, moved.headers["x-gridgate-attempts"], streamed.status, failed.status) == (200, "2", 200, 502)

    by_id = {line["request_id"]: line for line in wait_lines(path, 3)}
    assert {key: by_id["moved"][key] for key in ("status", "provider", "attempts", "endpoint", "error")} == {
        "status": 200, "provider": "good", "attempts": 2, "endpoint": good.address, "error": None}
    assert {key: by_id["cut"][key] for key in ("status", "provider", "attempts", "error")} == {
        "status": 200, "provider": "cut", "attempts": 1, "error": "upstream_reset"}
    assert by_id["cut"]["bytes_out"] == len(streamed.body)
    assert {key: by_id["failed"][key] for key in ("status", "provider", "attempts", "error")} == {
        "status": 502, "provider": "bad", "attempts": 2, "error": failed.json()["error"]["code"]}  # all failed


def test_candidates_removed_by_the_eligibility_filters_are_counted(providers, loopback_gateway_factory):
    models = [{"match": {"capability": "m", "cluster": "provider-a"}, "context_window": 2000}]
    overlay = envelope([candidate("m", "provider-a"), candidate("m", "provider-b")], "roundRobin")
    clusters = {name: [providers[name].address] for name in ("provider-a", "provider-b")}
    gateway = loopback_gateway_factory(clusters, overlay, extra={"routing": {"models": models},
                                                        "access_log": {"path": "access.log"}})
    big = chat(gateway.port, "m", headers=[("X-Request-Id", "big")], max_tokens=50_000)
    small = chat(gateway.port, "m", headers=[("X-Request-Id", "small")], max_tokens=10)
    assert (big.status, big.headers["x-gridgate-filtered"], small.status) == (200, "1", 200)
    by_id = {line["request_id"]: line for line in wait_lines(os.path.join(gateway.directory, "access.log"), 2)}
    assert (by_id["big"]["provider"], by_id["big"]["filtered"]) == ("provider-b", 1)
    assert by_id["big"]["filtered_reasons"] == ["context_window"]
    assert "filtered" not in by_id["small"] and "filtered_reasons" not in by_id["small"]  # present only when a filter removed a candidate


def test_a_tls_handshake_on_the_plain_listener_gets_no_answer_and_no_line(gateway_factory, providers):
    """A client that expected https:// (a browser, `curl https://`, a TLS health probe) sent a
    ClientHello: it made no HTTP request, so it is closed without an answer and logs no line of nulls."""
    import socket
    import ssl

    gateway, path = access_gateway(gateway_factory, providers)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
            try:
                context.wrap_socket(sock, server_hostname="127.0.0.1")
            except (ssl.SSLError, OSError) as exc:
                handshake_error = exc
            else:
                raise AssertionError("a TLS handshake with a plain HTTP listener succeeded")
        assert "HTTP" not in str(handshake_error)  # closed, not answered with an HTTP 400
    assert ask(gateway.port, "after-tls").status == 200  # a positive signal: this line is written
    lines = wait_lines(path, 1)
    time.sleep(0.2)  # the access log writes out every 50 ms: a line of the probes would be there too
    assert [line["request_id"] for line in read_lines(path)] == ["after-tls"], lines
