"""Observe providers: probe each health URL and scrape each Prometheus metrics URL.

This is the control plane's only network I/O. It returns plain data (one
:class:`~gateway.control.decide.Observation` per provider) for the pure
:mod:`gateway.control.decide`, and never raises for a provider that misbehaves: an
unreachable, slow or garbled provider is ``healthy=False`` with an ``error`` saying why.

The HTTP client is deliberately tiny: one ``GET`` per connection with
``Connection: close``, read to EOF (bounded), ``Content-Length`` or chunked bodies.
The metrics parser reads only the gauges it needs, accepting the mock provider's
names and vLLM's:

- queue depth: ``mock_queue_depth``, else ``vllm:num_requests_running`` +
  ``vllm:num_requests_waiting`` (summed over all series, e.g. one per model);
- KV-cache utilisation (0..1): ``mock_kv_cache_utilization``, else
  ``vllm:gpu_cache_usage_perc`` or ``vllm:kv_cache_usage_perc`` (the highest series).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from gateway.control.decide import Observation  # the pure side owns the type it consumes
from gateway.control.spec import Provider

MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # a metrics page is kilobytes; anything bigger is not one

MOCK_QUEUE_DEPTH = "mock_queue_depth"
VLLM_QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
KV_CACHE_GAUGES = ("mock_kv_cache_utilization", "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")
_WANTED = frozenset((MOCK_QUEUE_DEPTH, *VLLM_QUEUE_GAUGES, *KV_CACHE_GAUGES))


class ProbeError(Exception):
    """A failed HTTP exchange; the message is short and goes into logs and observations."""


# --------------------------------------------------------------------------- HTTP


def _request_bytes(url: str) -> tuple[str, int, ssl.SSLContext | None, bytes]:
    parts = urlsplit(url)
    https = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        authority += f":{port}"
    request = (f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: gridgate-control\r\n"
               "Accept: */*\r\nConnection: close\r\n\r\n").encode("ascii")
    return host, port, ssl.create_default_context() if https else None, request


def _dechunk(body: bytes) -> bytes:
    pieces: list[bytes] = []
    pos = 0
    while True:
        line_end = body.find(b"\r\n", pos)
        if line_end < 0:
            raise ProbeError("truncated chunked body")
        try:
            size = int(body[pos:line_end].split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ProbeError("bad chunk size") from None
        if size == 0:
            return b"".join(pieces)
        start = line_end + 2
        if len(body) < start + size:
            raise ProbeError("truncated chunked body")
        pieces.append(body[start : start + size])
        pos = start + size + 2


def parse_response(data: bytes) -> tuple[int, bytes]:
    """(status, body) of a complete HTTP/1.1 response read to EOF."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise ProbeError("incomplete response head" if data else "empty response")
    lines = head.split(b"\r\n")
    status_line = lines[0].split(None, 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit():
        raise ProbeError("malformed status line")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        body = _dechunk(body)
    elif (length := headers.get(b"content-length")) is not None:
        if not length.isdigit() or len(body) < int(length):
            raise ProbeError("truncated body")
        body = body[: int(length)]
    return int(status_line[1]), body


async def http_get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """``GET url`` within ``timeout_s`` (connect to EOF); raises :class:`ProbeError`."""
    host, port, ssl_context, request = _request_bytes(url)
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=ssl_context, server_hostname=host if ssl_context else None
            )
            try:
                writer.write(request)
                await writer.drain()
                data = bytearray()
                while chunk := await reader.read(65536):
                    data += chunk
                    if len(data) > MAX_RESPONSE_BYTES:
                        raise ProbeError(f"response larger than {MAX_RESPONSE_BYTES} bytes")
            finally:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()
    except TimeoutError:
        raise ProbeError(f"timed out after {timeout_s:g}s") from None
    except ConnectionRefusedError:
        raise ProbeError("connection refused") from None
    except ssl.SSLError as exc:
        raise ProbeError(f"TLS: {exc.reason or exc}") from None
    except OSError as exc:
        raise ProbeError(exc.strerror or type(exc).__name__) from None
    return parse_response(bytes(data))


# --------------------------------------------------------------------------- Prometheus text


def _sample(line: str) -> tuple[str, float] | None:
    """``name{labels} value [timestamp]`` -> (name, value); None for anything else."""
    end = 0
    while end < len(line) and line[end] not in "{ \t":
        end += 1
    name, rest = line[:end], line[end:]
    if rest.startswith("{"):
        in_quotes = escaped = False
        for index, char in enumerate(rest):
            if in_quotes:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_quotes = False
            elif char == '"':
                in_quotes = True
            elif char == "}":
                rest = rest[index + 1 :]
                break
        else:
            return None
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return (name, value) if math.isfinite(value) else None


def parse_gauges(text: str, names: Iterable[str] = _WANTED) -> dict[str, list[float]]:
    """Every sample of the named metrics, in page order (one value per label set)."""
    wanted = frozenset(names)
    found: dict[str, list[float]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        sample = _sample(line)
        if sample is not None and sample[0] in wanted:
            found.setdefault(sample[0], []).append(sample[1])
    return found


def queue_depth_from(gauges: dict[str, list[float]]) -> float | None:
    if MOCK_QUEUE_DEPTH in gauges:
        return sum(gauges[MOCK_QUEUE_DEPTH])
    present = [name for name in VLLM_QUEUE_GAUGES if name in gauges]
    return sum(sum(gauges[name]) for name in present) if present else None


def kv_cache_from(gauges: dict[str, list[float]]) -> float | None:
    for name in KV_CACHE_GAUGES:
        if name in gauges:
            return max(gauges[name])
    return None


# --------------------------------------------------------------------------- probes


async def probe_health(url: str, timeout_s: float) -> str | None:
    """None when ``GET url`` answers 2xx in time, else why not."""
    try:
        status, _ = await http_get(url, timeout_s)
    except ProbeError as exc:
        return f"health: {exc}"
    return None if 200 <= status < 300 else f"health: HTTP {status}"


async def scrape_metrics(url: str, timeout_s: float) -> tuple[float | None, float | None, str | None]:
    """(queue depth, KV-cache utilisation, error); a gauge the page lacks is None."""
    try:
        status, body = await http_get(url, timeout_s)
    except ProbeError as exc:
        return None, None, f"metrics: {exc}"
    if status != 200:
        return None, None, f"metrics: HTTP {status}"
    gauges = parse_gauges(body.decode("utf-8", "replace"))
    queue_depth, kv_cache = queue_depth_from(gauges), kv_cache_from(gauges)
    missing = [label for label, value in (("queue-depth", queue_depth), ("KV-cache", kv_cache)) if value is None]
    error = f"metrics: no {' or '.join(missing)} gauge" if missing else None
    return queue_depth, kv_cache, error


async def observe_provider(provider: Provider, timeout_s: float, with_metrics: bool) -> Observation:
    """Health and (optionally) metrics of one provider, concurrently."""
    try:
        if not (with_metrics and provider.metrics_url):
            error = await probe_health(provider.health_url, timeout_s)
            return Observation(healthy=error is None, error=error)
        health_error, (queue_depth, kv_cache, metrics_error) = await asyncio.gather(
            probe_health(provider.health_url, timeout_s), scrape_metrics(provider.metrics_url, timeout_s)
        )
    except Exception as exc:  # noqa: BLE001 - a probe bug must mark one provider down, not stop the loop
        return Observation(healthy=False, error=f"probe failed: {type(exc).__name__}: {exc}")
    if health_error is not None:
        return Observation(healthy=False, error=health_error)
    return Observation(True, queue_depth, kv_cache, metrics_error)


async def observe_all(providers: Sequence[Provider], timeout_s: float, with_metrics: bool) -> dict[str, Observation]:
    """One observation per provider name, all probed concurrently."""
    results = await asyncio.gather(*(observe_provider(p, timeout_s, with_metrics) for p in providers))
    return {provider.name: result for provider, result in zip(providers, results, strict=True)}
