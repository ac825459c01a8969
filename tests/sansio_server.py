"""Drive the real client-facing server (workers/server.py) without sockets.

``ServerConnection`` runs unchanged on an asyncio loop; only the transport under it is a stand-in that
records what the server writes and does (pause/resume reading, half-close, close) and plays a client
that reads its answers, or stops reading them after a window of bytes. A handler answers each request
with its method, target and body, so the answers show exactly which requests the server handed on,
how often and in which order.
"""

from __future__ import annotations

import asyncio
import types
from dataclasses import dataclass, field

from gateway.config import Limits, Timeouts
from gateway.http.codec import ServerCodec
from workers.exchange import Exchange
from workers.server import ServerConnection
from workers.server_state import ServerSettings, ServerState


def settings(**limits) -> ServerSettings:
    timeouts = {key: limits.pop(key) for key in list(limits) if key in Timeouts.__struct_fields__}
    return ServerSettings(types.SimpleNamespace(limits=Limits(**limits), timeouts=Timeouts(**timeouts)))


# Far beyond anything a test sends: a server that replays requests is stopped here, not at 4 GB.
_RUNAWAY_BUFFER = 16 * 1024 * 1024


async def echo_handler(exchange: Exchange) -> None:
    if exchange.conn.codec.buffered > _RUNAWAY_BUFFER:
        exchange.conn.close(abort=True)
        raise AssertionError("runaway receive buffer: the server processes bytes again")
    exchange.respond(200, [(b"content-type", b"application/octet-stream")],
                     exchange.method + b" " + exchange.target + b"\n" + exchange.body)


class StandInTransport(asyncio.Transport):
    """What the server writes and does, plus a client that stops reading after ``window`` unread bytes."""

    def __init__(self, protocol: ServerConnection, window: int | None = None) -> None:
        super().__init__()
        self.protocol = protocol
        self.out = bytearray()
        self.reading = True
        self.pauses = 0
        self.closed = False
        self.aborted = False
        self.eof_written = False
        self.window = window
        self.unread = 0
        self.write_paused = False

    # -- what the server calls ----------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.closed:
            return
        self.out += data
        if self.window is not None:
            self.unread += len(data)
            if self.unread > self.window and not self.write_paused:
                self.write_paused = True
                self.protocol.pause_writing()

    def pause_reading(self) -> None:
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        self.reading = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def close(self) -> None:
        self._lose()

    def abort(self) -> None:
        self.aborted = True
        self._lose()

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return self.unread

    def _lose(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    # -- what the client does -----------------------------------------------------------------------
    def client_reads(self) -> None:
        """The client reads every answer written so far."""
        self.unread = 0
        if self.write_paused:
            self.write_paused = False
            self.protocol.resume_writing()

    @property
    def finished(self) -> bool:
        """The server ended the connection (closed it, or half-closed after an error answer)."""
        return self.closed or self.eof_written


@dataclass
class Run:
    transport: StandInTransport
    state: ServerState
    connection: ServerConnection
    max_buffered: int = 0  # the most bytes the codec held between two deliveries
    max_pending_line: int = 0  # the most bytes a chunked decoder held between two deliveries
    loop_errors: list = field(default_factory=list)

    def answers(self) -> list[tuple[int, bytes, bytes]]:
        return split_answers(bytes(self.transport.out))


async def settle() -> None:
    """Run the loop until every task the server started (request handlers) has finished."""
    me = asyncio.current_task()
    for _ in range(100000):
        await asyncio.sleep(0)
        if all(task is me or task.done() for task in asyncio.all_tasks()):
            return
    raise AssertionError("the server's tasks never finished")


async def serve(pieces: list[bytes], server_settings: ServerSettings, *, eof: bool = True, window: int | None = None,
                handler=echo_handler, reads_when_stalled: bool = True, plain_heads: bool = True) -> Run:
    """Deliver ``pieces`` one by one as a client would: only while the server reads (a paused server
    leaves the rest in the client's socket), reading answers when ``window`` is reached if
    ``reads_when_stalled``; then half-close if ``eof``. ``plain_heads`` False: the server's codec gives
    every head to h11 (gateway/http/request_head.py parses none)."""
    loop = asyncio.get_running_loop()
    errors: list = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    state = ServerState(server_settings, handler)
    connection = ServerConnection(state)
    if not plain_heads:
        connection.codec = ServerCodec(server_settings.max_header_bytes, server_settings.max_header_count,
                                       plain_heads=False)
    transport = StandInTransport(connection, window)
    connection.connection_made(transport)
    run = Run(transport, state, connection, loop_errors=errors)
    queue = list(pieces)
    while queue and not transport.finished:
        if not transport.reading:
            await settle()
            if not transport.reading:
                if not reads_when_stalled or not transport.write_paused:
                    break  # the server waits for us, and we wait for it
                transport.client_reads()
                continue
        connection.data_received(queue.pop(0))
        _observe(run)
        await settle()
        _observe(run)
    if eof and not transport.finished and not queue:
        connection.eof_received()
        await settle()
    if reads_when_stalled:
        while transport.write_paused and not transport.closed:
            transport.client_reads()
            await settle()
    return run


def _observe(run: Run) -> None:
    codec = run.connection.codec
    run.max_buffered = max(run.max_buffered, codec.buffered)
    body = codec._body  # the reader of the body being parsed, if any
    if body is not None and body.chunked is not None:
        run.max_pending_line = max(run.max_pending_line, body.chunked.pending)


def split_answers(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """The responses in a byte stream as (status, head, body); every answer here is length-framed."""
    answers = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"incomplete response head: {data[:200]!r}"
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if 100 <= status < 200:
            answers.append((status, head, b""))
            data = rest
            continue
        assert len(rest) >= length, f"truncated response body: {data[:200]!r}"
        answers.append((status, head, rest[:length]))
        data = rest[length:]
    return answers
