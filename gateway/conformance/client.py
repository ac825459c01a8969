"""One conformance request: a fresh connection (TLS and SNI as the cluster sets them), one exchange, timed.

The HTTP is the data plane's own client codec, as the health probe's is; ``Connection: close`` and a
bounded read keep a misbehaving provider from holding the checker. Every transport failure becomes
``Answer.error`` in plain words, never an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Iterator
from functools import cache

from gateway.conformance.probe import Answer, Probe, Target
from gateway.http.client_codec import ClientCodec
from gateway.http.codec import NEED_DATA, Body, ConnectionClosed, EndOfMessage, ParseError, ResponseHead
from gateway.net import client_tls_context, parse_host_port

MAX_ANSWER_BYTES = 16 * 1024 * 1024
WRONG_CREDENTIAL = "Bearer gridgate-verify-wrong-credential"
USER_AGENT = b"gridgate-providers-verify"
SSL_HOSTNAME_MISMATCH = 62  # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH


class ProbeError(Exception):
    """A failed exchange, in plain words (``connection refused``, ``timed out after 30s`` ...)."""


@contextlib.contextmanager
def _explained(timeout_s: float) -> Iterator[None]:
    try:
        yield
    except TimeoutError:
        raise ProbeError(f"timed out after {timeout_s:g}s") from None
    except ConnectionRefusedError:
        raise ProbeError("connection refused") from None
    except ssl.SSLError as exc:
        raise ProbeError(f"TLS: {exc.reason or exc}") from None
    except OSError as exc:
        raise ProbeError(exc.strerror or type(exc).__name__) from None


@cache
def _tls_context(ca_file: str | None, verify: bool) -> ssl.SSLContext:
    return client_tls_context(ca_file=ca_file, verify=verify)


def request_bytes(target: Target, probe: Probe, codec: ClientCodec) -> bytes:
    headers = [(b"user-agent", USER_AGENT), (b"accept", b"*/*"), (b"connection", b"close")]
    if probe.method == "POST":
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(probe.body)).encode())]
    if target.credential_header is not None and probe.credential != "none":
        value = target.credential if probe.credential == "configured" else WRONG_CREDENTIAL
        headers.append((target.credential_header.encode(), (value or "").encode("latin-1")))
    headers += [(name.encode(), value.encode("latin-1")) for name, value in probe.headers]
    head = codec.encode_request(probe.method.encode(), probe.path.encode(), target.address.encode(), headers)
    return head + probe.body


async def send(target: Target, probe: Probe, timeout_s: float) -> Answer:
    """Send ``probe`` to ``target`` within ``timeout_s``; the answer, or one with ``error`` set."""
    answer = Answer()
    started = time.monotonic()
    try:
        with _explained(timeout_s):
            async with asyncio.timeout(timeout_s):
                await _exchange(target, probe, answer, started)
    except ProbeError as exc:
        answer.error = str(exc)
    except ParseError as exc:
        answer.error = f"malformed response: {exc}"
    answer.total_s = time.monotonic() - started
    return answer


def _certificate_problem(exc: ssl.SSLCertVerificationError, target: Target, server_name: str) -> ProbeError:
    """A refused certificate in words an operator acts on: the server name (SNI) it does not match, or the
    CA it does not chain to."""
    message = exc.verify_message or exc.reason or str(exc)
    if exc.verify_code == SSL_HOSTNAME_MISMATCH or "hostname mismatch" in message.lower():
        return ProbeError(f"TLS: the certificate does not match the server name {server_name!r} (SNI, tls.sni or "
                          f"the endpoint's host): {message}")
    trusted = f"tls.ca_file {target.ca_file}" if target.ca_file else "the system's CAs (no tls.ca_file)"
    return ProbeError(f"TLS: the certificate is not trusted by {trusted}: {message}")


async def _exchange(target: Target, probe: Probe, answer: Answer, started: float) -> None:
    host, port = parse_host_port(target.address)
    tls = _tls_context(target.ca_file, target.verify) if target.tls else None
    server_name = target.sni or host
    try:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=tls, server_hostname=server_name if tls is not None else None)
    except ssl.SSLCertVerificationError as exc:
        raise _certificate_problem(exc, target, server_name) from None
    if tls is not None:
        tls_object = writer.get_extra_info("ssl_object")
        answer.tls = (tls_object.version() if tls_object is not None else "TLS", server_name)
    try:
        codec = ClientCodec()
        writer.write(request_bytes(target, probe, codec))
        await writer.drain()
        await _read(reader, codec, answer, started)
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def _read(reader: asyncio.StreamReader, codec: ClientCodec, answer: Answer, started: float) -> None:
    body: list[bytes] = []
    received = 0
    while True:
        data = await reader.read(65536)
        received += len(data)
        if received > MAX_ANSWER_BYTES:
            raise ProbeError(f"answer larger than {MAX_ANSWER_BYTES} bytes")
        codec.feed(data)
        while (event := codec.next_event()) is not NEED_DATA:
            kind = type(event)
            if kind is ResponseHead:
                answer.status = event.status_code
                answer.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in codec.head_headers}
            elif kind is Body:
                piece = bytes(event.data)
                body.append(piece)
                answer.chunks.append((time.monotonic() - started, piece))
            elif kind is EndOfMessage:
                answer.body = b"".join(body)
                return
            elif kind is ConnectionClosed:
                raise ProbeError("the connection closed before an answer" if not answer.status else "truncated body")
        if not data:
            raise ProbeError("truncated answer")
