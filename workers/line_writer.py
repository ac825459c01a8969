"""A bounded, non-blocking line output for the event loop (the access log's writer).

``write`` only appends to an in-memory buffer and arms one flush timer; the flush writes whole lines
in batches and never waits: when the output cannot take more (a full pipe, a slow journald) the
lines stay buffered and the flush tries again later; when the buffer is full, new lines are dropped
and counted instead of blocking the request path. Lines that cannot be written at all (the output
is gone) are dropped and counted too.

Several workers share the output, so lines must never interleave. A regular file opened with
``O_APPEND`` takes each write whole. A pipe or a stream socket only guarantees that for writes of at
most ``PIPE_BUF`` bytes, which is therefore the batch size there. The shared standard output is never
switched to non-blocking (the supervisor and its logging share that open file): a pipe or terminal
is opened again under its own description with ``O_NONBLOCK``, a socket (journald) is written with
``MSG_DONTWAIT``, a regular file is written as it is (it cannot block for long, and its shared
offset keeps other writers' lines intact).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import socket
import stat
from collections.abc import Callable

log = logging.getLogger("gridgate.access_log")

STDOUT = "-"
_FILE_BATCH = 256 * 1024
_ERROR_LOG_INTERVAL_S = 60.0
# Deferred lines made per callback: making one costs about 3 µs, so a write-out of a busy worker's 50 ms
# (hundreds of lines) in one go held its loop, and every request waiting on it, for a millisecond or more
# (a cache hit's p99 at one connection: 1.6 ms at 50 ms, 6.7 ms at 200 ms). 128 lines: about 0.4 ms at most.
FILL_SLICE_LINES = 128


class _Output:
    """Where the lines go: a descriptor and how to write to it without blocking."""

    __slots__ = ("fd", "batch", "owned", "sock")

    def __init__(self, fd: int, batch: int, owned: bool, sock: socket.socket | None = None) -> None:
        self.fd = fd
        self.batch = batch  # bytes per write that keep lines whole
        self.owned = owned  # ours to close
        self.sock = sock

    def write(self, data: bytes) -> int:
        if self.sock is not None:
            return self.sock.send(data, socket.MSG_DONTWAIT)
        return os.write(self.fd, data)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        elif self.owned:
            os.close(self.fd)


def open_output(path: str) -> _Output:
    """The output for ``path`` ("-" = standard output); raises OSError when it cannot be opened."""
    if path != STDOUT:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        return _Output(fd, _FILE_BATCH if regular else select.PIPE_BUF, owned=True)
    mode = os.fstat(1).st_mode
    if stat.S_ISREG(mode):
        return _Output(1, _FILE_BATCH, owned=False)
    if stat.S_ISSOCK(mode):
        return _Output(1, select.PIPE_BUF, owned=True, sock=socket.socket(fileno=os.dup(1)))
    try:  # a pipe or a terminal: our own open file description, so O_NONBLOCK is ours alone
        fd = os.open("/proc/self/fd/1", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return _Output(1, select.PIPE_BUF, owned=False)  # no /proc: share it as it is
    return _Output(fd, select.PIPE_BUF, owned=True)


class LineWriter:
    """Newline-terminated lines to ``path``, buffered up to ``max_buffer_bytes`` and written by the loop.

    ``buffer`` is exposed so a caller may encode straight into it (``encode_into(..., offset=-1)``);
    it must then call ``trim()`` with the length the buffer had before (lines past the bound are
    dropped and counted) and ``wrote()``.
    """

    def __init__(self, path: str, *, max_buffer_bytes: int = 4 << 20, flush_delay_s: float = 0.05) -> None:
        self.path = path
        self.max_buffer_bytes = max_buffer_bytes
        self.flush_delay_s = flush_delay_s
        self.buffer = bytearray()
        self.dropped = 0  # lines lost: buffer full, or the output failed
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.Handle | None = None
        self._output = open_output(path)
        self._last_error_log = float("-inf")
        # Called before each write-out to put deferred lines into `buffer` (the access log's): at most its
        # argument's number of them (None: all); True: more are pending (written out next, at once).
        self.fill: Callable[[int | None], bool] | None = None
        self._periodic = False  # write out every flush_delay_s, lines or not (`keep_flushing`)

    # -- the request path --------------------------------------------------------------------
    def trim(self, start: int) -> None:
        """Lines were appended to ``buffer`` from offset ``start`` on: drop (and count) those past its
        bound, whole lines from the end."""
        buffer = self.buffer
        if len(buffer) <= self.max_buffer_bytes:
            return
        keep = (buffer.rfind(b"\n", start, self.max_buffer_bytes) + 1) or start
        self.dropped += buffer.count(b"\n", keep)
        del buffer[keep:]

    def wrote(self) -> None:
        """A line was appended to ``buffer`` (or is pending for ``fill``): make sure a flush is coming."""
        if self._timer is None:
            self._timer = self._loop.call_later(self.flush_delay_s, self.flush)

    def keep_flushing(self) -> None:
        """Write out every ``flush_delay_s`` from now on, whether or not ``wrote`` was called: for a ``fill``
        whose lines arrive without telling (the access log's, unsampled). An idle worker's timer then runs
        20 times a second for nothing, which costs less than arming it from the request path."""
        self._periodic = True
        self.wrote()

    # -- off the request path ----------------------------------------------------------------
    def flush(self, whole: bool = False) -> None:
        """Write what the output takes now; keep the rest for the next flush. Deferred lines are made
        ``FILL_SLICE_LINES`` at a time, the rest in a callback of their own right after (``whole``: all now)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        more = self.fill is not None and self.fill(None if whole else FILL_SLICE_LINES)
        buffer = self.buffer
        done = self._write_out()
        del buffer[:done]
        if more:
            self._timer = self._loop.call_soon(self.flush)
        elif buffer or self._periodic:
            self._timer = self._loop.call_later(self.flush_delay_s, self.flush)

    def _write_out(self) -> int:
        """Bytes of ``buffer`` written, whole lines at a time, without blocking."""
        buffer, output = self.buffer, self._output
        end, done = len(buffer), 0
        while done < end:
            stop = done + output.batch
            if stop < end:
                cut = buffer.rfind(b"\n", done, stop)
                if cut < 0:  # one line longer than a batch: written alone
                    cut = buffer.find(b"\n", stop)
                stop = cut + 1 if cut >= 0 else end
            else:
                stop = end
            try:
                written = output.write(buffer[done:stop])
            except BlockingIOError:
                break
            except OSError as exc:
                # The output refuses the lines (gone, full disk): drop them, counted, rather than pile up.
                self.dropped += buffer.count(b"\n", done)
                self._log_error(exc)
                return end
            done += written
            if done < stop:
                break  # a partial write: the output is full for now
        return done

    def _log_error(self, exc: OSError) -> None:
        now = self._loop.time()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning("access log: cannot write to %s: %s (lines are dropped and counted)",
                        self.path, exc.strerror or errno.errorcode.get(exc.errno or 0, exc))

    def reopen(self) -> None:
        """SIGUSR1 (logrotate): write what is buffered where it was going, then open ``path`` again."""
        if self.path == STDOUT:
            return
        self.flush(whole=True)
        try:
            output = open_output(self.path)
        except OSError as exc:
            log.error("access log: cannot reopen %s: %s; still writing to the previous file", self.path, exc.strerror)
            return
        self._output.close()
        self._output = output
        if self.buffer:
            self.flush()

    async def close(self, timeout_s: float = 1.0) -> None:
        """Write what is left (waiting up to ``timeout_s`` for a slow output), then close."""
        deadline = self._loop.time() + timeout_s
        self.flush(whole=True)
        while self.buffer and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
            self.flush(whole=True)
        self._periodic = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.dropped += self.buffer.count(b"\n")
        self.buffer.clear()
        self._output.close()
