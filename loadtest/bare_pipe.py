"""A byte pipe on uvloop: the floor of any Python relay's first-token latency (no HTTP at all).

    python -m loadtest.bare_pipe LISTEN_PORT UPSTREAM_PORT [--host 127.0.0.1] [--upstream-host 127.0.0.1]

Each client connection gets its own upstream connection; bytes are copied both ways as they arrive,
with no parsing. loadtest/bench_streams.py probes first tokens through it beside the gateway, on the
gateway's core: what the pipe adds over a direct connection is the extra hop itself (two wake-ups
across cores, two more socket writes and reads), so the gateway's figure minus the pipe's is what
gridgate's own code costs the first token.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from loadtest.bare_relay import relay_main, start_relay_process


class UpstreamSide(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class ClientSide(asyncio.Protocol):
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream_address = upstream
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []  # bytes the client sent before the upstream connection was up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(lambda: UpstreamSide(self.transport), *self.upstream_address)
        except OSError:
            self.transport.close()
            return
        self.upstream = upstream  # type: ignore[assignment]
        upstream.write(b"".join(self.early))  # type: ignore[attr-defined]
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def serve(host: str, port: int, upstream: tuple[str, int]) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: ClientSide(upstream), host, port, backlog=4096)
    print(f"bare_pipe listening on {host}:{port} -> {upstream[0]}:{upstream[1]}", flush=True)
    await server.serve_forever()


def start_bare_pipe_process(listen_port: int, upstream_port: int, cpus: set[int] | None = None,
                            timeout: float = 10.0) -> subprocess.Popen[bytes]:
    """`python -m loadtest.bare_pipe` as a child process pinned to `cpus`, returned once it listens."""
    return start_relay_process("loadtest.bare_pipe", listen_port, upstream_port, cpus, timeout)


def main(argv: list[str] | None = None) -> int:
    return relay_main("loadtest.bare_pipe", __doc__.split("\n")[0], serve, argv)

if __name__ == "__main__":
    sys.exit(main())
