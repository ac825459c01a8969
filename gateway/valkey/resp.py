"""A lean, pipelined RESP2 client for one Valkey/Redis node: the quota ledger's request-path transport.

Why not valkey-py's asyncio client: per command it takes a connection from a pool, runs a retry
wrapper, packs through an encoder object, and reads through a StreamReader under ``wait_for`` —
~60 µs of worker CPU per admit, more than a third of a whole proxied request. Here a command is one
%-formatted byte string, one ``transport.write`` and one future, resolved from ``data_received``:

- one persistent connection per client (per worker), opened lazily and reopened lazily after a
  failure, within the connect timeout (which covers AUTH and SELECT too);
- every command is written at once, so concurrent callers pipeline on the socket for free; replies
  come back in order and resolve the pending futures FIFO; a pipeline's batch is one future;
- a broken connection fails every pending future with ``ConnectionError``; a connection that makes
  no progress for ``timeout_s`` is aborted with ``TimeoutError`` (one timer per period, not one per
  command); at most ``max_pending`` commands may be outstanding.

It speaks the subset of the ``valkey.asyncio.Valkey`` API that the gateway calls (any other command
goes through ``execute_command``), with bytes replies (``decode_responses=False``) and valkey-py's
exception classes, so the breaker, the NOSCRIPT reload and ``BACKEND_ERRORS`` work unchanged.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from valkey.asyncio.connection import SSLConnection, ValkeySSLContext, parse_url
from valkey.exceptions import (
    AuthenticationError,
    ConnectionError,
    InvalidResponse,
    TimeoutError,
)

from gateway.valkey.resp_wire import INCOMPLETE, CommandArg, encode_command, read_reply

DEFAULT_MAX_PENDING = 16384

# URL query options this client understands (besides db); valkey-py's pool/socket tuning options do
# not apply to it, and accepting them silently would hide a configuration that does nothing.
_SSL_OPTIONS = ("ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_check_hostname")
_URL_KEYS = frozenset(
    ("host", "port", "path", "username", "password", "db", "connection_class", *_SSL_OPTIONS)
)

_CLOSED_BY_SERVER = "Connection closed by server."

class _Connection(asyncio.Protocol):
    """One socket: writes commands, parses replies, resolves the pending futures in order.

    ``_pending`` holds ``(future, count)``: count 0 is a single command (its error is raised),
    count n a pipelined batch of n commands whose replies (errors included) resolve one future as
    a list. Futures whose caller gave up (cancelled) stay queued so replies keep their order.
    """

    __slots__ = (
        "_loop", "_address", "_timeout_s", "_max_pending", "_on_lost", "_transport", "_pending",
        "_queued", "_batch", "_partial", "_need", "_replies", "_replies_seen", "_watchdog", "_error",
        "closed", "quiet",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        address: str,
        timeout_s: float | None,
        max_pending: int,
        on_lost: Callable[[_Connection], None],
    ) -> None:
        self._loop = loop
        self._address = address
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._pending: deque[tuple[asyncio.Future[Any], int]] = deque()
        self._queued = 0  # commands awaiting a reply (a batch counts each of its commands)
        self._batch: list[Any] = []  # replies gathered so far for the batch at the head
        self._partial = bytearray()  # unparsed tail when a reply spans reads
        self._need = 0  # bytes _partial must reach before parsing is worth retrying
        self._replies = 0  # progress counter for the watchdog
        self._replies_seen = 0
        self._watchdog: asyncio.TimerHandle | None = None
        self._error: ConnectionError | TimeoutError | None = None  # set once the connection is unusable
        self.closed: asyncio.Future[None] = loop.create_future()
        # In CLIENT REPLY OFF (gateway/valkey/quiet_writer.py): no command waits, and a reply is a fault.
        self.quiet = False

    def request(self, payload: bytes, count: int) -> asyncio.Future[Any]:
        """Write ``payload`` (``count`` commands, 0 meaning one unbatched) and return its future."""
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        queued = self._queued + (count or 1)
        if queued > self._max_pending:
            raise ConnectionError(f"Too many pending commands to {self._address} (max {self._max_pending})")
        self._transport.write(payload)  # type: ignore[union-attr]
        future = self._loop.create_future()
        self._pending.append((future, count))
        self._queued = queued
        if self._watchdog is None and self._timeout_s is not None:
            self._replies_seen = self._replies
            self._watchdog = self._loop.call_later(self._timeout_s, self._check_progress)
        return future

    def request_each(self, payload: bytes, receivers: list[tuple[Any, int]]) -> None:
        """Write ``payload`` (``len(receivers)`` commands) at once; each command's reply goes straight to its
        receiver, ``(future, 0)`` (or anything with ``done``, ``set_result``, ``set_exception``): an error
        reply as its exception, as a single command's. No batch future, no callback between the reply and
        the waiter: the caller's task wakes in the turn the reply is read."""
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        queued = self._queued + len(receivers)
        if queued > self._max_pending:
            raise ConnectionError(f"Too many pending commands to {self._address} (max {self._max_pending})")
        self._transport.write(payload)  # type: ignore[union-attr]
        self._pending.extend(receivers)
        self._queued = queued
        if self._watchdog is None and self._timeout_s is not None:
            self._replies_seen = self._replies
            self._watchdog = self._loop.call_later(self._timeout_s, self._check_progress)

    def write_quiet(self, payload: bytes, max_buffer: int) -> None:
        """Write commands nobody waits for (a connection in CLIENT REPLY OFF); a connection whose server
        stopped reading (more than ``max_buffer`` bytes unsent) is aborted rather than left to grow."""
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        transport = self._transport
        if transport.get_write_buffer_size() > max_buffer:  # type: ignore[union-attr]
            self.abort(ConnectionError(f"{self._address} takes no more writes"))
            raise ConnectionError(f"{self._address} takes no more writes")
        transport.write(payload)  # type: ignore[union-attr]

    @property
    def error(self) -> ConnectionError | TimeoutError | None:
        return self._error

    def abort(self, error: ConnectionError | TimeoutError) -> None:
        """Drop the connection now: ``error`` for every pending command, nothing more is sent."""
        if self._error is None:
            self._error = error
            self._on_lost(self)
            self._fail_pending(error)
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.quiet:  # its CLIENT REPLY OFF did not take (refused): nothing here can tell what replied
            self.abort(ConnectionError(f"A reply from {self._address} on a connection in CLIENT REPLY OFF"))
            return
        if self._partial:
            self._partial += data
            if len(self._partial) < self._need:
                return
            data = bytes(self._partial)
            self._partial.clear()
        pending = self._pending
        pos, end = 0, len(data)
        try:
            while pos < end:
                # The two commonest replies (a SET's OK, a GET's nil) without the parser's call.
                if data.startswith(b"+OK\r\n", pos):
                    value, after = b"OK", pos + 5
                elif data.startswith(b"$-1\r\n", pos):
                    value, after = None, pos + 5
                else:
                    value, after = read_reply(data, pos)
                if value is INCOMPLETE:
                    self._partial += memoryview(data)[pos:]
                    self._need = after - pos
                    return
                pos = after
                self._replies += 1
                future, count = pending[0]
                if count:
                    batch = self._batch
                    batch.append(value)
                    if len(batch) < count:
                        continue
                    self._batch = []
                    value = batch
                pending.popleft()
                self._queued -= count or 1
                if future.done():  # the caller was cancelled (e.g. its deadline passed)
                    continue
                if not count and isinstance(value, Exception):
                    future.set_exception(value)
                else:
                    future.set_result(value)
        except (InvalidResponse, ValueError, IndexError) as exc:  # garbage or an unsolicited reply
            self.abort(ConnectionError(f"Protocol error from {self._address}: {exc!r}"))

    def eof_received(self) -> bool:
        self.abort(ConnectionError(_CLOSED_BY_SERVER))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._error is None:
            error = ConnectionError(
                f"Error while talking to {self._address}: {exc}" if exc else _CLOSED_BY_SERVER
            )
            self._error = error
            self._on_lost(self)
            self._fail_pending(error)
        if not self.closed.done():
            self.closed.set_result(None)

    # --

    def _fail_pending(self, error: Exception) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        pending, self._pending = self._pending, deque()
        self._queued = 0
        for future, _ in pending:
            if not future.done():
                future.set_exception(error)

    def _check_progress(self) -> None:
        # Armed while commands are pending; a whole period without a single reply means the server
        # (or the path to it) is stuck: give up on the connection as valkey-py's socket timeout would.
        if not self._pending:
            self._watchdog = None
        elif self._replies == self._replies_seen:
            self._watchdog = None
            self.abort(TimeoutError(f"Timeout reading from {self._address}"))
        else:
            self._replies_seen = self._replies
            self._watchdog = self._loop.call_later(self._timeout_s, self._check_progress)  # type: ignore[arg-type]


class RespClient:
    """The single-node quota backend client. Create it on the loop that will use it (per worker).

    Command methods return awaitables and raise valkey-py's exceptions: ``ConnectionError`` (cannot
    connect, connection lost), ``TimeoutError`` (connect or reply timeout), ``AuthenticationError``,
    ``ResponseError`` and its subclasses such as ``NoScriptError`` for error replies.
    """

    def __init__(
        self,
        *,
        host: str = "localhost",
        port: int = 6379,
        path: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self._host, self._port, self._path = host, port, path
        self._ssl = ssl_context
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._address = path or f"{host}:{port}"
        # AUTH and SELECT, encoded once, sent as one batch on every new connection.
        setup: list[tuple[CommandArg, ...]] = []
        if password:
            setup.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            setup.append(("SELECT", db))
        self._setup = b"".join(map(encode_command, setup))
        self._setup_count = len(setup)
        self._auth = bool(password)
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._sending: set[asyncio.Future[None]] = set()  # send_each calls waiting for a connection

    @classmethod
    def from_url(
        cls, url: str, *, timeout_s: float | None, max_pending: int = DEFAULT_MAX_PENDING
    ) -> RespClient:
        """``valkey://``, ``redis://``, ``valkeys://``, ``rediss://`` or ``unix://`` URLs, parsed by
        valkey-py's own parser so they mean what they meant with its client (user, password, db in
        the path or ``?db=``, ``ssl_*`` options)."""
        options: dict[str, Any] = parse_url(url)
        unknown = sorted(set(options) - _URL_KEYS)
        if unknown:
            raise ValueError(f"unsupported option(s) in the backend URL: {', '.join(unknown)}")
        context = None
        if options.pop("connection_class", None) is SSLConnection:
            context = ValkeySSLContext(**{k[4:]: options.pop(k) for k in _SSL_OPTIONS if k in options}).get()
        elif any(k in options for k in _SSL_OPTIONS):
            raise ValueError("ssl_* options need a valkeys:// or rediss:// URL")
        return cls(**options, ssl_context=context, timeout_s=timeout_s, max_pending=max_pending)

    # -- commands

    def execute_command(self, *args: CommandArg) -> Awaitable[Any]:
        """Send one command; await its raw reply (bytes, int, list, None)."""
        return self._send(encode_command(args), 0)

    def send_encoded(self, payload: bytes, count: int) -> Awaitable[list[Any]]:
        """Send ``count`` commands, already RESP-encoded (``encode_command``), in one write; await
        their replies as one list (error replies in place). Not a coroutine: when connected this is a
        plain future, so a caller may batch without a task."""
        return self._send(payload, count)

    def send_each(self, payload: bytes, receivers: list[tuple[Any, int]]) -> None:
        """Send ``len(receivers)`` commands, already RESP-encoded, in one write; each reply resolves its own
        receiver (``_Connection.request_each``). Raises valkey-py's errors when connected and the connection
        cannot take them; not connected, it connects first and a failure goes to every receiver."""
        conn = self._conn
        if conn is None:
            task = asyncio.ensure_future(self._send_each_when_connected(payload, receivers))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
            return
        conn.request_each(payload, receivers)

    async def _send_each_when_connected(self, payload: bytes, receivers: list[tuple[Any, int]]) -> None:
        try:
            task = self._connecting
            if task is None:
                task = self._connecting = asyncio.get_running_loop().create_task(self._connect())
                task.add_done_callback(self._connect_done)
            conn = await asyncio.shield(task)
            conn.request_each(payload, receivers)
        except Exception as error:  # noqa: BLE001 - every receiver hears it, whatever it is
            for receiver, _ in receivers:
                if not receiver.done():
                    receiver.set_exception(error)

    async def connection(self) -> _Connection:
        """The connection, made (AUTH and SELECT included) if there is none."""
        conn = self._conn
        if conn is not None:
            return conn
        task = self._connecting
        if task is None:
            task = self._connecting = asyncio.get_running_loop().create_task(self._connect())
            task.add_done_callback(self._connect_done)
        return await asyncio.shield(task)

    def ping(self) -> Awaitable[Any]:
        return self._send(b"*1\r\n$4\r\nPING\r\n", 0)

    async def script_load(self, script: str | bytes) -> str:
        return (await self._send(encode_command(("SCRIPT", "LOAD", script)), 0)).decode()

    async def scan_iter(
        self, match: bytes | str | None = None, count: int | None = None, _type: str | None = None
    ) -> AsyncIterator[bytes]:
        args: list[CommandArg] = []
        if match is not None:
            args += ("MATCH", match)
        if count is not None:
            args += ("COUNT", count)
        if _type is not None:
            args += ("TYPE", _type)
        cursor: CommandArg = b"0"
        while True:
            cursor, keys = await self._send(encode_command(("SCAN", cursor, *args)), 0)
            for key in keys:
                yield key
            if cursor == b"0":
                return

    def pipeline(self, transaction: bool = True) -> Pipeline:
        """A batch sent in one write; only ``transaction=False`` (MULTI/EXEC is not implemented, and
        silently dropping the atomicity a caller asked for would be worse than refusing)."""
        if transaction:
            raise NotImplementedError("RespClient pipelines are non-transactional: use transaction=False")
        return Pipeline(self)

    async def aclose(self) -> None:
        """Close the connection (pending commands fail with ConnectionError). Using the client
        again reconnects."""
        if self._connecting is not None:
            self._connecting.cancel()
        conn = self._conn
        if conn is not None:
            conn.abort(ConnectionError("Connection closed by client."))
            await conn.closed

    # -- connection

    def _send(self, payload: bytes, count: int) -> Awaitable[Any]:
        # Hot path: connected -> a plain future, no coroutine. Otherwise connect first.
        conn = self._conn
        if conn is None:
            return self._send_when_connected(payload, count)
        return conn.request(payload, count)

    async def _send_when_connected(self, payload: bytes, count: int) -> Any:
        task = self._connecting
        if task is None:
            task = self._connecting = asyncio.get_running_loop().create_task(self._connect())
            task.add_done_callback(self._connect_done)
        # Shielded: one caller's deadline must not abort the connection the others are waiting for.
        conn = await asyncio.shield(task)
        return await conn.request(payload, count)

    def _connect_done(self, task: asyncio.Task[_Connection]) -> None:
        self._connecting = None
        if not task.cancelled():
            task.exception()  # retrieved here too, in case every waiter gave up before it failed

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(loop, self._address, self._timeout_s, self._max_pending, self._lost)
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._path is not None:
                    await loop.create_unix_connection(lambda: conn, self._path, ssl=self._ssl)
                else:
                    await loop.create_connection(lambda: conn, self._host, self._port, ssl=self._ssl)
                if self._setup_count:
                    await self._greet(conn)
        except BaseException as exc:
            conn.abort(ConnectionError("Connection setup failed."))
            # TimeoutError is an OSError: test it first. Both carry valkey-py's wording.
            if isinstance(exc, asyncio.TimeoutError):
                raise TimeoutError("Timeout connecting to server") from None
            if isinstance(exc, OSError):
                raise ConnectionError(f"Error connecting to {self._address}: {exc}") from exc
            raise
        if conn.error is not None:  # lost between the handshake and now: _lost() could not see it
            raise ConnectionError(str(conn.error))
        self._conn = conn
        return conn

    async def _greet(self, conn: _Connection) -> None:
        """AUTH and SELECT in one round trip; any error reply fails the connection attempt."""
        replies = await conn.request(self._setup, self._setup_count)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if self._auth and replies[0] != b"OK":
            raise AuthenticationError("Invalid Username or Password")

    def _lost(self, conn: _Connection) -> None:
        if self._conn is conn:
            self._conn = None


class Pipeline:
    """Commands buffered locally, sent in one write, answered as one list (in command order)."""

    __slots__ = ("_client", "_commands")

    def __init__(self, client: RespClient) -> None:
        self._client = client
        self._commands: list[bytes] = []

    def execute_command(self, *args: CommandArg) -> Pipeline:
        self._commands.append(encode_command(args))
        return self

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Per-command replies; error replies are exception instances (raised, the first one, if
        ``raise_on_error``). A lost connection raises ``ConnectionError`` for the whole batch."""
        commands, self._commands = self._commands, []
        if not commands:
            return []
        replies: list[Any] = await self._client._send(b"".join(commands), len(commands))
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies
