"""The one probe client (health checks and the control plane's observer) against real loopback servers."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gateway.cluster.spec import ClusterSpec, EndpointSpec, HealthCheckSpec, TlsSpec, all_endpoint_ids
from gateway.health.probe import ProbeError, ProbeTarget, http_get, tcp_connect
from gateway.health.writer import run_health_checks
from gateway.net import client_tls_context
from shm.counters import HealthTable
from shm.segment import Segment

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler, **options) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, **options)
    return server, server.sockets[0].getsockname()[1]


def _answer(raw: bytes, *, close: bool = True) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(raw)
        await writer.drain()
        if close:
            writer.close()
        else:
            await asyncio.sleep(5)  # keeps the connection open: only a status-only read returns early

    return handle


def _probe(raw: bytes, *, close: bool = True, timeout_s: float = 2.0, **options) -> tuple[int, bytes]:
    async def scenario() -> tuple[int, bytes]:
        server, port = await _serve(_answer(raw, close=close))
        try:
            return await http_get(f"http://127.0.0.1:{port}/metrics?x=1", timeout_s, **options)
        finally:
            server.close()

    return asyncio.run(scenario())


def test_a_get_reads_content_length_chunked_and_until_close_bodies() -> None:
    assert _probe(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello") == (200, b"hello")
    chunked = b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    assert _probe(chunked) == (503, b"abcde")
    assert _probe(b"HTTP/1.0 204 No Content\r\n\r\n") == (204, b"")
    assert _probe(b"HTTP/1.0 200 OK\r\n\r\nuntil the end") == (200, b"until the end")
    assert _probe(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") == (200, b"ok")


def test_a_body_is_read_across_many_small_writes() -> None:
    async def scenario() -> tuple[int, bytes]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            for piece in (b"HTTP/1.1 200 OK\r\nTransfer-", b"Encoding: chunked\r\n\r\n4\r\nmet", b"r\r\n",
                          b"3\r\nics\r\n0\r", b"\n\r\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
            await asyncio.sleep(5)  # a complete chunked body needs no close

        server, port = await _serve(handle)
        try:
            return await http_get(f"http://127.0.0.1:{port}/metrics", 2.0)
        finally:
            server.close()

    assert asyncio.run(scenario()) == (200, b"metrics")


def test_status_only_returns_at_the_status_line_without_waiting_for_the_body() -> None:
    started = time.monotonic()
    assert _probe(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", close=False, status_only=True) == (200, b"")
    assert time.monotonic() - started < 1.0


def test_the_request_is_one_get_with_host_and_close() -> None:
    async def scenario() -> bytes:
        heads: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            writer.close()

        server, port = await _serve(handle)
        await http_get(f"http://127.0.0.1:{port}/health?deep=1", 2.0, user_agent="gridgate-test")
        server.close()
        return heads[0]

    head = asyncio.run(scenario())
    assert head.startswith(b"GET /health?deep=1 HTTP/1.1\r\n")
    lines = head.lower().split(b"\r\n")  # field names are case-insensitive
    assert b"connection: close" in lines and b"user-agent: gridgate-test" in lines
    assert any(line.startswith(b"host: 127.0.0.1:") for line in lines)


@pytest.mark.parametrize(("raw", "message"), [
    (b"", "empty response"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "malformed response head"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed response head"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "truncated body"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", "truncated body"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed body"),
    (b"HTTP/1.1 200 OK\r\nContent-", "incomplete response head"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "malformed response head"),
])
def test_garbled_answers_are_probe_errors_that_say_why(raw: bytes, message: str) -> None:
    with pytest.raises(ProbeError, match=message):
        _probe(raw)


def test_refused_and_silent_endpoints_are_probe_errors_that_say_why() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ProbeError, match="connection refused"):
        asyncio.run(http_get(f"http://127.0.0.1:{port}/", 1.0))
    with pytest.raises(ProbeError, match="connection refused"):
        asyncio.run(tcp_connect("127.0.0.1", port, 1.0))
    with pytest.raises(ProbeError, match=r"timed out after 0\.2s"):
        _probe(b"", close=False, timeout_s=0.2)


def test_tcp_connect_succeeds_on_a_listening_port() -> None:
    async def scenario() -> None:
        server, port = await _serve(_answer(b""))
        await tcp_connect("127.0.0.1", port, 1.0)
        server.close()

    asyncio.run(scenario())


# -- TLS: the cluster's TLS settings apply to health probes as to requests -------------------------

@pytest.fixture
def certificate(tmp_path: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=provider.test",
         "-addext", "subjectAltName=DNS:provider.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def _tls_server_context(cert: str, key: str, seen_sni: list[str | None]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: seen_sni.append(name)
    return context


def test_https_probe_verifies_against_the_given_ca_and_sends_the_server_name(certificate) -> None:
    cert, key = certificate
    seen_sni: list[str | None] = []

    async def scenario() -> None:
        server, port = await _serve(_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
                                    ssl=_tls_server_context(cert, key, seen_sni))
        trusted = ProbeTarget("127.0.0.1", port, "/health", f"127.0.0.1:{port}",
                              ssl_context=client_tls_context(ca_file=cert), server_name="provider.test")
        assert await http_get(trusted, 2.0) == (200, b"ok")
        assert seen_sni == ["provider.test"]
        with pytest.raises(ProbeError, match="TLS: "):  # verification on, certificate not trusted
            await http_get(f"https://127.0.0.1:{port}/health", 2.0)
        unverified = ProbeTarget("127.0.0.1", port, "/health", f"127.0.0.1:{port}",
                                 ssl_context=client_tls_context(verify=False))
        assert await http_get(unverified, 2.0, status_only=True) == (200, b"")
        server.close()

    asyncio.run(scenario())


def test_health_checks_of_a_tls_cluster_use_its_ca_and_sni(certificate) -> None:
    cert, key = certificate
    seen_sni: list[str | None] = []

    async def scenario() -> None:
        server, port = await _serve(_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
                                    ssl=_tls_server_context(cert, key, seen_sni))
        check = HealthCheckSpec(interval_s=0.03, timeout_s=1.0, healthy_threshold=1, unhealthy_threshold=1)
        address = f"127.0.0.1:{port}"
        trusted = ClusterSpec("t", (EndpointSpec(address),), tls=TlsSpec("provider.test", cert), health_check=check)
        untrusted = ClusterSpec("u", (EndpointSpec(address),), tls=TlsSpec("provider.test"), health_check=check)
        segment = Segment.create(max_workers=1, max_endpoints=4)
        slots = segment.directory.assign(all_endpoint_ids([trusted, untrusted]))
        table = HealthTable(segment)
        stop = asyncio.Event()
        task = asyncio.create_task(run_health_checks([trusted, untrusted], segment, stop))
        deadline = time.monotonic() + 3.0
        while not table.read(slots[f"u/{address}"]).active_down or len(seen_sni) < 3:
            assert time.monotonic() < deadline, "the untrusted cluster never went down"
            await asyncio.sleep(0.01)
        stop.set()
        await task
        server.close()
        assert not table.read(slots[f"t/{address}"]).active_down
        assert set(seen_sni) == {"provider.test"}

    asyncio.run(scenario())
