"""A fault-injection TCP proxy: put it between the gateway and a provider on loopback.

    python -m loadtest.fault_proxy --upstream 127.0.0.1:9001 [--listen 127.0.0.1:9101]
        [--on-connect accept|refuse|reset|blackhole] [--delay-ms N] [--chunk-delay-ms N]
        [--stall-after BYTES] [--reset-after BYTES] [--slow-close-ms N] [--bytes-per-s N]

It relays bytes both ways and breaks the connection in one of these ways (`Fault`):
  on_connect=refuse     no listener: connect() fails at once with ECONNREFUSED
  on_connect=reset      the handshake completes, then the proxy answers with a RST (SO_LINGER 0)
  on_connect=blackhole  connect() hangs until the client's own timeout (see "Black hole" below)
  delay_s               after accepting, wait before connecting upstream: latency before any byte
  chunk_delay_s         wait before relaying each response chunk (one read of up to 64 KiB)
  stall_after           relay this many response bytes, then nothing more (0 = accept, never answer);
                        the connection stays open, and the held bytes flow once the fault changes
  reset_after           relay this many response bytes, then RST the client (0 = reset before the head)
  slow_close_s          when one side closes, pass the close (FIN) on only this much later
  bytes_per_s           bandwidth cap, each direction

Byte counts are per connection, counted from when the fault was set: a fault set at run time applies
to connections already open (a gateway's pooled keep-alive connections included) as well as new ones.

Black hole on loopback: a TCP listener that never calls accept() with `listen(0)`, whose accept queue
the proxy fills itself with one connection. Linux then drops every further SYN (the accept queue is
full, `tcp_abort_on_overflow=0`, the default), so a client's connect() retransmits its SYN (after 1 s,
3 s, 7 s, ...) and times out on its own deadline, exactly as for a host that does not answer. Closing
a listener instead gives ECONNREFUSED at once (that is `refuse`). connect() itself cannot be delayed at
a finer grain from user space: the kernel completes the handshake before accept().

The port stays reserved in every mode: a never-listening placeholder socket holds it (SO_REUSEPORT),
and the listener of the current mode binds beside it.

In-process (tests, benchmarks): `FaultProxyThread(upstream).start()` runs the proxy on its own event
loop in a thread; `set_fault(Fault(...))` changes it at run time. As a CLI, each line on stdin is a
JSON object of `Fault` fields that replaces the fault (`{}` clears it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import select
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

READ_SIZE = 65536
BACKLOG = 1024
ON_CONNECT = ("accept", "refuse", "reset", "blackhole")
# Bandwidth pacing quantum: writes are at most 1/50 s worth of bytes, so the rate is smooth.
PACING_SLICES_PER_S = 50


@dataclass(frozen=True)
class Fault:
    """What the proxy does to connections; the default relays faithfully."""

    on_connect: str = "accept"
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    stall_after: int | None = None
    reset_after: int | None = None
    slow_close_s: float = 0.0
    bytes_per_s: int | None = None

    def __post_init__(self) -> None:
        if self.on_connect not in ON_CONNECT:
            raise ValueError(f"on_connect must be one of {', '.join(ON_CONNECT)}, not {self.on_connect!r}")
        for name in ("delay_s", "chunk_delay_s", "slow_close_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0")
        for name in ("stall_after", "reset_after", "bytes_per_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or null")
        if self.bytes_per_s == 0:
            raise ValueError("bytes_per_s must be > 0 (null = no cap)")

    @classmethod
    def from_mapping(cls, data: Any) -> Fault:
        """A fault from a JSON object; unknown fields are an error naming them."""
        if not isinstance(data, dict):
            raise ValueError("a fault is a JSON object of Fault fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(unknown)}")
        return cls(**data)


NO_FAULT = Fault()


@dataclass
class ProxyStats:
    """What the proxy saw, for tests to assert on (read from any thread)."""

    accepted: int = 0
    reset_on_accept: int = 0
    upstream_failures: int = 0  # the upstream refused: the client got a RST
    resets: int = 0  # mid-response resets (reset_after)
    bytes_up: int = 0  # client -> upstream
    bytes_down: int = 0  # upstream -> client
    open: int = 0


def set_linger_zero(writer: asyncio.StreamWriter) -> None:
    """Make the next close of this connection send a RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def reserved_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT (not listening): a placeholder or a listener to be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class BlackHole:
    """A listener that never accepts, with its accept queue full: the kernel drops further SYNs."""

    MAX_FILLERS = 8
    SETTLE_S = 0.2

    def __init__(self, host: str, port: int) -> None:
        self.listener = reserved_socket(host, port)
        self.listener.listen(0)
        self.fillers: list[socket.socket] = []
        # With backlog 0 one queued connection fills the queue; keep connecting until one hangs.
        for _ in range(self.MAX_FILLERS):
            filler = socket.socket(self.listener.family, socket.SOCK_STREAM)
            filler.setblocking(False)
            filler.connect_ex((host, port))
            if not select.select([], [filler], [], self.SETTLE_S)[1]:
                filler.close()  # its SYN was dropped: the queue is full
                return
            self.fillers.append(filler)
        self.close()
        raise RuntimeError(f"could not fill the accept queue of {host}:{port}")

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.fillers.clear()
        self.listener.close()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    generation: int = -1
    down_since_change: int = 0  # response bytes relayed since the fault last changed
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # fault changed or connection gone
    gone: bool = False
    client_done: bool = False  # the client sent its FIN

    def abort(self, reset_client: bool = False) -> None:
        if reset_client:
            set_linger_zero(self.client)
        self.client.transport.abort()
        if self.upstream is not None:
            self.upstream.transport.abort()
        self.gone = True
        self.wake.set()


class _Done(Exception):
    """The connection was torn down on purpose (a reset): stop relaying."""


class FaultProxy:
    """The proxy on the running event loop: `await start()`, `await set_fault()`, `await stop()`."""

    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1", port: int = 0,
                 fault: Fault = NO_FAULT) -> None:
        self.upstream = upstream
        self.host = host
        self.port = port
        self.fault = fault
        self.stats = ProxyStats()
        self._generation = 0
        self._placeholder: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._blackhole: BlackHole | None = None
        self._listener_kind = "none"
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._placeholder = reserved_socket(self.host, self.port)
        self.port = self._placeholder.getsockname()[1]
        await self._apply_listener()

    async def set_fault(self, fault: Fault) -> None:
        self.fault = fault
        self._generation += 1
        for conn in self._connections:
            conn.wake.set()
        await self._apply_listener()

    def reset_connections(self) -> int:
        """RST every open client connection (and drop its upstream side); how many there were."""
        connections = list(self._connections)
        for conn in connections:
            conn.abort(reset_client=True)
        return len(connections)

    async def stop(self) -> None:
        self._close_listener()
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None
        for conn in list(self._connections):
            conn.abort()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    # -- listener per mode --------------------------------------------------------------------------

    async def _apply_listener(self) -> None:
        mode = self.fault.on_connect
        kind = "server" if mode in ("accept", "reset") else mode
        if kind == self._listener_kind:
            return
        self._close_listener()
        if kind == "server":
            sock = reserved_socket(self.host, self.port)
            self._server = await asyncio.start_server(self._serve, sock=sock, backlog=BACKLOG)
        elif kind == "blackhole":
            self._blackhole = BlackHole(self.host, self.port)
        self._listener_kind = kind

    def _close_listener(self) -> None:
        if self._server is not None:
            self._server.close()  # closes the listening socket; open connections carry on
            self._server = None
        if self._blackhole is not None:
            self._blackhole.close()
            self._blackhole = None
        self._listener_kind = "none"

    # -- one connection -------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        if self.fault.on_connect == "reset":
            self.stats.reset_on_accept += 1
            set_linger_zero(writer)
            writer.transport.abort()
            return
        conn = _Connection(writer, generation=self._generation)
        self._connections.add(conn)
        self.stats.open += 1
        try:
            if self.fault.delay_s:
                await asyncio.sleep(self.fault.delay_s)
            try:
                up_reader, conn.upstream = await asyncio.open_connection(*self.upstream)
            except OSError:
                self.stats.upstream_failures += 1
                conn.abort(reset_client=True)
                return
            if conn.gone:
                conn.abort()
                return
            await asyncio.gather(self._pump(conn, reader, conn.upstream, downstream=False),
                                 self._pump(conn, up_reader, writer, downstream=True))
        finally:
            self.stats.open -= 1
            self._connections.discard(conn)
            conn.client.transport.close()
            if conn.upstream is not None:
                conn.upstream.transport.close()

    async def _pump(self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    downstream: bool) -> None:
        try:
            while data := await reader.read(READ_SIZE):
                await self._forward(conn, data, writer, downstream)
        except _Done:
            return
        except (ConnectionError, OSError):
            conn.abort()
            return
        if conn.gone:
            return
        # End of stream from this side: pass the close on (late, if asked to).
        if self.fault.slow_close_s:
            await asyncio.sleep(self.fault.slow_close_s)
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof() and not writer.is_closing():
                writer.write_eof()
        if not downstream:
            conn.client_done = True
            conn.wake.set()

    async def _forward(self, conn: _Connection, data: bytes, writer: asyncio.StreamWriter,
                       downstream: bool) -> None:
        if downstream and self.fault.chunk_delay_s:
            await asyncio.sleep(self.fault.chunk_delay_s)
        while data:
            if conn.gone:
                raise _Done
            fault = self.fault
            piece = data
            if downstream:
                if conn.generation != self._generation:
                    conn.generation, conn.down_since_change = self._generation, 0
                sent = conn.down_since_change
                if fault.reset_after is not None and sent >= fault.reset_after:
                    await self._reset(conn)
                if fault.stall_after is not None and sent >= fault.stall_after:
                    await self._stall(conn)
                    continue
                limits = [limit - sent for limit in (fault.reset_after, fault.stall_after) if limit is not None]
                if limits:
                    piece = data[:min(limits)]
            if fault.bytes_per_s:
                piece = piece[:max(1, fault.bytes_per_s // PACING_SLICES_PER_S)]
                await asyncio.sleep(len(piece) / fault.bytes_per_s)
            writer.write(piece)
            await writer.drain()
            data = data[len(piece):]
            if downstream:
                conn.down_since_change += len(piece)
                self.stats.bytes_down += len(piece)
            else:
                self.stats.bytes_up += len(piece)
        fault = self.fault
        if downstream and fault.reset_after is not None and conn.down_since_change >= fault.reset_after:
            await self._reset(conn)

    async def _stall(self, conn: _Connection) -> None:
        """Hold the response until the fault changes; give up once the client has closed its side
        (a client that half-closes and then waits would wait forever on a stall anyway)."""
        if not (conn.gone or conn.client_done):
            conn.wake.clear()
            await conn.wake.wait()
        if conn.gone or conn.client_done:
            conn.abort()
            raise _Done

    async def _reset(self, conn: _Connection) -> None:
        """RST the client once the bytes relayed so far have left (a RST drops unsent data)."""
        deadline = time.monotonic() + 1.0
        while conn.client.transport.get_write_buffer_size() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        self.stats.resets += 1
        conn.abort(reset_client=True)
        raise _Done


# --------------------------------------------------------------------------------------------------
# In a thread, for synchronous callers


class FaultProxyThread:
    """A FaultProxy on its own event loop in a daemon thread; every method blocks until done."""

    def __init__(self, upstream: tuple[str, int] | str, fault: Fault = NO_FAULT, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        if isinstance(upstream, str):
            up_host, _, up_port = upstream.rpartition(":")
            upstream = (up_host, int(up_port))
        self.proxy = FaultProxy(upstream, host, port, fault)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def address(self) -> str:
        return self.proxy.address

    @property
    def stats(self) -> ProxyStats:
        return self.proxy.stats

    @property
    def fault(self) -> Fault:
        return self.proxy.fault

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> FaultProxyThread:
        self._thread.start()
        self._call(self.proxy.start())
        return self

    def set_fault(self, fault: Fault = NO_FAULT, **fields: Any) -> None:
        """Replace the fault: `set_fault(Fault(stall_after=0))` or `set_fault(stall_after=0)`."""
        self._call(self.proxy.set_fault(dataclasses.replace(fault, **fields) if fields else fault))

    def reset_connections(self) -> int:
        async def reset() -> int:
            return self.proxy.reset_connections()

        return self._call(reset())

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self.proxy.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> FaultProxyThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.fault_proxy", description=__doc__.split("\n")[0],
                                epilog="Each stdin line is a JSON object of Fault fields (seconds, bytes) "
                                       "that replaces the fault, e.g. {\"reset_after\": 0}; {} clears it.")
    p.add_argument("--upstream", required=True, help="HOST:PORT of the provider")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0 = any; printed)")
    p.add_argument("--on-connect", choices=ON_CONNECT, default="accept")
    p.add_argument("--delay-ms", type=float, default=0.0, help="after accept, before connecting upstream")
    p.add_argument("--chunk-delay-ms", type=float, default=0.0, help="before each relayed response chunk")
    p.add_argument("--stall-after", type=int, default=None, help="response bytes, then nothing more")
    p.add_argument("--reset-after", type=int, default=None, help="response bytes, then a RST")
    p.add_argument("--slow-close-ms", type=float, default=0.0, help="delay passing a close on")
    p.add_argument("--bytes-per-s", type=int, default=None, help="bandwidth cap per direction")
    return p.parse_args(argv)


def fault_from_args(args: argparse.Namespace) -> Fault:
    return Fault(on_connect=args.on_connect, delay_s=args.delay_ms / 1000.0,
                 chunk_delay_s=args.chunk_delay_ms / 1000.0, stall_after=args.stall_after,
                 reset_after=args.reset_after, slow_close_s=args.slow_close_ms / 1000.0,
                 bytes_per_s=args.bytes_per_s)


async def serve_cli(proxy: FaultProxy) -> None:
    loop = asyncio.get_running_loop()
    await proxy.start()
    print(f"fault-proxy listening on {proxy.address} -> {proxy.upstream[0]}:{proxy.upstream[1]}", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    def read_line() -> None:
        line = sys.stdin.readline()
        if not line:
            loop.remove_reader(sys.stdin.fileno())
            return
        if not line.strip():
            return
        try:
            fault = Fault.from_mapping(json.loads(line))
        except (ValueError, TypeError) as exc:
            print(f"fault-proxy: rejected {line.strip()!r}: {exc}", file=sys.stderr, flush=True)
            return
        loop.create_task(proxy.set_fault(fault)).add_done_callback(
            lambda _: print(f"fault-proxy: fault {dataclasses.asdict(fault)}", flush=True))

    loop.add_reader(sys.stdin.fileno(), read_line)
    await stop.wait()
    await proxy.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    up_host, _, up_port = args.upstream.rpartition(":")
    try:
        proxy = FaultProxy((up_host.strip("[]"), int(up_port)), host.strip("[]"), int(port), fault_from_args(args))
    except ValueError as exc:
        print(f"fault-proxy: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve_cli(proxy))
    except OSError as exc:
        print(f"fault-proxy: cannot listen on {args.listen}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
