"""No client input grows a worker without bound (issue 20 item 3, issue 27 items 2, 3, 12, 13).

Real gateway processes, real mock provider, raw sockets; what is asserted is read from the outside:
statuses and bytes on the wire, counts at the provider, the worker's RSS (VmRSS in /proc/<pid>/status)
and CPU time (/proc/<pid>/stat). The bounds are the ones docs/conformance.md states.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from gateway.identity.auth import hash_api_key
from tests.harness import candidate, envelope, mock_served, raw_exchange, status_of

MiB = 1024 * 1024
KEY = "sk-bounds-test"
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"  # head, unended


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connect(port: int, rcvbuf: int | None = None, sndbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    received = bytearray()
    try:
        while data := sock.recv(1 << 20):
            received += data
    except (TimeoutError, ConnectionResetError):
        pass
    return bytes(received)


def chat_body(size: int) -> bytes:
    """A valid chat completion body of exactly ``size`` bytes."""
    frame = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}'
    return frame % (b"x" * (size - len(frame) + 2))


def post_head(length: int, key: str | None = KEY, chunked: bool = False) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
    if key:
        head += b"Authorization: Bearer " + key.encode() + b"\r\n"
    head += b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % length
    return head + b"\r\n"


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """One worker with auth on, small body limits (1 MiB per body, 2 MiB per worker), 1 s body deadline,
    and no request cap per connection (a pipelining client gets all its answers)."""
    from loadtest.mock_provider import start_mock_provider_process
    from tests.harness import Gateway

    handle = start_mock_provider_process(0, "bounds")
    gateway = Gateway(
        str(tmp_path_factory.mktemp("bounds")), {"bounds": [handle.address]}, envelope([candidate("m", "bounds")]),
        extra={
            "limits": {"max_body_bytes": MiB, "max_buffered_body_bytes_per_worker": 2 * MiB,
                       "max_requests_per_connection": 1000000},
            "timeouts": {"body_read": "1s"},
            "auth": {"keys": [{"tenant": "t", "key": hash_api_key(KEY)}]},
        },
    ).start()
    yield handle, gateway
    gateway.stop()
    handle.stop()


def full_post(port: int, size: int) -> tuple[int, bytes]:
    sock = connect(port)
    try:
        sock.sendall(post_head(size)[:-2] + b"Connection: close\r\n\r\n" + chat_body(size))
        raw = read_until_closed(sock)
    finally:
        sock.close()
    return status_of(raw), raw


def test_bodies_beyond_the_worker_budget_get_503_and_the_budget_comes_back(bounded):
    handle, gateway = bounded
    before = mock_served(handle, ["chat"])
    # Two uploads in progress hold the whole budget: each Content-Length is counted when its head arrives
    # (before the 100 Continue the client waits for).
    holders = [connect(gateway.port) for _ in range(2)]
    for sock in holders:
        sock.sendall(post_head(MiB)[:-2] + b"Expect: 100-continue\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 ")
        sock.sendall(b"x" * 1000)
    for chunked in (False, True):
        sock = connect(gateway.port)
        if chunked:  # a chunked body is counted as it arrives: refused at its first chunk
            sock.sendall(post_head(0, chunked=True) + b"3e8\r\n" + b"y" * 1000 + b"\r\n")
        else:
            sock.sendall(post_head(1000) + chat_body(1000))
        raw = read_until_closed(sock)
        sock.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert status_of(raw) == 503, raw[:300]
        assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "server_busy"
    for sock in holders:  # the uploads die: their bytes no longer count
        sock.close()
    time.sleep(0.3)
    # Two bodies of the largest size at once fit only if the count went back to exactly 0; twice, so
    # requests that ended gave their bytes back too.
    results: list[tuple[int, bytes]] = []
    for _ in range(2):
        results.clear()
        threads = [threading.Thread(target=lambda: results.append(full_post(gateway.port, MiB))) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [status for status, _ in results] == [200, 200], [raw[:300] for _, raw in results]
    assert mock_served(handle, ["chat"]) - before == 4  # the refused ones never reached the provider


def test_a_body_dribbled_a_byte_at_a_time_is_cut_at_the_total_deadline(bounded):
    # Issue 27 item 13: each byte used to renew the deadline, so a slow drip kept a connection forever.
    _, gateway = bounded
    sock = connect(gateway.port)
    started = time.monotonic()
    sock.sendall(post_head(200))
    sock.settimeout(0.15)
    raw = b""
    while time.monotonic() - started < 6:
        try:
            sock.send(b"{")
        except OSError:
            break
        try:
            raw += sock.recv(65536)
        except TimeoutError:
            continue
        if raw:
            break
    raw += read_until_closed(sock, timeout=3)
    sock.close()
    assert status_of(raw) == 408 and b"request_timeout" in raw, raw[:300]
    assert 0.8 <= time.monotonic() - started < 4


def test_thousands_of_tiny_headers_are_refused_for_almost_no_cpu(bounded):
    # Issue 27 item 12: 64 KiB of tiny headers cost 17.8 ms of worker CPU each (a normal request 0.07).
    _, gateway = bounded
    (worker,) = gateway.worker_pids()
    tiny = b"GET /v1/models HTTP/1.1\r\nHost: g\r\n" + b"a:b\r\n" * 10900 + b"\r\n"
    assert len(tiny) < 65536
    cpu = cpu_seconds(worker)
    for _ in range(100):
        raw = raw_exchange(gateway.port, tiny)
        assert status_of(raw) == 431 and b"headers_too_large" in raw, raw[:300]
    spent = cpu_seconds(worker) - cpu
    print(f"worker CPU per refusal of 10,900 tiny headers: {spent * 10:.2f} ms")
    assert spent < 0.5, f"{spent:.2f} s of worker CPU for 100 refusals"  # main: about 1.8 s


def push_until_blocked(sock: socket.socket, data: bytes, blocked_for: float, timeout: float) -> int:
    """Send ``data`` without reading until no byte could be sent for ``blocked_for`` seconds (the peer
    stopped reading); the bytes sent, or an AssertionError when the peer kept reading until ``timeout``."""
    sock.setblocking(False)
    sent = 0
    deadline = time.monotonic() + timeout
    progress = time.monotonic()
    while time.monotonic() < deadline and sent < len(data):
        try:
            sent += sock.send(data[sent:sent + 65536])
            progress = time.monotonic()
        except BlockingIOError:
            if time.monotonic() - progress > blocked_for:
                return sent
            time.sleep(0.01)
    raise AssertionError(f"the server kept reading: {sent} bytes taken, never blocked for {blocked_for} s")


def test_a_pipelining_client_that_never_reads_is_held_back_and_loses_nothing(bounded):
    # Issue 27 item 3: such a client kept a worker at 100 % CPU for a minute and grew it without bound:
    # it read and answered everything, the answers piling up in the worker. Now the worker parses
    # nothing more once its answers go unread and stops reading once requests pile up: the rest waits
    # in the kernel's socket buffers, the worker sits idle, and nothing is lost.
    _, gateway = bounded
    (worker,) = gateway.worker_pids()
    memory = rss(worker)
    sock = connect(gateway.port, rcvbuf=4096, sndbuf=65536)
    requests = b"".join(MODELS + b"X-Request-Id: r%d\r\n\r\n" % index for index in range(300000))
    sent = push_until_blocked(sock, requests, blocked_for=1.5, timeout=20)
    cpu = cpu_seconds(worker)
    time.sleep(0.5)
    assert cpu_seconds(worker) - cpu < 0.05  # idle while the client does not read
    grown = rss(worker) - memory
    assert grown < 8 * MiB, f"the worker grew by {grown / MiB:.1f} MiB"
    other = raw_exchange(gateway.port, MODELS + b"Connection: close\r\n\r\n")
    assert status_of(other) == 200  # another client is served meanwhile
    # Nothing lost: the client reads, and every request it sent is answered once, in order.
    end = requests.index(b"\r\n\r\n", sent) + 4 if sent < len(requests) else sent
    sock.setblocking(True)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(read_until_closed(sock, timeout=60)))
    reader.start()
    sock.sendall(requests[sent:end] + MODELS + b"X-Request-Id: last\r\nConnection: close\r\n\r\n")
    reader.join()
    sock.close()
    ids = [line[13:].strip() for line in received[0].split(b"\r\n") if line[:13].lower() == b"x-request-id:"]
    assert ids == [b"r%d" % index for index in range(requests[:end].count(b"\r\n\r\n"))] + [b"last"]


BUDGET = 32 * MiB  # limits.max_buffered_body_bytes_per_worker in this test
# The bound docs/conformance.md states: a worker's RSS grows by at most twice the body budget (the
# bodies, plus what the allocator keeps of freed bodies for reuse) plus 32 MiB, whatever clients send.
RSS_BOUND = 2 * BUDGET + 32 * MiB


@pytest.fixture(scope="module")
def default_limits(tmp_path_factory):
    """One worker with the default limits but a 32 MiB body budget, auth on."""
    from loadtest.mock_provider import start_mock_provider_process
    from tests.harness import Gateway

    handle = start_mock_provider_process(0, "rss")
    gateway = Gateway(
        str(tmp_path_factory.mktemp("rss")), {"rss": [handle.address]}, envelope([candidate("m", "rss")]),
        extra={"limits": {"max_buffered_body_bytes_per_worker": BUDGET},
               "auth": {"keys": [{"tenant": "t", "key": hash_api_key(KEY)}]}},
    ).start()
    yield handle, gateway
    gateway.stop()
    handle.stop()


def test_pathological_streams_keep_the_worker_rss_bounded(default_limits):
    handle, gateway = default_limits
    (worker,) = gateway.worker_pids()
    for _ in range(20):  # warm up: first requests allocate what every later one reuses
        raw_exchange(gateway.port, post_head(14)[:-2] + b"Connection: close\r\n\r\n" + b'{"model": "m"}')
    baseline = rss(worker)
    bound = baseline + RSS_BOUND
    peak = baseline

    def sample(phase: str = "") -> None:
        nonlocal peak
        peak = max(peak, rss(worker))
        if phase:
            print(f"after {phase}: RSS {rss(worker) / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB")
        assert peak < bound, f"worker RSS {peak / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"

    # 1. Three chunked POSTs in one write (450 bytes: 4 GB and a killed worker on main), on 20 connections.
    three = b"".join(post_head(0, chunked=True) + b"e\r\n" + b'{"model": "m"}' + b"\r\n0\r\n\r\n" for _ in range(3))
    for _ in range(20):
        sock = connect(gateway.port)
        sock.sendall(three)
        sock.settimeout(0.2)  # a 4th answer would be a replay
        raw = b""
        try:
            while raw.count(b"HTTP/1.1 ") < 4 and (data := sock.recv(65536)):
                raw += data
        except TimeoutError:
            pass
        sock.close()
        assert raw.count(b"HTTP/1.1 200 ") == 3 and raw.count(b"HTTP/1.1 ") == 3
        sample()
    sample("three chunked POSTs in one write")
    # 2. Thousands of pipelined requests, never read, on 5 connections at once.
    stalled = [connect(gateway.port, rcvbuf=4096) for _ in range(5)]
    flood = (MODELS + b"\r\n") * 50000
    for sock in stalled:
        sock.setblocking(False)
        try:
            for start in range(0, len(flood), 65536):
                sock.send(flood[start:start + 65536])
        except BlockingIOError:
            pass
    time.sleep(1)
    sample("pipelined floods never read")
    # 3. 100 connections, each uploading 10 MiB with no key.
    uploads = [connect(gateway.port) for _ in range(100)]
    piece = b"x" * 65536
    deadline = time.monotonic() + 10
    for sock in uploads:
        sock.setblocking(False)
        try:
            sock.send(post_head(10 * MiB, key=None))
        except BlockingIOError:
            pass
    while time.monotonic() < deadline:
        moved = False
        for sock in uploads:
            try:
                moved |= sock.send(piece) > 0
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                pass
        sample()
        if not moved:
            break
    sample("uploads without a key")
    # 4. 64 KiB of tiny headers, 50 times.
    tiny = b"GET /v1/models HTTP/1.1\r\nHost: g\r\n" + b"a:b\r\n" * 10900 + b"\r\n"
    for _ in range(50):
        assert status_of(raw_exchange(gateway.port, tiny)) == 431
    sample("tiny headers")
    for sock in stalled + uploads:
        sock.close()
    assert gateway.worker_pids() == [worker]  # never killed
    print(f"worker RSS: baseline {baseline / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB")
