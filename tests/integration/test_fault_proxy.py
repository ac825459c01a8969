"""The fault proxy does what each fault says, seen by a real client talking to a real mock provider."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from loadtest.fault_proxy import NO_FAULT, Fault, FaultProxyThread
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process
from tests.harness import ROOT

CHAT_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProviderHandle]:
    with start_mock_provider_process(0, "behind-proxy", tokens=8) as handle:
        yield handle


@pytest.fixture
def proxy(mock: MockProviderHandle) -> Iterator[FaultProxyThread]:
    with FaultProxyThread(mock.address) as running:
        yield running


def chat_request(*headers: str, close: bool = True, stream: bool = False) -> bytes:
    body = CHAT_BODY if not stream else json.dumps({"model": "m", "stream": True}).encode()
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: p", f"Content-Length: {len(body)}", *headers]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_close(sock: socket.socket) -> tuple[bytes, str]:
    """Everything received, and how it ended: 'eof', 'reset' or 'timeout'."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received, "reset"
        except TimeoutError:
            return received, "timeout"
        if not chunk:
            return received, "eof"
        received += chunk


def exchange(port: int, payload: bytes, timeout: float = 5.0) -> tuple[bytes, str]:
    try:
        sock = connect(port, timeout)
    except ConnectionResetError:  # the proxy reset the connection before connect() reported it open
        return b"", "reset"
    with sock:
        try:
            sock.sendall(payload)
        except (ConnectionResetError, BrokenPipeError):
            return b"", "reset"
        return read_until_close(sock)


def read_response(sock: socket.socket) -> bytes:
    """One Content-Length response on a keep-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the head")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_without_a_fault_the_answer_is_the_providers(proxy: FaultProxyThread, mock: MockProviderHandle) -> None:
    direct, _ = exchange(mock.port, chat_request())
    relayed, ending = exchange(proxy.port, chat_request())
    assert ending == "eof"
    assert relayed.startswith(b"HTTP/1.1 200")
    assert b"x-mock-provider: behind-proxy" in relayed
    assert json.loads(relayed.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 8
    assert abs(len(relayed) - len(direct)) <= 4  # only the response id's digits differ
    assert proxy.stats.bytes_down == len(relayed) and proxy.stats.bytes_up == len(chat_request())


def test_delay_holds_every_byte_back(proxy: FaultProxyThread) -> None:
    proxy.set_fault(delay_s=0.4)
    started = time.monotonic()
    with connect(proxy.port) as sock:
        sock.sendall(chat_request())
        first = sock.recv(1)
        first_byte_s = time.monotonic() - started
    assert first == b"H"
    assert 0.4 <= first_byte_s < 3.0


def test_chunk_delay_slows_each_response_chunk(proxy: FaultProxyThread) -> None:
    proxy.set_fault(chunk_delay_s=0.15)
    started = time.monotonic()
    # A paced stream: one SSE event every 50 ms arrives as several reads, each delayed.
    received, ending = exchange(proxy.port, chat_request("X-Mock-Tokens: 6", "X-Mock-Tokens-Per-S: 20",
                                                         stream=True))
    elapsed = time.monotonic() - started
    assert ending == "eof" and received.rstrip().endswith(b"0")
    assert b"data: [DONE]" in received
    assert 0.45 <= elapsed < 5.0  # at least three delayed chunks


def test_stall_after_zero_accepts_and_never_answers_until_cleared(proxy: FaultProxyThread) -> None:
    proxy.set_fault(stall_after=0)
    with connect(proxy.port, timeout=0.6) as sock:
        sock.sendall(chat_request())
        with pytest.raises(TimeoutError):
            sock.recv(1)
        proxy.set_fault(NO_FAULT)  # the held response flows once the fault is gone
        sock.settimeout(5)
        received, ending = read_until_close(sock)
    assert received.startswith(b"HTTP/1.1 200") and ending == "eof"


def test_stall_after_n_bytes_relays_exactly_n(proxy: FaultProxyThread) -> None:
    proxy.set_fault(stall_after=100)
    with connect(proxy.port, timeout=0.8) as sock:
        sock.sendall(chat_request())
        received, ending = read_until_close(sock)
    assert ending == "timeout"
    assert len(received) == 100 and received.startswith(b"HTTP/1.1 200")


def test_reset_after_n_bytes_sends_a_rst_after_exactly_n(proxy: FaultProxyThread) -> None:
    proxy.set_fault(reset_after=120)
    received, ending = exchange(proxy.port, chat_request())
    assert (len(received), ending) == (120, "reset")
    assert proxy.stats.resets == 1


def test_reset_after_zero_resets_before_the_head(proxy: FaultProxyThread) -> None:
    proxy.set_fault(reset_after=0)
    assert exchange(proxy.port, chat_request()) == (b"", "reset")


def test_a_fault_set_later_applies_to_an_open_keep_alive_connection(proxy: FaultProxyThread) -> None:
    with connect(proxy.port) as sock:
        sock.sendall(chat_request(close=False))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        proxy.set_fault(reset_after=0)  # e.g. a gateway's pooled connection to this provider
        sock.sendall(chat_request(close=False))
        assert read_until_close(sock) == (b"", "reset")


def test_refuse_closes_the_listener_and_accept_reopens_the_same_port(proxy: FaultProxyThread) -> None:
    proxy.set_fault(on_connect="refuse")
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        connect(proxy.port)
    assert time.monotonic() - started < 1.0
    proxy.set_fault(NO_FAULT)
    assert exchange(proxy.port, chat_request())[0].startswith(b"HTTP/1.1 200")


def test_reset_on_connect_completes_the_handshake_then_resets(proxy: FaultProxyThread) -> None:
    proxy.set_fault(on_connect="reset")
    try:
        # The RST may already be there when connect() returns (loopback is that fast).
        with connect(proxy.port) as sock:
            sock.sendall(chat_request())
            assert read_until_close(sock) == (b"", "reset")
    except (ConnectionResetError, BrokenPipeError):
        pass
    assert proxy.stats.accepted == proxy.stats.reset_on_accept == 1  # accepted, then reset


def test_blackhole_makes_connect_time_out(proxy: FaultProxyThread) -> None:
    proxy.set_fault(on_connect="blackhole")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        connect(proxy.port, timeout=1.0)
    assert time.monotonic() - started >= 0.9  # it hung until our deadline: no refusal, no reset
    proxy.set_fault(NO_FAULT)
    assert exchange(proxy.port, chat_request())[0].startswith(b"HTTP/1.1 200")


def test_slow_close_delays_only_the_end_of_the_connection(proxy: FaultProxyThread) -> None:
    proxy.set_fault(slow_close_s=0.6)
    started = time.monotonic()
    with connect(proxy.port) as sock:
        sock.sendall(chat_request())
        body = b""
        while b'"total_tokens"' not in body:
            body += sock.recv(65536)
        body_s = time.monotonic() - started
        received, ending = read_until_close(sock)
        closed_s = time.monotonic() - started
    assert ending == "eof" and (body + received).endswith(b"}}")  # the whole JSON, then the close
    assert body_s < 0.5
    assert 0.6 <= closed_s < 3.0


def test_bandwidth_cap_paces_the_response(proxy: FaultProxyThread) -> None:
    proxy.set_fault(bytes_per_s=20_000)
    started = time.monotonic()
    received, ending = exchange(proxy.port, chat_request("X-Mock-Tokens: 2000"))
    elapsed = time.monotonic() - started
    assert ending == "eof" and json.loads(received.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 2000
    assert len(received) > 10_000
    assert elapsed >= 0.8 * len(received) / 20_000
    assert elapsed < 4 * len(received) / 20_000 + 1


def test_reset_connections_rsts_open_connections(proxy: FaultProxyThread) -> None:
    with connect(proxy.port) as sock:
        sock.sendall(chat_request(close=False))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert proxy.reset_connections() == 1
        assert read_until_close(sock) == (b"", "reset")


def test_an_unreachable_upstream_resets_the_client() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = unused.getsockname()
    with FaultProxyThread(dead) as proxy:
        assert exchange(proxy.port, chat_request()) == (b"", "reset")
        assert proxy.stats.upstream_failures == 1


def test_bad_faults_are_rejected_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="on_connect"):
        Fault(on_connect="drop")
    with pytest.raises(ValueError, match="stall_after"):
        Fault(stall_after=-1)
    with pytest.raises(ValueError, match="unknown fault field.*latency"):
        Fault.from_mapping({"latency": 1})


def test_cli_relays_and_takes_faults_on_stdin(mock: MockProviderHandle) -> None:
    process = subprocess.Popen([sys.executable, "-m", "loadtest.fault_proxy", "--upstream", mock.address],
                               cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("fault-proxy listening on 127.0.0.1:")
        port = int(line.split()[3].rsplit(":", 1)[1])
        assert exchange(port, chat_request())[0].startswith(b"HTTP/1.1 200")
        process.stdin.write('{"on_connect": "refuse"}\n')
        process.stdin.flush()
        assert process.stdout.readline().startswith("fault-proxy: fault {'on_connect': 'refuse'")
        with pytest.raises(ConnectionRefusedError):
            connect(port)
    finally:
        process.terminate()
        assert process.wait(5) == 0
