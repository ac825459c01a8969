"""Back-pressure and body deadlines: a slow reader pauses the provider, a stalled upload gets 408."""

from __future__ import annotations

import socket
import threading
import time

from tests.harness import candidate, envelope, raw_exchange, status_of

BODY_BYTES = 64 * 1024 * 1024
PIECE = b"x" * 65536


class _FirehoseProvider:
    """Answers one request with a 64 MiB body as fast as the socket takes it; records bytes sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.sent = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % BODY_BYTES)
        try:
            while self.sent < BODY_BYTES:
                conn.sendall(PIECE)
                self.sent += len(PIECE)
        except OSError:
            pass
        conn.close()


def test_slow_client_pauses_the_provider_and_the_read_timeout_waits(loopback_gateway_factory):
    provider = _FirehoseProvider()
    gateway = loopback_gateway_factory({"fast": [f"127.0.0.1:{provider.port}"]}, envelope([candidate("m", "fast")]),
                              cluster_options={"read_timeout": "1s"})
    client = socket.create_connection(("127.0.0.1", gateway.port))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    client.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n'
                   b'Content-Length: 14\r\n\r\n{"model": "m"}')
    client.settimeout(10)
    head = client.recv(4096)
    assert head.startswith(b"HTTP/1.1 200 ")
    time.sleep(2.5)  # the client stops reading for longer than the provider's read_timeout
    paused_at = provider.sent
    assert paused_at < BODY_BYTES // 2, paused_at  # the gateway stopped reading the provider
    received = len(head.partition(b"\r\n\r\n")[2])
    while received < BODY_BYTES:
        data = client.recv(1 << 20)
        assert data, f"stream cut after {received} bytes"  # no read timeout while paused
        received += len(data)
    assert received == BODY_BYTES and provider.sent == BODY_BYTES
    client.close()


def test_stalled_request_body_gets_408(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p")
    gateway = loopback_gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"timeouts": {"body_read": "1s"}})
    started = time.monotonic()
    raw = raw_exchange(gateway.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 40\r\n\r\n"
                       b'{"model":', timeout=6)
    assert status_of(raw) == 408 and b"request_timeout" in raw
    assert 0.8 <= time.monotonic() - started < 4
