"""The mock provider speaks OpenAI-style HTTP/1.1 correctly: it is the far end of every gateway test."""

from __future__ import annotations

import email.utils
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProviderHandle]:
    with start_mock_provider_process(0, "provider-t", tokens=6, models="m1,m2") as handle:
        yield handle


# --------------------------------------------------------------------------------------------------
# A deliberately small client: raw sockets, so keep-alive and pipelining are visible.


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    def sse_events(self) -> list[str]:
        text = self.body.decode()
        return [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]


def build_request(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                  close: bool = False) -> bytes:
    payload = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(payload)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def read_response(stream: Any) -> Response:
    """Read one response from a socket file: Content-Length or chunked framing."""
    status_line = stream.readline()
    if not status_line:
        raise ConnectionError("closed before a response")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int(stream.readline().strip(), 16)
            chunk = stream.read(size + 2)
            if len(chunk) < size + 2:
                raise ConnectionError("closed inside a chunk")
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = stream.read(int(headers.get("content-length", "0")))
    return Response(status, headers, body)


def request(mock: MockProviderHandle, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None) -> Response:
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(build_request(method, path, body, headers, close=True))
        return read_response(sock.makefile("rb"))


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m1", "messages": [{"role": "user", "content": "Hello there, mock!"}], **extra}


# --------------------------------------------------------------------------------------------------
# Plain JSON


def test_chat_completion_json_carries_usage_and_provider_header(mock: MockProviderHandle) -> None:
    response = request(mock, "POST", CHAT, chat_body())
    assert response.status == 200
    assert response.headers["x-mock-provider"] == "provider-t"
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert payload["object"] == "chat.completion"
    assert payload["model"] == "m1"
    assert payload["choices"][0]["message"]["role"] == "assistant"
    assert payload["choices"][0]["finish_reason"] == "stop"
    usage = payload["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_max_tokens_caps_output_and_finishes_with_length(mock: MockProviderHandle) -> None:
    payload = request(mock, "POST", CHAT, chat_body(max_tokens=2)).json()
    assert payload["usage"]["completion_tokens"] == 2
    assert payload["choices"][0]["finish_reason"] == "length"


def test_x_mock_tokens_sets_output_length(mock: MockProviderHandle) -> None:
    payload = request(mock, "POST", CHAT, chat_body(), {"X-Mock-Tokens": "11"}).json()
    assert payload["usage"]["completion_tokens"] == 11


def test_completions_embeddings_and_models(mock: MockProviderHandle) -> None:
    completion = request(mock, "POST", "/v1/completions", {"model": "m2", "prompt": "abc"}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 6
    embeddings = request(mock, "POST", "/v1/embeddings", {"model": "e", "input": ["a", "b"]}).json()
    assert [item["index"] for item in embeddings["data"]] == [0, 1]
    assert embeddings["usage"]["prompt_tokens"] >= 1
    models = request(mock, "GET", "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["m1", "m2"]


# --------------------------------------------------------------------------------------------------
# SSE


def test_stream_without_include_usage_has_no_usage_chunk(mock: MockProviderHandle) -> None:
    response = request(mock, "POST", CHAT, chat_body(stream=True))
    assert response.status == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    events = response.sse_events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text.startswith("Hello from provider-t")


def test_stream_with_include_usage_ends_with_usage_only_chunk(mock: MockProviderHandle) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=3)
    chunks = [json.loads(e) for e in request(mock, "POST", CHAT, body).sse_events()[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 3


def test_stream_paces_tokens(mock: MockProviderHandle) -> None:
    started = time.monotonic()
    response = request(mock, "POST", CHAT, chat_body(stream=True),
                       {"X-Mock-Tokens": "5", "X-Mock-Tokens-Per-S": "50", "X-Mock-TTFT-Ms": "20"})
    elapsed = time.monotonic() - started
    assert response.sse_events()[-1] == "[DONE]"
    assert 0.09 <= elapsed < 2.0  # 20 ms TTFT + 4 gaps of 20 ms


# --------------------------------------------------------------------------------------------------
# HTTP/1.1 framing


def test_keep_alive_and_pipelining_answer_in_order(mock: MockProviderHandle) -> None:
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        stream = sock.makefile("rb")
        # A delayed request between instant ones: answers must still come back in request order.
        sock.sendall(build_request("POST", CHAT, chat_body(), {"X-Mock-Tokens": "1"})
                     + build_request("POST", CHAT, chat_body(), {"X-Mock-Tokens": "2", "X-Mock-Latency-Ms": "50"})
                     + build_request("POST", CHAT, chat_body(stream=True), {"X-Mock-Tokens": "3"})
                     + build_request("GET", "/health"))
        first, second, third, fourth = (read_response(stream) for _ in range(4))
        assert first.json()["usage"]["completion_tokens"] == 1
        assert second.json()["usage"]["completion_tokens"] == 2
        assert third.sse_events()[-1] == "[DONE]"
        assert fourth.json()["status"] == "ok"
        # The connection stays open for more.
        sock.sendall(build_request("GET", "/health"))
        assert read_response(stream).status == 200


def test_chunked_request_body_is_decoded(mock: MockProviderHandle) -> None:
    head = b"POST /debug/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(head + b"5;ext=1\r\nhello\r\n")
        time.sleep(0.02)  # body split across reads
        sock.sendall(b"6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
        assert read_response(sock.makefile("rb")).json()["body"] == "hello world"


def test_malformed_request_gets_400_and_close(mock: MockProviderHandle) -> None:
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        stream = sock.makefile("rb")
        assert read_response(stream).status == 400
        assert stream.read() == b""


def test_echo_returns_method_path_headers_and_body(mock: MockProviderHandle) -> None:
    echo = request(mock, "POST", "/debug/echo?x=1", b"raw", {"X-Custom": "v1", "x-custom": "v2"}).json()
    assert echo["method"] == "POST" and echo["path"] == "/debug/echo" and echo["target"] == "/debug/echo?x=1"
    assert ["X-Custom", "v1"] in echo["headers"] and ["x-custom", "v2"] in echo["headers"]
    assert echo["body"] == "raw"
    assert request(mock, "GET", "/debug/echo").json()["method"] == "GET"


# --------------------------------------------------------------------------------------------------
# Failure injection


def test_status_header_injects_openai_error(mock: MockProviderHandle) -> None:
    response = request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": "503"})
    assert response.status == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "injected_503"


def test_reset_before_closes_without_a_byte(mock: MockProviderHandle) -> None:
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(build_request("POST", CHAT, chat_body(), {"X-Mock-Reset": "before"}))
        try:
            assert sock.recv(1024) == b""
        except ConnectionResetError:
            pass


def test_reset_mid_stream_cuts_the_stream(mock: MockProviderHandle) -> None:
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(build_request("POST", CHAT, chat_body(stream=True), {"X-Mock-Reset": "mid"}))
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    assert received.startswith(b"HTTP/1.1 200")
    assert b"chat.completion.chunk" in received and b"[DONE]" not in received


def test_stall_delays_the_response(mock: MockProviderHandle) -> None:
    started = time.monotonic()
    assert request(mock, "POST", CHAT, chat_body(), {"X-Mock-Stall-Ms": "300"}).status == 200
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_retry_after_header_sets_delta_seconds_on_any_error(mock: MockProviderHandle, status: int) -> None:
    response = request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": str(status), "X-Mock-Retry-After": "7"})
    assert response.status == status
    assert response.headers["retry-after"] == "7"
    assert response.json()["error"]["code"] == f"injected_{status}"


def test_retry_after_as_an_http_date(mock: MockProviderHandle) -> None:
    fixed = "Wed, 21 Oct 2015 07:28:00 GMT"
    response = request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": "429", "X-Mock-Retry-After": fixed})
    assert response.headers["retry-after"] == fixed
    response = request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": "503", "X-Mock-Retry-After": "date+30"})
    when = email.utils.parsedate_to_datetime(response.headers["retry-after"]).timestamp()
    assert 25 <= when - time.time() <= 31
    assert request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": "429", "X-Mock-Retry-After": "date+x"}).status == 400


def test_retry_after_none_and_defaults(mock: MockProviderHandle) -> None:
    assert "retry-after" not in request(mock, "POST", CHAT, chat_body(),
                                        {"X-Mock-Status": "429", "X-Mock-Retry-After": "none"}).headers
    assert "retry-after" not in request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": "502"}).headers
    assert request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": "429"}).headers["retry-after"] == "1"


def test_admin_config_answers_the_next_requests_429_with_retry_after(mock: MockProviderHandle) -> None:
    try:
        request(mock, "POST", "/admin/config", {"fail_next": 2, "fail_status": 429, "retry_after": "2"})
        answers = [request(mock, "POST", CHAT, chat_body()) for _ in range(3)]
        assert [r.status for r in answers] == [429, 429, 200]
        assert [r.headers.get("retry-after") for r in answers] == ["2", "2", None]
        assert request(mock, "GET", "/admin/config").json()["fail_next"] == 0
        assert request(mock, "POST", "/admin/config", {"retry_after": 2}).status == 400  # a string
    finally:
        request(mock, "POST", "/admin/config", {"fail_next": 0, "fail_status": 503, "retry_after": None})


def test_fault_headers_apply_only_to_the_named_mocks(mock: MockProviderHandle) -> None:
    faults = {"X-Mock-Status": "503", "X-Mock-Reset": "before", "X-Mock-Stall-Ms": "2000"}
    started = time.monotonic()
    elsewhere = request(mock, "POST", CHAT, chat_body(), {**faults, "X-Mock-Fault-For": "provider-x, provider-y"})
    assert elsewhere.status == 200 and time.monotonic() - started < 1.5
    here = request(mock, "POST", CHAT, chat_body(), {"X-Mock-Status": "503", "X-Mock-Fault-For": "provider-x,provider-t"})
    assert here.status == 503


def test_reset_mid_close_cuts_a_stream_with_a_fin(mock: MockProviderHandle) -> None:
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(build_request("POST", CHAT, chat_body(stream=True), {"X-Mock-Reset": "mid-close",
                                                                          "X-Mock-Tokens": "10"}))
        received = b""
        while chunk := sock.recv(65536):  # a clean EOF: no ConnectionResetError
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    assert received.count(b'"content":"') in (5, 6)  # the opening event and half of the ten tokens
    assert b"[DONE]" not in received and not received.endswith(b"0\r\n\r\n")


def test_first_byte_stall_on_a_stream_holds_the_head(mock: MockProviderHandle) -> None:
    with socket.create_connection((mock.host, mock.port), timeout=0.4) as sock:
        sock.sendall(build_request("POST", CHAT, chat_body(stream=True), {"X-Mock-Stall-Ms": "800"}))
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.settimeout(5)
        assert read_response(sock.makefile("rb")).sse_events()[-1] == "[DONE]"


# --------------------------------------------------------------------------------------------------
# Health and metrics


def test_health_can_be_switched_to_failing_and_back(mock: MockProviderHandle) -> None:
    assert request(mock, "GET", "/health").status == 200
    try:
        assert request(mock, "POST", "/admin/health", {"status": 503}).status == 200
        assert request(mock, "GET", "/health").status == 503
    finally:
        request(mock, "POST", "/admin/health", {"status": 200})
    assert request(mock, "GET", "/health").status == 200


def metric(text: str, name: str, absent: float | None = None) -> float:
    """``name``'s value; ``absent`` when given and the series is not there yet (a counter before its first
    count), else an AssertionError."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if absent is not None:
        return absent
    raise AssertionError(f"{name} not in metrics")


def test_metrics_report_in_flight_kv_cache_and_served(mock: MockProviderHandle) -> None:
    before = request(mock, "GET", "/metrics").body.decode()
    with socket.create_connection((mock.host, mock.port), timeout=5) as slow:
        slow.sendall(build_request("POST", CHAT, chat_body(stream=True), {"X-Mock-Latency-Ms": "1000"}))
        # Read while the mock holds it (a second), once it has taken it in: not after a fixed 0.1 s, which a
        # slow machine may need to get the request to the mock at all.
        deadline = time.monotonic() + 5
        during = request(mock, "GET", "/metrics").body.decode()
        while metric(during, "mock_requests_in_flight") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
            during = request(mock, "GET", "/metrics").body.decode()
        assert read_response(slow.makefile("rb")).status == 200
    after = request(mock, "GET", "/metrics").body.decode()
    assert metric(during, "mock_requests_in_flight") == 1
    assert metric(during, "mock_queue_depth") == 1
    assert metric(during, "mock_kv_cache_utilization") > 0
    assert metric(after, "mock_requests_in_flight") == 0
    served = 'mock_requests_served_total{provider="provider-t",endpoint="chat"}'
    # The module's mock may have served nothing before this test (run alone): no series yet is 0.
    assert metric(after, served) == metric(before, served, absent=0.0) + 1


def test_processes_share_one_health_status() -> None:
    with start_mock_provider_process(0, "multi", processes=2) as handle:
        request(handle, "POST", "/admin/health", {"status": 500})
        # New connections spread over both processes; every one must see the switched status.
        assert {request(handle, "GET", "/health").status for _ in range(20)} == {500}


def test_a_port_in_use_is_an_error_not_a_shared_port(mock: MockProviderHandle) -> None:
    # SO_REUSEPORT must not let a second mock silently take half of another one's connections.
    with pytest.raises(RuntimeError, match="before listening"):
        start_mock_provider_process(mock.port, "intruder")


def test_admin_config_overrides_load_metrics(mock: MockProviderHandle) -> None:
    try:
        settings = request(mock, "POST", "/admin/config", {"kv_cache_utilization": 0.8, "queue_depth": 7}).json()
        assert settings["queue_depth"] == 7
        text = request(mock, "GET", "/metrics").body.decode()
        assert metric(text, "mock_kv_cache_utilization") == 0.8
        assert metric(text, "mock_queue_depth") == 7
        assert request(mock, "POST", "/admin/config", {"no_such_knob": 1}).status == 400
    finally:
        request(mock, "POST", "/admin/config", {"kv_cache_utilization": None, "queue_depth": None})
