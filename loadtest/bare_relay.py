"""A bare uvloop + h11 relay with no gateway logic: the floor of the stack gridgate is built on.

    python -m loadtest.bare_relay LISTEN_PORT UPSTREAM_PORT [--host 127.0.0.1] [--upstream-host 127.0.0.1]

Every client connection gets its own upstream connection, opened at its first request and kept alive
(reopened when the upstream ends it). Per request: parse it with an h11 server connection; send its
method, target, headers (Connection dropped, Host set to the upstream) and whole body upstream with an
h11 client connection; read the whole response with h11; send its status, headers (Connection and
Transfer-Encoding dropped: h11 frames the body itself) and body back. No routing, auth, metrics, logs,
limits or timeouts: the codec work any relay on h11 must do, and nothing else. loadtest/bench_relay.py
holds gridgate to it (issue 13, target 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import h11
import uvloop

from loadtest.mock_provider import child_setup, error_payload, terminate

REQUEST_DROPPED = frozenset((b"connection", b"host"))
RESPONSE_DROPPED = frozenset((b"connection", b"transfer-encoding"))


def closing_error(status: int, message: str, code: str) -> bytes:
    """A complete OpenAI-style error response that ends the connection (the h11 state may be broken)."""
    body = json.dumps(error_payload(message, "relay_error", code)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def message_bytes(conn: h11.Connection, head: h11.Request | h11.Response, body: bytes) -> bytes:
    """One whole message (head, body, end) as h11 frames it on `conn`."""
    return conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())


class UpstreamConnection(asyncio.Protocol):
    """The keep-alive h11 client connection of one client connection."""

    def __init__(self, client: ClientConnection) -> None:
        self.client = client
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.waiting = False  # a request was sent and its response has not ended yet
        self.response: h11.Response | None = None
        self.chunks: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, request: h11.Request, body: bytes) -> None:
        assert self.transport is not None
        self.waiting = True
        self.transport.write(message_bytes(self.h11, request, body))

    def data_received(self, data: bytes) -> None:
        self.h11.receive_data(data)
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError:
                self.close()
                return
            if event is h11.NEED_DATA:
                return
            if isinstance(event, h11.Response):
                self.response, self.chunks = event, []
            elif isinstance(event, h11.Data):
                self.chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.waiting = False
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                else:  # the upstream ends keep-alive: the next request opens a new connection
                    self.close()
                assert self.response is not None
                self.client.reply(self.response, b"".join(self.chunks))
                return

    def eof_received(self) -> None:
        self.data_received(b"")  # h11 ends a body delimited by the connection's end

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiting:
            self.waiting = False
            message = "the upstream closed the connection mid-response"
            self.client.fail(closing_error(502, message, "upstream_closed"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class ClientConnection(asyncio.Protocol):
    """One client connection: an h11 server connection and, from its first request, its upstream."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream_address = upstream
        self.upstream_host = f"{upstream[0]}:{upstream[1]}".encode()
        self.h11 = h11.Connection(h11.SERVER)
        self.transport: asyncio.Transport | None = None
        self.upstream: UpstreamConnection | None = None
        self.request: h11.Request | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.h11.receive_data(data)
        self.pump()

    def pump(self) -> None:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                self.fail(closing_error(exc.error_status_hint, str(exc), "bad_request"))
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self.request, self.body = event, []
            elif isinstance(event, h11.Data):
                self.body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.forward()
                return
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return

    def forward(self) -> None:
        assert self.request is not None
        headers = [(name, value) for name, value in self.request.headers if name not in REQUEST_DROPPED]
        headers.append((b"host", self.upstream_host))
        request = h11.Request(method=self.request.method, target=self.request.target, headers=headers)
        body = b"".join(self.body)
        if self.upstream is not None and self.upstream.usable:
            self.upstream.send(request, body)
        else:
            asyncio.get_running_loop().create_task(self.connect_and_send(request, body))

    async def connect_and_send(self, request: h11.Request, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: UpstreamConnection(self),
                                                       *self.upstream_address)
        except OSError as exc:
            self.fail(closing_error(502, f"upstream unreachable: {exc}", "upstream_unreachable"))
            return
        if self.transport is None or self.transport.is_closing():
            upstream.close()
            return
        self.upstream = upstream
        upstream.send(request, body)

    def reply(self, response: h11.Response, body: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        headers = [(name, value) for name, value in response.headers if name not in RESPONSE_DROPPED]
        conn = self.h11
        head = h11.Response(status_code=response.status_code, headers=headers, reason=response.reason)
        self.transport.write(message_bytes(conn, head, body))
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self.pump()  # a pipelined next request may already be buffered
        else:
            self.close()

    def fail(self, response: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(response)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def serve(host: str, port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ClientConnection(upstream), host, port, backlog=4096)
    print(f"bare_relay listening on {host}:{port} -> {upstream[0]}:{upstream[1]}", flush=True)
    await server.serve_forever()


def start_bare_relay_process(listen_port: int, upstream_port: int, cpus: set[int] | None = None,
                             timeout: float = 10.0) -> subprocess.Popen[bytes]:
    """`python -m loadtest.bare_relay` as a child process pinned to `cpus`, returned once it listens."""
    return start_relay_process("loadtest.bare_relay", listen_port, upstream_port, cpus, timeout)


def start_relay_process(module: str, listen_port: int, upstream_port: int, cpus: set[int] | None,
                        timeout: float) -> subprocess.Popen[bytes]:
    """`python -m <module> LISTEN UPSTREAM` pinned to `cpus`, returned once its first line says it listens."""
    cmd = [sys.executable, "-m", module, str(listen_port), str(upstream_port)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, preexec_fn=child_setup(cpus))
    assert process.stdout is not None
    # The first line says it listens; nothing within the timeout, or EOF, means it failed to start.
    if not select.select([process.stdout], [], [], timeout)[0] or not process.stdout.readline():
        terminate(process, 5.0)
        raise RuntimeError(f"{module} did not start listening on port {listen_port}")
    return process


def main(argv: list[str] | None = None) -> int:
    return relay_main("loadtest.bare_relay", __doc__.split("\n")[0], serve, argv)


def relay_main(module: str, description: str, serve_relay: Callable[[str, int, tuple[str, int]], Awaitable[None]],
               argv: list[str] | None) -> int:
    """The command line of a relay process: LISTEN_PORT UPSTREAM_PORT [--host] [--upstream-host], served
    until interrupted (shared by this relay and loadtest/bare_pipe.py)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("listen_port", type=int)
    parser.add_argument("upstream_port", type=int)
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--upstream-host", default="127.0.0.1")
    args = parser.parse_args(argv)
    try:
        uvloop.run(serve_relay(args.host, args.listen_port, (args.upstream_host, args.upstream_port)))
    except KeyboardInterrupt:
        pass
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
