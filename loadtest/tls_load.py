"""A small HTTPS load client that can present a client certificate (wrk cannot): for mTLS benchmarks.

    .venv/bin/python -m loadtest.tls_load URL [--cert C --key K] [--connections 32] [--duration 5] [--close]

uvloop, ``--connections`` keep-alive connections (or, with ``--close``, a new connection and a full
handshake per request), each sending the chat request wrk's loadtest/configs/wrk_chat.lua sends, one
at a time, and reading its answer (Content-Length framed). Prints one JSON object: requests, req/s,
statuses, errors. The server's certificate is not verified (a benchmark's self-signed one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
import time
from urllib.parse import urlsplit

import uvloop

BODY = b'{"model":"demo-model","messages":[{"role":"user","content":"Say hello in five words."}],"max_tokens":16}'


def request_bytes(host: str, path: str, close: bool) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(BODY)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + BODY


def client_context(cert: str | None, key: str | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


class _Loop(asyncio.Protocol):
    """One connection sending the request again as soon as its answer is whole (Content-Length framed)."""

    def __init__(self, request: bytes, deadline: float, close: bool, counts: dict[str, int],
                 done: asyncio.Future) -> None:
        self.request, self.deadline, self.close, self.counts, self.done = request, deadline, close, counts, done
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            self.buffer = buffer
            return
        head = buffer[:end]
        at = head.lower().find(b"content-length:")
        length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None]) if at >= 0 else 0
        if len(buffer) < end + 4 + length:
            self.buffer = buffer
            return
        self.buffer = buffer[end + 4 + length:]
        status = head[9:12].decode()
        counts = self.counts
        counts[status] = counts.get(status, 0) + 1
        counts["requests"] += 1
        if self.close or self.loop.time() >= self.deadline:
            self.transport.close()  # type: ignore[union-attr]
        else:
            self.transport.write(self.request)  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.counts["errors"] += 1
        if not self.done.done():
            self.done.set_result(None)


async def _connection(host: str, port: int, context: ssl.SSLContext | None, request: bytes, deadline: float,
                      close: bool, counts: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        done = loop.create_future()
        protocol = _Loop(request, deadline, close, counts, done)
        try:
            await loop.create_connection(lambda protocol=protocol: protocol, host, port, ssl=context)
        except OSError:
            counts["errors"] += 1
            await asyncio.sleep(0.01)
            continue
        await done


async def run(url: str, connections: int, duration: float, close: bool, cert: str | None,
              key: str | None) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (80 if parts.scheme == "http" else 443)
    context = None if parts.scheme == "http" else client_context(cert, key)
    request = request_bytes(host, parts.path or "/", close)
    counts: dict[str, int] = {"requests": 0, "errors": 0}
    started = time.monotonic()
    deadline = asyncio.get_running_loop().time() + duration
    await asyncio.gather(*(_connection(host, port, context, request, deadline, close, counts)
                           for _ in range(connections)))
    elapsed = time.monotonic() - started
    return {"requests": counts["requests"], "requests_per_s": round(counts["requests"] / elapsed, 1),
            "errors": counts["errors"], "statuses": {k: v for k, v in counts.items() if k.isdigit()},
            "duration_s": round(elapsed, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.tls_load", description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--close", action="store_true", help="a new connection (full handshake) per request")
    parser.add_argument("--cert", help="client certificate (PEM) to present")
    parser.add_argument("--key", help="its private key")
    args = parser.parse_args(argv)
    result = uvloop.run(run(args.url, args.connections, args.duration, args.close, args.cert, args.key))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
