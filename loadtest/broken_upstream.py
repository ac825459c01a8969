"""A deliberately broken HTTP/1.1 upstream, for tests of the gateway's provider side.

    python -m loadtest.broken_upstream [--listen 127.0.0.1:9201] [--behaviour NAME] [--list]

Every request is answered by a *behaviour*: a function from the request to a script of steps, each
step raw bytes to write, a pause (float seconds) or ``CLOSE``. The request header ``x-behaviour``
names the behaviour (else the server's default), so the requests of one pooled connection can take
turns at clean and broken answers; ``x-tag`` is echoed in every body (``answer:<tag>``, and
``leak:<tag>`` in the bytes a broken answer sends beyond its own framing), so a test can tell whose
answer a client received. Adding a failure mode is adding one function with ``@behaviour``.

Connections are served one request at a time, each script to its end before the next request is read:
a broken server whose late bytes reach a connection after the next request was sent, exactly as the
desync reports describe. ``stats`` records each connection and each request seen on it.

In-process (tests): ``BrokenUpstream(default="clean").start()`` serves from daemon threads on a free
loopback port; ``address`` is its ``host:port``; ``stop()`` closes the listener and every connection.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

CLOSE = object()  # a script step: close the connection
Step = bytes | float | object
Behaviour = Callable[["Request"], Iterable[Step]]

LATE_S = 0.05  # how long "late" bytes wait after the answer they follow
MAX_HEAD = 65536
STREAM_PIECE = b"data: " + b"x" * 8185 + b"\n\n"  # one 8 KiB SSE event of a big stream
STREAM_EVENTS = 8192  # a big stream is 64 MiB: more than any socket buffer holds
FLOOD_HEAD = b"HTTP/1.1 100 Continue\r\n\r\n"

BEHAVIOURS: dict[str, Behaviour] = {}


def behaviour(function: Behaviour) -> Behaviour:
    """Register a behaviour under its function name."""
    BEHAVIOURS[function.__name__] = function
    return function


@dataclass
class Request:
    method: bytes
    target: bytes
    headers: dict[bytes, bytes]
    body: bytes

    @property
    def tag(self) -> bytes:
        return self.headers.get(b"x-tag", b"untagged")


@dataclass
class Seen:
    """One request as the upstream received it."""

    connection: int  # 1 for the first connection accepted, and so on
    method: str
    behaviour: str
    tag: str


@dataclass
class UpstreamStats:
    connections: int = 0
    requests: list[Seen] = field(default_factory=list)

    def tags(self) -> list[str]:
        return [seen.tag for seen in self.requests]

    def connection_of(self, tag: str) -> int:
        return next(seen.connection for seen in self.requests if seen.tag == tag)


# -- building blocks ------------------------------------------------------------------------------
def answer(tag: bytes) -> bytes:
    return b"answer:" + tag


def leak(tag: bytes) -> bytes:
    """A complete response carrying ``tag``: the bytes no other client may ever receive."""
    body = b"leak:" + tag
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def length_response(body: bytes, status: bytes = b"200 OK", version: bytes = b"HTTP/1.1", extra: bytes = b"") -> bytes:
    return b"%s %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%s\r\n%s" % (
        version, status, len(body), extra, body)


def chunked_body(body: bytes) -> bytes:
    return (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"


def chunked_response(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n%s\r\n" % extra
            + chunked_body(body))


# -- behaviours: clean ------------------------------------------------------------------------------
@behaviour
def clean(req: Request) -> list[Step]:
    """A correct answer framed by Content-Length (a HEAD gets the head alone)."""
    response = length_response(answer(req.tag))
    return [response.partition(b"\r\n\r\n")[0] + b"\r\n\r\n" if req.method == b"HEAD" else response]


@behaviour
def chunked(req: Request) -> list[Step]:
    """A correct chunked answer."""
    return [chunked_response(answer(req.tag))]


@behaviour
def big_stream(req: Request) -> list[Step]:
    """A 64 MiB event stream, written as fast as the connection takes it."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    piece = b"%x\r\n%s\r\n" % (len(STREAM_PIECE), STREAM_PIECE)
    return [head, *([piece] * STREAM_EVENTS), b"0\r\n\r\n"]


# -- behaviours: bytes beyond the answer's own framing ------------------------------------------------
@behaviour
def extra_after_length(req: Request) -> list[Step]:
    """Early bytes: a Content-Length answer and, in the same write, a whole second response."""
    return [length_response(answer(req.tag)) + leak(req.tag)]


@behaviour
def extra_after_chunked(req: Request) -> list[Step]:
    """Early bytes after a chunked answer's last chunk, in the same write."""
    return [chunked_response(answer(req.tag)) + leak(req.tag)]


@behaviour
def late_extra(req: Request) -> list[Step]:
    """Stray bytes: a clean answer, then an unasked response ``LATE_S`` later (the connection sits idle)."""
    return [length_response(answer(req.tag)), LATE_S, leak(req.tag)]


@behaviour
def head_late_body(req: Request) -> list[Step]:
    """A HEAD answered with the length of a body that arrives ``LATE_S`` later anyway."""
    body = leak(req.tag)
    return [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(body), LATE_S, body]


@behaviour
def no_content_late_body(req: Request) -> list[Step]:
    """204 with a Content-Length, its "body" following ``LATE_S`` later."""
    body = leak(req.tag)
    return [b"HTTP/1.1 204 No Content\r\ncontent-length: %d\r\n\r\n" % len(body), LATE_S, body]


@behaviour
def not_modified_late_body(req: Request) -> list[Step]:
    """304 with a Content-Length, its "body" following ``LATE_S`` later."""
    body = leak(req.tag)
    return [b"HTTP/1.1 304 Not Modified\r\ncontent-length: %d\r\n\r\n" % len(body), LATE_S, body]


@behaviour
def no_content_with_body(req: Request) -> list[Step]:
    """204 whose body follows in the same write."""
    body = leak(req.tag)
    return [b"HTTP/1.1 204 No Content\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)]


@behaviour
def informational_with_body(req: Request) -> list[Step]:
    """A 100 head declaring a body (which parses as a whole response), the real answer ``LATE_S`` later."""
    body = leak(req.tag)
    return [b"HTTP/1.1 100 Continue\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body), LATE_S,
            length_response(answer(req.tag))]


@behaviour
def length_and_chunked(req: Request) -> list[Step]:
    """Both Content-Length and Transfer-Encoding (framed chunked), then more bytes ``LATE_S`` later."""
    body = chunked_body(answer(req.tag))
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\ntransfer-encoding: chunked\r\n\r\n"
            % (len(body) + 5))
    return [head + body, LATE_S, leak(req.tag)]


@behaviour
def close_delimited(req: Request) -> list[Step]:
    """An answer without framing: its body ends when the server closes, which it does late."""
    return [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n" + answer(req.tag), 4 * LATE_S, CLOSE]


@behaviour
def http10_keep_alive(req: Request) -> list[Step]:
    """An HTTP/1.0 answer that keeps the connection open, then stray bytes ``LATE_S`` later."""
    return [length_response(answer(req.tag), version=b"HTTP/1.0", extra=b"connection: keep-alive\r\n"),
            LATE_S, leak(req.tag)]


# -- behaviours: informational heads ------------------------------------------------------------------
@behaviour
def informational_flood(req: Request) -> Iterable[Step]:
    """100 Continue heads without end, never a final head (until the gateway hangs up)."""
    return itertools.repeat(FLOOD_HEAD * 256)


@behaviour
def slow_informational(req: Request) -> list[Step]:
    """A 100 Continue head every 100 ms, 15 in all (under any sane cap), then nothing for a minute."""
    return [step for _ in range(15) for step in (FLOOD_HEAD, 0.1)] + [60.0]


@behaviour
def silent(req: Request) -> list[Step]:
    """Reads the request, never answers (until the gateway hangs up)."""
    return [60.0]


# -- the server ---------------------------------------------------------------------------------------
class BrokenUpstream:
    """Serves the behaviours from daemon threads, one per connection."""

    def __init__(self, default: str = "clean", host: str = "127.0.0.1", port: int = 0) -> None:
        if default not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {default!r}; known: {', '.join(sorted(BEHAVIOURS))}")
        self.default = default
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self.listener.getsockname()[:2]
        self.stats = UpstreamStats()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> BrokenUpstream:
        threading.Thread(target=self._accept, name="broken-upstream", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def __enter__(self) -> BrokenUpstream:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.stats.connections += 1
                number = self.stats.connections
                self._open.add(sock)
            threading.Thread(target=self._serve, args=(sock, number), daemon=True).start()

    def _serve(self, sock: socket.socket, number: int) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = b""
        try:
            while True:
                request, buffer = _read_request(sock, buffer)
                if request is None:
                    return
                name = request.headers.get(b"x-behaviour", self.default.encode()).decode()
                script = BEHAVIOURS.get(name)
                self.stats.requests.append(Seen(number, request.method.decode(), name, request.tag.decode()))
                if script is None:
                    sock.sendall(length_response(b"unknown behaviour " + name.encode(), b"400 Bad Request"))
                    continue
                if not _play(sock, script(request)):
                    return
        except OSError:
            return  # the gateway hung up: a broken answer may well end that way
        finally:
            with self._lock:
                self._open.discard(sock)
            sock.close()


def _play(sock: socket.socket, script: Iterable[Step]) -> bool:
    """Run one script; False once it closed the connection."""
    for step in script:
        if step is CLOSE:
            return False
        if isinstance(step, float):
            time.sleep(step)
        else:
            sock.sendall(step)  # type: ignore[arg-type]
    return True


def _read_request(sock: socket.socket, buffer: bytes) -> tuple[Request | None, bytes]:
    """The next request (Content-Length bodies only: the gateway always sends those); None at EOF."""
    while b"\r\n\r\n" not in buffer:
        if len(buffer) > MAX_HEAD:
            return None, b""
        data = sock.recv(65536)
        if not data:
            return None, b""
        buffer += data
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    method, target, _version = lines[0].split(b" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get(b"content-length", b"0"))
    while len(buffer) < length:
        data = sock.recv(65536)
        if not data:
            return None, b""
        buffer += data
    return Request(method, target, headers, buffer[:length]), buffer[length:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.broken_upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:9201", help="host:port to listen on")
    parser.add_argument("--behaviour", default="clean", help="behaviour of requests without x-behaviour")
    parser.add_argument("--list", action="store_true", help="list the behaviours and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, function in sorted(BEHAVIOURS.items()):
            print(f"{name}: {(function.__doc__ or '').strip()}")
        return 0
    host, _, port = args.listen.rpartition(":")
    try:
        server = BrokenUpstream(args.behaviour, host or "127.0.0.1", int(port))
    except (ValueError, OSError) as error:
        print(f"broken_upstream: {error}", file=sys.stderr)
        return 1
    print(f"broken upstream on {server.address}, default behaviour {server.default}", flush=True)
    server.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
