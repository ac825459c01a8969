"""A fast OpenAI-compatible mock provider for tests, demos and benchmarks.

It answers `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and `GET /v1/models`
(plain JSON or SSE), the OpenAI Responses API (`POST /v1/responses`) and the Anthropic Messages API
(`POST /v1/messages`, `/v1/messages/count_tokens`) as the real ones do, refusals of members they do not
define included (loadtest/mock_surfaces.py), plus `GET /health`, `GET /metrics`, `/debug/echo` and
`/admin/*`.

Speed matters more than generality: it is the far end of every gateway benchmark and must never be
the bottleneck. Hence uvloop, a bare `asyncio.Protocol` with a hand-written HTTP/1.1 parser, and a
synchronous fast path: a response that needs no waiting is written from `data_received` directly,
without creating a task. Only responses with delays (latency, TTFT, token pacing, stalls) run as
tasks, one per connection at a time, which keeps pipelined responses in request order.

Failure injection, per request (headers win over flags):
  X-Mock-Status: 503            answer with that status and an OpenAI-style error body
  X-Mock-Retry-After: 2         the error's Retry-After: delta seconds or an HTTP date as given,
                                `date+N` (an HTTP date N s from now) or `none` (no header);
                                without it 429 and 503 carry `Retry-After: 1`
  X-Mock-Reset: before|mid      abort the connection (RST) before any byte / halfway through the body
                                (an SSE stream is cut after half of its token events);
                                `mid-close` cuts there with a FIN instead, as a provider that died
  X-Mock-Stall-Ms: 5000         wait before the response headers (a first-byte stall)
  X-Mock-Stall-Mid-Ms: 5000     wait halfway through the body (after the headers)
  X-Mock-Fault-For: a,b         apply the five headers above only on the mocks named a or b, so one
                                request sent through a gateway fails on one provider, not on the next
  X-Mock-Tokens: 20             number of output tokens (still capped by max_tokens)
  X-Mock-Latency-Ms / X-Mock-TTFT-Ms / X-Mock-Tokens-Per-S: per-request timing overrides
  X-Mock-Echo: 1                add the received method/path/headers to a JSON completion body
  X-Mock-Stamp: 1               the first content event of a chat or completions stream carries
                                "mock_sent_ns": CLOCK_MONOTONIC in ns taken as it is written (the
                                first-token benchmark's clock: loadtest/bench_streams.py)
  X-Mock-Cached-Tokens / X-Mock-Cache-Write-Tokens / X-Mock-Reasoning-Tokens: N
                                report that many cached prompt, cache-written prompt and reasoning
                                tokens in the usage (where the API has the field)

Prompt cache (`--prefix-cache N`, loadtest/mock_prefix_cache.py): an LRU of N prompt prefixes (tools,
system prompt, all turns but the last); a hit reports the prefix's tokens as cached and answers sooner.

Admin: `POST /admin/health {"status": 503}` switches /health (shared by all --processes);
`POST /admin/config {...}` changes timing, failure rates, `retry_after` (same forms as the header;
null = the default), `fail_next` (the next N inference requests answer `fail_status`) and the metric
overrides (`kv_cache_utilization`, `queue_depth`; null clears) of the process that receives it, as do
the counters on /metrics: with --processes N, each process keeps its own. `GET /admin/received` lists
the last inference requests this process received (method, path, headers, body): what a gateway sent.

Conformance (loadtest/mock_conformance.py): `--api-key`, `--context-window` and `--nonconformance`
(short_context, no_stream_usage, wrong_error_shape, no_tools, no_done; also `POST /admin/config`), for
`gridgate providers verify` to catch.

Run `python -m loadtest.mock_provider -h` for the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import email.utils
import mmap
import os
import random
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from loadtest import mock_conformance as conformance
from loadtest.mock_prefix_cache import PrefixCache, hit_delay
from loadtest.mock_surfaces import ANTHROPIC_ENDPOINTS, SHAPES, MessagesShape, SurfaceError

MAX_HEAD_BYTES = 65536
MAX_BODY_BYTES = 64 * 1024 * 1024
RECEIVED_KEPT = 32  # inference requests GET /admin/received lists
# While a timed response runs, pipelined bytes pile up; stop reading past this much.
READ_PAUSE_BYTES = 1024 * 1024

REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request",
    401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 413: "Payload Too Large", 422: "Unprocessable Entity",
    429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
}

# Word pieces the fake model "generates"; one piece is one token.
LOREM = (
    " lorem", " ipsum", " dolor", " sit", " amet", ",", " consectetur", " adipiscing", " elit", ".",
    " sed", " do", " eiusmod", " tempor", " incididunt", " ut", " labore", " et", " dolore", " magna",
)

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


# --------------------------------------------------------------------------------------------------
# Settings and state


@dataclass
class MockSettings:
    """Behaviour knobs; flags set them at start, `POST /admin/config` changes them at run time."""

    name: str = "mock"
    latency_ms: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    tokens: int = 16
    models: list[str] = field(default_factory=lambda: ["mock-model"])
    embedding_dim: int = 8
    fail_rate: float = 0.0
    fail_status: int = 503
    fail_code: str | None = None  # the error code of injected failures (None: injected_<status>)
    fail_next: int = 0  # the next N inference requests fail (counts down), whatever fail_rate says
    retry_after: str | None = None  # Retry-After of injected errors (None: "1" on 429/503)
    reset_rate: float = 0.0
    mid_reset_rate: float = 0.0
    stall_rate: float = 0.0
    stall_ms: float = 0.0
    kv_capacity_tokens: int = 65536
    kv_cache_utilization: float | None = None  # fixed override of the simulated value
    queue_depth: int | None = None  # fixed override of the measured in-flight count
    prefix_cache: int = 0  # prompt prefixes the LRU keeps (loadtest/mock_prefix_cache.py); 0: no cache
    prefix_hit_factor: float = 0.3  # the first-token delay a fully cached prompt keeps
    prefix_cache_ttl_ms: float = 0.0  # a cached prefix expires after this long (0: never)
    cors_origin: str | None = None  # sent as Access-Control-Allow-Origin on every response (as some providers do)
    # Conformance (loadtest/mock_conformance.py): a required key, an enforced window, broken promises.
    api_key: str | None = None
    context_window: int = 0  # 0: no window enforced
    nonconformance: str = ""  # comma-separated conformance.FAULTS


class SharedHealth:
    """The /health status, in an anonymous shared mapping so all --processes agree on it."""

    def __init__(self, status: int) -> None:
        self._map = mmap.mmap(-1, 8)
        self.status = status

    @property
    def status(self) -> int:
        return struct.unpack_from("q", self._map, 0)[0]

    @status.setter
    def status(self, value: int) -> None:
        struct.pack_into("q", self._map, 0, value)


class MockState:
    """Per-process counters and the simulated load the /metrics page reports."""

    def __init__(self, settings: MockSettings, health: SharedHealth) -> None:
        self.settings = settings
        self.health = health
        self.in_flight = 0
        self.held_tokens = 0  # prompt + output tokens of in-flight requests: the simulated KV cache
        self.served: dict[str, int] = {}
        self.faults: dict[str, int] = {"status": 0, "reset_before": 0, "reset_mid": 0, "reset_mid_close": 0,
                                       "stall": 0}
        self.counter = 0
        self.received: collections.deque[Request] = collections.deque(maxlen=RECEIVED_KEPT)
        self.provider_header = b""
        self.rng = random.Random()
        self.nonconformance: frozenset[str] = frozenset()
        self.prefix_cache = PrefixCache()
        self.refresh()

    def refresh(self) -> None:
        """Recompute values derived from the settings (called after every settings change)."""
        self.nonconformance = conformance.parse_faults(self.settings.nonconformance)
        self.provider_header = b"x-mock-provider: " + self.settings.name.encode("latin-1") + b"\r\n"
        if self.settings.cors_origin:
            self.provider_header += b"access-control-allow-origin: " + self.settings.cors_origin.encode("latin-1") + \
                b"\r\n"

    def next_id(self) -> int:
        self.counter += 1
        return self.counter

    def count_served(self, endpoint: str) -> None:
        self.served[endpoint] = self.served.get(endpoint, 0) + 1

    def kv_utilization(self) -> float:
        fixed = self.settings.kv_cache_utilization
        if fixed is not None:
            return fixed
        return min(1.0, self.held_tokens / max(1, self.settings.kv_capacity_tokens))

    def queue_depth(self) -> int:
        fixed = self.settings.queue_depth
        return self.in_flight if fixed is None else fixed


# --------------------------------------------------------------------------------------------------
# HTTP/1.1 request parsing


class BadRequest(Exception):
    """A refused request; ``payload`` is the whole error body when the API has its own (else the
    OpenAI shape, or Anthropic's on its endpoints, is built from the message)."""

    def __init__(self, status: int, message: str, payload: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.payload = payload


class Request:
    __slots__ = ("method", "target", "path", "version", "headers", "fields", "body", "keep_alive")

    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]]) -> None:
        self.method = method
        self.target = target
        self.path = target.split("?", 1)[0]
        self.version = version
        self.headers = headers  # as received, for /debug/echo
        self.fields = {name.lower(): value for name, value in headers}  # last one wins
        self.body = b""
        # HTTP/1.0 connections always close: no need to negotiate keep-alive for clients that old.
        self.keep_alive = version == "HTTP/1.1" and "close" not in self.fields.get("connection", "").lower()


def parse_head(head: bytes) -> Request:
    """Parse a request line and header block (without the terminating blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(400, "unsupported HTTP version")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or line[0] in " \t":
            raise BadRequest(400, "malformed header line")
        headers.append((name, value.strip(" \t")))
    return Request(method, target, version, headers)


def parse_chunked(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body beginning at `start`; (body, end offset) or None if incomplete."""
    pieces: list[bytes] = []
    size_total = 0
    pos = start
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            if len(buf) - pos > 1024:
                raise BadRequest(400, "chunk size line too long")
            return None
        size_text = bytes(buf[pos:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadRequest(400, "bad chunk size") from None
        if size < 0:
            raise BadRequest(400, "bad chunk size")
        pos = line_end + 2
        if size == 0:
            break
        size_total += size
        if size_total > MAX_BODY_BYTES:
            raise BadRequest(413, "request body too large")
        if len(buf) < pos + size + 2:
            return None
        if buf[pos + size : pos + size + 2] != b"\r\n":
            raise BadRequest(400, "chunk not terminated by CRLF")
        pieces.append(bytes(buf[pos : pos + size]))
        pos += size + 2
    # Trailer section: header lines until an empty line.
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        if line_end == pos:
            return b"".join(pieces), pos + 2
        pos = line_end + 2


# --------------------------------------------------------------------------------------------------
# Response building


def head_bytes(state: MockState, status: int, headers: list[tuple[str, str]], keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    if not keep_alive:
        lines.append("connection: close\r\n")
    return "".join(lines).encode("latin-1") + state.provider_header + b"\r\n"


def json_response(state: MockState, status: int, payload: Any, keep_alive: bool,
                  extra: list[tuple[str, str]] | None = None) -> bytes:
    body = _json_encode(payload)
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    if extra:
        headers.extend(extra)
    return head_bytes(state, status, headers, keep_alive) + body


CACHED_ENDPOINTS = ("chat", "completions", "responses", "messages")  # the prompt cache's (not embeddings)


def error_payload(message: str, err_type: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": code}}


def refusal_payload(endpoint: str | None, exc: BadRequest) -> dict[str, Any]:
    """The body of a refused request, in the shape of the API it was sent to."""
    if exc.payload is not None:
        return exc.payload
    if endpoint in ANTHROPIC_ENDPOINTS:
        return MessagesShape.error_payload(exc.status, str(exc), "invalid_request_error", "bad_request")
    return error_payload(str(exc), "invalid_request_error", "bad_request")


def sse_chunk(payload: Any) -> bytes:
    """One SSE event as one HTTP chunk."""
    event = b"data: " + (payload if isinstance(payload, bytes) else _json_encode(payload)) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class StampedEvent(bytes):
    """An SSE chunk whose STAMP_SLOT gets the monotonic clock when written (X-Mock-Stamp)."""


STAMP_SLOT = b"@" * 19  # as wide as any CLOCK_MONOTONIC ns value, so the chunk size stays right


def stamped(chunk: bytes) -> bytes:
    """The chunk with its slot filled with now (a subclass check keeps unstamped writes at one compare)."""
    return chunk.replace(STAMP_SLOT, b"%019d" % time.monotonic_ns()) if type(chunk) is StampedEvent else chunk


SSE_DONE = sse_chunk(b"[DONE]")
CHUNKED_END = b"0\r\n\r\n"


def estimate_tokens(value: Any) -> int:
    """A rough prompt token count: four characters per token, over all text in the value."""
    if isinstance(value, str):
        return len(value) // 4 + 1
    if isinstance(value, list):
        return sum(estimate_tokens(item) for item in value)
    if isinstance(value, dict):
        return sum(estimate_tokens(item) for key, item in value.items() if key in ("content", "text"))
    return 0


def token_pieces(state: MockState, count: int) -> list[str]:
    intro = ["Hello", " from", " " + state.settings.name, "."]
    return [intro[i] if i < len(intro) else LOREM[(i - len(intro)) % len(LOREM)] for i in range(count)]


# A response is a sequence of steps: wait `delay` seconds, then write bytes or do an action.
ABORT = "abort"  # drop the connection without a proper end (a reset)
CLOSE = "close"  # end the connection with a FIN where the body is not finished (a provider that died)
CUTS = (ABORT, CLOSE)
Step = tuple[float, bytes | str]


@dataclass
class Timing:
    latency: float
    ttft: float
    per_token: float
    stall: float
    stall_mid: float


def header_float(fields: dict[str, str], name: str, default: float) -> float:
    raw = fields.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(400, f"{name} must be a number") from None


class Completion:
    """Turns one inference request into response steps, applying the failure injection."""

    def __init__(self, state: MockState, req: Request, endpoint: str) -> None:
        self.state = state
        self.req = req
        self.endpoint = endpoint
        settings = state.settings
        self._refusal(endpoint, conformance.check_credential, req.fields, settings.api_key)
        try:
            self.body = _json_decode(req.body) if req.body else {}
        except msgspec.DecodeError:
            raise BadRequest(400, "request body is not valid JSON") from None
        if not isinstance(self.body, dict):
            raise BadRequest(400, "request body must be a JSON object")
        shape_class = SHAPES.get(endpoint)
        if shape_class is not None:
            try:
                shape_class.check(req, self.body)
            except SurfaceError as exc:
                raise BadRequest(exc.status, str(exc), exc.payload) from None
        self.model = str(self.body.get("model") or settings.models[0])
        self.stream = self.body.get("stream") is True and (shape_class is None or shape_class.streams)
        options = self.body.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.stamp = "x-mock-stamp" in req.fields
        self.tokens, self.truncated = self._output_tokens(shape_class)
        self.prompt_tokens = self._prompt_tokens(shape_class)
        # The prompt cache (--prefix-cache): cached prompt tokens, None when off (the headers win).
        self.prefix_cached: int | None = None
        if endpoint in CACHED_ENDPOINTS and "x-mock-cached-tokens" not in req.fields:
            cached = state.prefix_cache.lookup(settings.prefix_cache, endpoint, self.body, time.monotonic(),
                                               settings.prefix_cache_ttl_ms / 1000.0)
            self.prefix_cached = None if cached is None else min(cached, self.prompt_tokens)
        faults = state.nonconformance
        self._refusal(endpoint, conformance.check_tools, self.body, faults)
        if endpoint != "embeddings":
            window = conformance.effective_window(settings.context_window, faults)
            self._refusal(endpoint, conformance.check_context, self.prompt_tokens, self.body, window)
        self.include_usage = self.include_usage and "no_stream_usage" not in faults
        self.tool = conformance.forced_tool(self.body) if endpoint == "chat" else None
        try:  # the Responses or Messages answer (None: the OpenAI APIs built here)
            self.shape = None if shape_class is None else shape_class(self)
        except ValueError as exc:
            raise BadRequest(400, str(exc)) from None
        # The failure-injection headers, or none when X-Mock-Fault-For names other mocks.
        self.fault_fields = req.fields if self._fault_headers_apply() else {}
        stall = header_float(self.fault_fields, "x-mock-stall-ms", -1.0)
        if stall < 0:
            stall = settings.stall_ms if self._roll(settings.stall_rate) else 0.0
        tps = header_float(req.fields, "x-mock-tokens-per-s", settings.tokens_per_s)
        self.timing = Timing(
            latency=header_float(req.fields, "x-mock-latency-ms", settings.latency_ms) / 1000.0,
            ttft=header_float(req.fields, "x-mock-ttft-ms", settings.ttft_ms) / 1000.0,
            per_token=1.0 / tps if tps > 0 else 0.0,
            stall=stall / 1000.0,
            stall_mid=header_float(self.fault_fields, "x-mock-stall-mid-ms", 0.0) / 1000.0,
        )
        if self.prefix_cached:  # a warm prefix: the prompt's cached share needs no prefill
            factor = settings.prefix_hit_factor
            self.timing.latency = hit_delay(self.timing.latency, self.prefix_cached, self.prompt_tokens, factor)
            self.timing.ttft = hit_delay(self.timing.ttft, self.prefix_cached, self.prompt_tokens, factor)
        if self.timing.stall > 0:
            state.faults["stall"] += 1
        self.status = self._injected_status()
        self.reset = self._injected_reset()
        self.cut_mid = self.reset in ("mid", "mid-close")
        # A Responses or Messages stream ends half-way with the API's `error` event (the provider failed).
        self.stream_error = "x-mock-stream-error" in self.fault_fields
        self.cut = CLOSE if self.reset == "mid-close" else ABORT  # how a mid-body cut ends the connection
        self.retry_after = None if self.status == 200 else retry_after_value(
            self.fault_fields.get("x-mock-retry-after", settings.retry_after), self.status)

    @staticmethod
    def _refusal(endpoint: str, check: Callable[..., None], *args: Any) -> None:
        """Run a conformance check; its refusal becomes a BadRequest in the endpoint's error shape."""
        try:
            check(*args)
        except conformance.Refusal as exc:
            payload = None if endpoint in ANTHROPIC_ENDPOINTS else exc.payload
            raise BadRequest(exc.status, str(exc), payload) from None

    # -- decisions --------------------------------------------------------------------------------

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self.state.rng.random() < rate

    def _output_tokens(self, shape_class: Any) -> tuple[int, bool]:
        if shape_class is not None and not shape_class.streams:
            return 0, False  # counting a prompt generates nothing
        raw = self.req.fields.get("x-mock-tokens")
        try:
            wanted = int(raw) if raw is not None else self.state.settings.tokens
        except ValueError:
            raise BadRequest(400, "x-mock-tokens must be an integer") from None
        wanted = max(0, wanted)
        if shape_class is not None:
            limit = shape_class.output_limit(self.body)
        else:
            limit = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit < wanted:
            return limit, True
        return wanted, False

    def _prompt_tokens(self, shape_class: Any) -> int:
        if shape_class is not None:
            return shape_class.prompt_tokens(self.body)
        if self.endpoint == "chat":
            return max(1, estimate_tokens(self.body.get("messages", [])))
        if self.endpoint == "embeddings":
            return max(1, estimate_tokens(self.body.get("input", "")))
        return max(1, estimate_tokens(self.body.get("prompt", "")))

    def _fault_headers_apply(self) -> bool:
        targets = self.req.fields.get("x-mock-fault-for")
        return targets is None or self.state.settings.name in (t.strip() for t in targets.split(","))

    def _injected_status(self) -> int:
        settings = self.state.settings
        raw = self.fault_fields.get("x-mock-status")
        if raw is not None:
            try:
                status = int(raw)
            except ValueError:
                raise BadRequest(400, "x-mock-status must be an integer") from None
            if not 100 <= status <= 599:
                raise BadRequest(400, "x-mock-status out of range")
        elif settings.fail_next > 0:
            settings.fail_next -= 1
            status = settings.fail_status
        elif self._roll(settings.fail_rate):
            status = settings.fail_status
        else:
            return 200
        if status != 200:
            self.state.faults["status"] += 1
        return status

    def _injected_reset(self) -> str | None:
        raw = self.fault_fields.get("x-mock-reset", "").lower()
        if raw not in ("", "before", "mid", "mid-close"):
            raise BadRequest(400, "x-mock-reset must be before, mid or mid-close")
        settings = self.state.settings
        if not raw and self._roll(settings.reset_rate):
            raw = "before"
        elif not raw and self._roll(settings.mid_reset_rate):
            raw = "mid"
        if raw:
            self.state.faults["reset_" + raw.replace("-", "_")] += 1
        return raw or None

    # -- steps ------------------------------------------------------------------------------------

    def held_tokens(self) -> int:
        return self.prompt_tokens + self.tokens

    def steps(self) -> Iterator[Step]:
        first_delay = self.timing.latency + self.timing.stall
        if self.reset == "before":
            yield first_delay, ABORT
        elif self.status != 200:
            yield first_delay, self._error_bytes()
        elif self.stream and self.shape is not None:
            yield from self._event_stream_steps(first_delay)
        elif self.stream and self.endpoint != "embeddings":
            yield from self._stream_steps(first_delay)
        else:
            yield from self._json_steps(first_delay)

    def _error_bytes(self) -> bytes:
        message = f"injected failure by {self.state.settings.name}"
        code = self.state.settings.fail_code or f"injected_{self.status}"
        if self.shape is not None:
            payload = self.shape.error_payload(self.status, message, "mock_injected_error", code)
        else:
            payload = error_payload(message, "mock_injected_error", code)
        extra = [("retry-after", self.retry_after)] if self.retry_after else None
        payload = conformance.error_body(payload, self.state.nonconformance)
        return json_response(self.state, self.status, payload, self.req.keep_alive, extra)

    def _usage(self) -> dict[str, Any]:
        completion = 0 if self.endpoint == "embeddings" else self.tokens
        usage: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                                 "total_tokens": self.prompt_tokens + completion}
        fields = self.req.fields
        if "x-mock-cached-tokens" in fields or "x-mock-reasoning-tokens" in fields:
            try:
                cached = int(fields.get("x-mock-cached-tokens", "0"))
                reasoning = int(fields.get("x-mock-reasoning-tokens", "0"))
            except ValueError:
                cached = reasoning = 0
            usage["prompt_tokens_details"] = {"cached_tokens": min(max(0, cached), self.prompt_tokens)}
            usage["completion_tokens_details"] = {"reasoning_tokens": min(max(0, reasoning), completion)}
        elif self.prefix_cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.prefix_cached}
        return usage

    def _json_payload(self) -> dict[str, Any]:
        state = self.state
        created = int(time.time())
        finish = "length" if self.truncated else "stop"
        if self.endpoint == "embeddings":
            inputs = self.body.get("input", "")
            count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else 1
            dim = state.settings.embedding_dim
            data = [{"object": "embedding", "index": i,
                     "embedding": [round(((i + 1) * (j + 1) % 17) / 17.0, 6) for j in range(dim)]}
                    for i in range(count)]
            return {"object": "list", "data": data, "model": self.model,
                    "usage": {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}}
        text = "".join(token_pieces(state, self.tokens))
        if self.endpoint == "chat" and conformance.wants_json(self.body):
            text = _json_encode({"text": text}).decode()
        if self.shape is not None:
            payload = self.shape.json_payload(text)
        elif self.endpoint == "chat":
            payload: dict[str, Any] = {
                "id": f"chatcmpl-mock-{state.next_id()}", "object": "chat.completion", "created": created,
                "model": self.model, "system_fingerprint": "fp_mock",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish}],
                "usage": self._usage(),
            }
            if self.tool is not None:
                payload["choices"][0].update(message=conformance.tool_call_message(self.tool, state.next_id()),
                                             finish_reason="tool_calls")
        else:
            payload = {
                "id": f"cmpl-mock-{state.next_id()}", "object": "text_completion", "created": created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": self._usage(),
            }
        if "x-mock-echo" in self.req.fields and self.endpoint != "count_tokens":
            payload["mock_echo"] = echo_payload(self.req, include_body=False)
        return payload

    def _json_steps(self, first_delay: float) -> Iterator[Step]:
        timing = self.timing
        generation = 0.0 if self.endpoint in ("embeddings", "count_tokens") else \
            timing.ttft + self.tokens * timing.per_token
        response = json_response(self.state, 200, self._json_payload(), self.req.keep_alive)
        if self.cut_mid or timing.stall_mid > 0:
            # Headers first, then half of the body after the mid stall; a mid reset ends there.
            split = response.index(b"\r\n\r\n") + 4
            split += (len(response) - split) // 2
            yield first_delay + generation, response[:split]
            if self.cut_mid:
                yield timing.stall_mid, self.cut
                return
            yield timing.stall_mid, response[split:]
        else:
            yield first_delay + generation, response

    def _chunk_payload(self, delta_or_text: Any, finish: str | None, response_id: str, created: int) -> Any:
        if self.endpoint == "chat":
            choice = {"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        chunk: dict[str, Any] = {"id": response_id, "object": obj, "created": created, "model": self.model,
                                 "system_fingerprint": "fp_mock", "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI does: null on every chunk but the last
        return chunk

    def _stream_steps(self, first_delay: float) -> Iterator[Step]:
        state, timing, chat = self.state, self.timing, self.endpoint == "chat"
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-mock-{state.next_id()}"
        created = int(time.time())
        head = head_bytes(state, 200, [("content-type", "text/event-stream"), ("cache-control", "no-cache"),
                                       ("transfer-encoding", "chunked")], self.req.keep_alive)
        opening = b""
        if chat:
            opening = sse_chunk(self._chunk_payload({"role": "assistant", "content": ""}, None, response_id, created))
        yield first_delay, head + opening
        middle = self.tokens // 2
        for index, piece in enumerate(token_pieces(state, self.tokens)):
            if index == middle and (self.cut_mid or timing.stall_mid > 0):
                if self.cut_mid:
                    yield timing.stall_mid, self.cut
                    return
                yield timing.stall_mid, b""
            delay = timing.ttft if index == 0 else timing.per_token
            content = {"content": piece} if chat else piece
            event = self._chunk_payload(content, None, response_id, created)
            if index == 0 and self.stamp:
                event["mock_sent_ns"] = STAMP_SLOT.decode()
                yield delay, StampedEvent(sse_chunk(event))
                continue
            yield delay, sse_chunk(event)
        if self.cut_mid and self.tokens == 0:
            yield timing.stall_mid, self.cut
            return
        finish = "length" if self.truncated else "stop"
        tail = [sse_chunk(self._chunk_payload({} if chat else "", finish, response_id, created))]
        if self.include_usage:
            usage_chunk = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": self.model, "system_fingerprint": "fp_mock",
                           "choices": [], "usage": self._usage()}
            tail.append(sse_chunk(usage_chunk))
        tail += [CHUNKED_END] if "no_done" in state.nonconformance else [SSE_DONE, CHUNKED_END]
        yield (timing.ttft if self.tokens == 0 else 0.0), b"".join(tail)


    def _event_stream_steps(self, first_delay: float) -> Iterator[Step]:
        """A Responses or Messages stream: named events, usage where that API puts it, no [DONE]."""
        state, timing, shape = self.state, self.timing, self.shape
        assert shape is not None
        head = head_bytes(state, 200, [("content-type", "text/event-stream; charset=utf-8"),
                                       ("cache-control", "no-cache"), ("transfer-encoding", "chunked")],
                          self.req.keep_alive)
        yield first_delay, head + shape.stream_opening()
        pieces = token_pieces(state, self.tokens)
        middle = self.tokens // 2
        for index, piece in enumerate(pieces):
            if index == middle and self.stream_error:
                yield timing.per_token, shape.stream_error() + CHUNKED_END
                return
            if index == middle and (self.cut_mid or timing.stall_mid > 0):
                if self.cut_mid:
                    yield timing.stall_mid, self.cut
                    return
                yield timing.stall_mid, b""
            yield (timing.ttft if index == 0 else timing.per_token), shape.stream_token(piece)
        if self.cut_mid and self.tokens == 0:
            yield timing.stall_mid, self.cut
            return
        yield (timing.ttft if self.tokens == 0 else 0.0), shape.stream_closing("".join(pieces)) + CHUNKED_END


def retry_after_value(spec: str | None, status: int) -> str | None:
    """The Retry-After header value for an injected error, or None for no header.

    `spec` is None (the default: 1 second on 429 and 503), `none`, delta seconds or an HTTP date sent
    as given, or `date+N`: an HTTP date N seconds from now (a fixed date would go stale in a test).
    """
    if spec is None:
        return "1" if status in (429, 503) else None
    spec = spec.strip()
    if spec.lower() == "none" or not spec:
        return None
    if spec.lower().startswith("date+"):
        try:
            offset = float(spec[5:])
        except ValueError:
            raise BadRequest(400, "retry-after date+N needs a number of seconds") from None
        return email.utils.formatdate(time.time() + offset, usegmt=True)
    return spec


def echo_payload(req: Request, include_body: bool = True) -> dict[str, Any]:
    payload: dict[str, Any] = {"method": req.method, "path": req.path, "target": req.target,
                               "version": req.version, "headers": [[n, v] for n, v in req.headers]}
    if include_body:
        payload["body"] = req.body.decode("utf-8", "replace")
    return payload


# --------------------------------------------------------------------------------------------------
# Non-inference pages


def metrics_text(state: MockState) -> bytes:
    name = state.settings.name.replace("\\", "\\\\").replace('"', '\\"')
    label = f'provider="{name}"'
    depth, kv = state.queue_depth(), state.kv_utilization()
    lines = [
        "# HELP mock_requests_in_flight Requests being served right now (the queue depth).",
        "# TYPE mock_requests_in_flight gauge",
        f"mock_requests_in_flight{{{label}}} {state.in_flight}",
        "# HELP mock_queue_depth Queue depth: in-flight requests unless overridden by /admin/config.",
        "# TYPE mock_queue_depth gauge",
        f"mock_queue_depth{{{label}}} {depth}",
        "# HELP mock_kv_cache_utilization Simulated KV-cache utilisation (0..1).",
        "# TYPE mock_kv_cache_utilization gauge",
        f"mock_kv_cache_utilization{{{label}}} {kv:.6f}",
        "# HELP mock_requests_served_total Requests answered, by endpoint.",
        "# TYPE mock_requests_served_total counter",
    ]
    lines += [f'mock_requests_served_total{{{label},endpoint="{ep}"}} {n}' for ep, n in sorted(state.served.items())]
    lines += ["# HELP mock_faults_injected_total Injected failures, by kind.",
              "# TYPE mock_faults_injected_total counter"]
    lines += [f'mock_faults_injected_total{{{label},kind="{k}"}} {n}' for k, n in sorted(state.faults.items())]
    cache = state.prefix_cache
    lines += ["# HELP mock_prefix_cache_total Prompt-cache lookups (--prefix-cache), by result.",
              "# TYPE mock_prefix_cache_total counter",
              f'mock_prefix_cache_total{{{label},result="hit"}} {cache.hits}',
              f'mock_prefix_cache_total{{{label},result="miss"}} {cache.misses}']
    # vLLM-style names, so scrapers written for real inference servers work unchanged.
    lines += [
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{label}}} {state.in_flight}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {max(0, depth - state.in_flight)}",
        "# TYPE vllm:gpu_cache_usage_perc gauge", f"vllm:gpu_cache_usage_perc{{{label}}} {kv:.6f}",
    ]
    return ("\n".join(lines) + "\n").encode()


ADMIN_FIELDS = {"latency_ms": float, "ttft_ms": float, "tokens_per_s": float, "tokens": int,
                "fail_rate": float, "fail_status": int, "fail_next": int, "retry_after": str,
                "reset_rate": float, "mid_reset_rate": float,
                "stall_rate": float, "stall_ms": float, "kv_capacity_tokens": int,
                "kv_cache_utilization": float, "queue_depth": int, "name": str,
                "api_key": str, "context_window": int, "nonconformance": str, "prefix_cache": int,
                "prefix_hit_factor": float, "prefix_cache_ttl_ms": float}
NULLABLE_FIELDS = {"kv_cache_utilization", "queue_depth", "retry_after", "api_key"}


def apply_admin_config(state: MockState, body: bytes) -> dict[str, Any]:
    """Apply a JSON object of settings; unknown keys and wrong types are a 400."""
    try:
        changes = _json_decode(body) if body else {}
    except msgspec.DecodeError:
        raise BadRequest(400, "body is not valid JSON") from None
    if not isinstance(changes, dict):
        raise BadRequest(400, "body must be a JSON object")
    for key, value in changes.items():
        kind = ADMIN_FIELDS.get(key)
        if kind is None:
            raise BadRequest(400, f"unknown setting {key!r}")
        if value is None and key in NULLABLE_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise BadRequest(400, f"setting {key!r} must be {kind.__name__}")
        if key == "nonconformance":
            try:
                conformance.parse_faults(value)
            except ValueError as exc:
                raise BadRequest(400, str(exc)) from None
    for key, value in changes.items():
        setattr(state.settings, key, kind_cast(ADMIN_FIELDS[key], value))
    state.refresh()
    return settings_view(state)


def kind_cast(kind: type, value: Any) -> Any:
    return None if value is None else kind(value)


def settings_view(state: MockState) -> dict[str, Any]:
    view = {key: getattr(state.settings, key) for key in ADMIN_FIELDS}
    view["health_status"] = state.health.status
    view["models"] = state.settings.models
    return view


# --------------------------------------------------------------------------------------------------
# The protocol


INFERENCE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings",
                   "/v1/responses": "responses", "/v1/messages": "messages",
                   "/v1/messages/count_tokens": "count_tokens"}


class MockHTTPProtocol(asyncio.Protocol):
    """One client connection: parse requests in order, answer each before starting the next."""

    def __init__(self, state: MockState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False  # a timed response is running; parsing resumes when it ends
        self.closing = False
        self.task: asyncio.Task[None] | None = None
        self.reading_paused = False
        self.write_ready: asyncio.Future[None] | None = None
        self.sent_continue = False
        self.pending_step: Step = (0.0, b"")  # the first delayed step, handed to run_timed

    # -- asyncio callbacks --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.task is not None:
            self.task.cancel()
        if self.write_ready is not None and not self.write_ready.done():
            self.write_ready.set_result(None)

    def pause_writing(self) -> None:
        if self.write_ready is None or self.write_ready.done():
            self.write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.write_ready is not None and not self.write_ready.done():
            self.write_ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.busy:
            if len(self.buf) > READ_PAUSE_BYTES and not self.reading_paused and self.transport is not None:
                self.transport.pause_reading()
                self.reading_paused = True
            return
        self.serve_buffered()

    # -- request loop ---------------------------------------------------------------------------------

    def serve_buffered(self) -> None:
        """Answer every complete request in the buffer, stopping at the first timed response."""
        while not self.busy and not self.closing:
            try:
                req = self.next_request()
            except BadRequest as exc:
                self.fail_connection(exc.status, str(exc))
                return
            if req is None:
                break
            self.dispatch(req)
        if self.reading_paused and not self.busy and self.transport is not None and not self.closing:
            self.transport.resume_reading()
            self.reading_paused = False

    def next_request(self) -> Request | None:
        buf = self.buf
        # Tolerate blank lines before a request (RFC 9112 2.2), e.g. between pipelined ones.
        while buf[:2] == b"\r\n":
            del buf[:2]
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                raise BadRequest(431, "request header block too large")
            return None
        req = parse_head(bytes(buf[:head_end]))
        body_start = head_end + 4
        if "chunked" in req.fields.get("transfer-encoding", "").lower():
            parsed = parse_chunked(buf, body_start)
            if parsed is None:
                self.maybe_continue(req)
                return None
            req.body, end = parsed
        else:
            length_text = req.fields.get("content-length", "0")
            if not length_text.isdigit():
                raise BadRequest(400, "bad content-length")
            length = int(length_text)
            if length > MAX_BODY_BYTES:
                raise BadRequest(413, "request body too large")
            end = body_start + length
            if len(buf) < end:
                self.maybe_continue(req)
                return None
            req.body = bytes(buf[body_start:end])
        del buf[:end]
        self.sent_continue = False
        return req

    def maybe_continue(self, req: Request) -> None:
        if req.fields.get("expect", "").lower() == "100-continue" and not self.sent_continue:
            self.sent_continue = True
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closing and data:
            self.transport.write(data)

    def finish(self, keep_alive: bool) -> None:
        if not keep_alive and self.transport is not None and not self.closing:
            self.closing = True
            self.transport.close()

    def fail_connection(self, status: int, message: str) -> None:
        self.write(json_response(self.state, status, error_payload(message, "invalid_request_error", "bad_request"),
                                 keep_alive=False))
        self.finish(keep_alive=False)

    def dispatch(self, req: Request) -> None:
        state = self.state
        endpoint = INFERENCE_PATHS.get(req.path)
        if endpoint is None or req.method != "POST":
            state.count_served(endpoint or self.page_label(req.path))
            try:
                response = self.page(req)
            except BadRequest as exc:
                response = json_response(state, exc.status, error_payload(str(exc), "invalid_request_error",
                                                                          "bad_request"), req.keep_alive)
            self.write(response)
            self.finish(req.keep_alive)
            return
        state.count_served(endpoint)
        state.received.append(req)
        try:
            completion = Completion(state, req, endpoint)
        except BadRequest as exc:
            payload = conformance.error_body(refusal_payload(endpoint, exc), state.nonconformance)
            self.write(json_response(state, exc.status, payload, req.keep_alive))
            self.finish(req.keep_alive)
            return
        steps = completion.steps()
        held = completion.held_tokens()
        state.in_flight += 1
        state.held_tokens += held
        if not self.run_instant(steps, req.keep_alive):
            self.busy = True
            self.task = asyncio.get_running_loop().create_task(self.run_timed(steps, req.keep_alive, held))
            return
        state.in_flight -= 1
        state.held_tokens -= held

    def run_instant(self, steps: Iterator[Step], keep_alive: bool) -> bool:
        """Write the steps that need no waiting; False when a delay remains (steps stays positioned).

        Consecutive byte steps go out in one write: one send() per response instead of one per SSE event.
        """
        pending: list[bytes] = []
        for delay, action in steps:
            if delay > 0:
                self.write(b"".join(pending))
                self.pending_step = (delay, action)
                return False
            if action in CUTS:
                self.write(b"".join(pending))
                self.do_step(action, keep_alive)
                return True
            pending.append(stamped(action))  # type: ignore[arg-type]
        self.write(b"".join(pending))
        self.finish(keep_alive)
        return True

    async def run_timed(self, steps: Iterator[Step], keep_alive: bool, held: int) -> None:
        try:
            delay, action = self.pending_step
            await asyncio.sleep(delay)
            if self.do_step(action, keep_alive):
                for delay, action in steps:
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if self.write_ready is not None:
                        await self.write_ready
                    if self.closing or not self.do_step(action, keep_alive):
                        break
                else:
                    self.finish(keep_alive)
        finally:
            self.state.in_flight -= 1
            self.state.held_tokens -= held
            self.task = None
            self.busy = False
        if not self.closing:
            self.serve_buffered()

    def do_step(self, action: bytes | str, keep_alive: bool) -> bool:
        """Perform one step; False when the connection is gone afterwards."""
        if action in CUTS:
            self.closing = True
            if self.transport is not None:
                # abort() sends RST but drops unsent bytes; a mid-body reset must deliver the first half.
                if action == CLOSE or self.transport.get_write_buffer_size():
                    self.transport.close()
                else:
                    self.transport.abort()
            return False
        self.write(stamped(action))  # type: ignore[arg-type]
        return not self.closing

    # -- pages --------------------------------------------------------------------------------------

    @staticmethod
    def page_label(path: str) -> str:
        if path.startswith("/v1/"):
            return "models" if path == "/v1/models" else "other"
        for prefix in ("health", "metrics", "debug", "admin"):
            if path.startswith("/" + prefix):
                return prefix
        return "other"

    def page(self, req: Request) -> bytes:
        state, path, method, keep = self.state, req.path, req.method, req.keep_alive
        if path == "/health" and method == "GET":
            status = state.health.status
            return json_response(state, status, {"status": "ok" if status < 400 else "failing",
                                                 "provider": state.settings.name}, keep)
        if path == "/metrics" and method == "GET":
            body = metrics_text(state)
            return head_bytes(state, 200, [("content-type", "text/plain; version=0.0.4; charset=utf-8"),
                                           ("content-length", str(len(body)))], keep) + body
        if path == "/v1/models" and method == "GET":
            try:
                conformance.check_credential(req.fields, state.settings.api_key)
            except conformance.Refusal as exc:
                return json_response(state, 401, conformance.error_body(exc.payload, state.nonconformance), keep)
            data = [{"id": m, "object": "model", "created": 0, "owned_by": state.settings.name}
                    for m in state.settings.models]
            return json_response(state, 200, {"object": "list", "data": data}, keep)
        if path == "/debug/echo" and method in ("GET", "POST"):
            return json_response(state, 200, echo_payload(req), keep)
        if path == "/admin/health" and method == "POST":
            return json_response(state, 200, self.set_health(req.body), keep)
        if path == "/admin/config" and method == "POST":
            return json_response(state, 200, apply_admin_config(state, req.body), keep)
        if path == "/admin/config" and method == "GET":
            return json_response(state, 200, settings_view(state), keep)
        if path == "/admin/received" and method == "GET":
            return json_response(state, 200, {"requests": [echo_payload(r) for r in state.received]}, keep)
        if path in INFERENCE_PATHS or path in ("/health", "/metrics", "/v1/models", "/debug/echo"):
            return json_response(state, 405, error_payload("method not allowed", "invalid_request_error",
                                                           "method_not_allowed"), keep)
        return json_response(state, 404, error_payload(f"no route for {path}", "invalid_request_error",
                                                       "not_found"), keep)

    def set_health(self, body: bytes) -> dict[str, Any]:
        try:
            payload = _json_decode(body) if body else {}
        except msgspec.DecodeError:
            raise BadRequest(400, "body is not valid JSON") from None
        status = payload.get("status") if isinstance(payload, dict) else None
        if not isinstance(status, int) or isinstance(status, bool) or not 200 <= status <= 599:
            raise BadRequest(400, "expected {\"status\": <200..599>}")
        self.state.health.status = status
        return {"status": status}


# --------------------------------------------------------------------------------------------------
# Process entry points


def bound_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def claim_port(host: str, port: int, processes: int) -> socket.socket:
    """Bind the port, failing if anyone holds it.

    A plain bind comes first because SO_REUSEPORT alone would let a second mock (or a leftover one)
    silently share the port and answer half of the requests. With several processes the port is then
    re-bound with SO_REUSEPORT (still not listening) so the children can join it.
    """
    exclusive = bound_socket(host, port, reuse_port=False)
    if processes == 1:
        return exclusive
    port = exclusive.getsockname()[1]
    exclusive.close()
    return bound_socket(host, port, reuse_port=True)


def server_tls(cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """HTTPS with this certificate (--tls-cert/--tls-key), so TLS, SNI and CA checks meet a real handshake."""
    if cert_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


async def serve(sock: socket.socket, state: MockState, backlog: int, tls: ssl.SSLContext | None = None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockHTTPProtocol(state), sock=sock, backlog=backlog, ssl=tls)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def run_worker(sock: socket.socket, settings: MockSettings, health: SharedHealth, backlog: int,
               seed: int | None, tls: tuple[str | None, str | None] = (None, None)) -> None:
    import uvloop

    state = MockState(settings, health)
    if seed is not None:
        state.rng.seed(seed)
    uvloop.run(serve(sock, state, backlog, server_tls(*tls)))


def _fault_list(text: str) -> str:
    try:
        conformance.parse_faults(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.mock_provider", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001, help="0 picks a free port (printed on stdout)")
    p.add_argument("--name", default="mock", help="sent as x-mock-provider on every response")
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay before the response headers")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    p.add_argument("--tokens-per-s", type=float, default=0.0, help="token pace after the first; 0 = instant")
    p.add_argument("--tokens", type=int, default=16, help="output tokens per completion (capped by max_tokens)")
    p.add_argument("--models", default="mock-model", help="comma-separated ids listed by GET /v1/models")
    p.add_argument("--embedding-dim", type=int, default=8)
    p.add_argument("--fail-rate", type=float, default=0.0, help="share of inference requests answered --fail-status")
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--fail-code", default=None,
                   help="error code of injected failures, e.g. context_length_exceeded (default: injected_<status>)")
    p.add_argument("--retry-after", default=None,
                   help="Retry-After of injected errors: seconds, an HTTP date, date+N or none (default: 1 on 429/503)")
    p.add_argument("--reset-rate", type=float, default=0.0, help="share reset before any response byte")
    p.add_argument("--mid-reset-rate", type=float, default=0.0, help="share reset halfway through the body")
    p.add_argument("--stall-rate", type=float, default=0.0, help="share stalled --stall-ms before the headers")
    p.add_argument("--stall-ms", type=float, default=5000.0)
    p.add_argument("--health-status", type=int, default=200, help="initial GET /health status")
    p.add_argument("--kv-capacity-tokens", type=int, default=65536, help="simulated KV-cache size")
    p.add_argument("--kv-cache-utilization", type=float, default=None, help="fix the KV gauge to this value")
    p.add_argument("--prefix-cache", type=int, default=0,
                   help="keep this many prompt prefixes and report their tokens as cached (0 = no prompt cache)")
    p.add_argument("--prefix-hit-factor", type=float, default=0.3,
                   help="share of the first-token delay a fully cached prompt keeps")
    p.add_argument("--prefix-cache-ttl-ms", type=float, default=0.0, help="a cached prefix expires after this (0 = never)")
    p.add_argument("--cors-origin", default=None, help="send Access-Control-Allow-Origin: <this> on every response")
    p.add_argument("--api-key", default=None, help="answer 401 unless the request carries this key")
    p.add_argument("--context-window", type=int, default=0,
                   help="refuse (400 context_length_exceeded) prompt + max_tokens beyond this; 0 = no window")
    p.add_argument("--nonconformance", default="", type=_fault_list,
                   help=f"break promises on purpose, comma-separated: {', '.join(conformance.FAULTS)}")
    p.add_argument("--processes", type=int, default=1, help="SO_REUSEPORT processes")
    p.add_argument("--backlog", type=int, default=4096)
    p.add_argument("--seed", type=int, default=None, help="seed for the failure-rate dice")
    p.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (PEM; with --tls-key)")
    p.add_argument("--tls-key", default=None, help="the --tls-cert certificate's private key (PEM)")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> MockSettings:
    return MockSettings(
        name=args.name, latency_ms=args.latency_ms, ttft_ms=args.ttft_ms, tokens_per_s=args.tokens_per_s,
        tokens=args.tokens, models=[m for m in args.models.split(",") if m] or ["mock-model"],
        embedding_dim=args.embedding_dim, fail_rate=args.fail_rate, fail_status=args.fail_status,
        fail_code=args.fail_code,
        retry_after=args.retry_after,
        reset_rate=args.reset_rate, mid_reset_rate=args.mid_reset_rate, stall_rate=args.stall_rate,
        stall_ms=args.stall_ms, kv_capacity_tokens=args.kv_capacity_tokens,
        kv_cache_utilization=args.kv_cache_utilization, cors_origin=args.cors_origin,
        prefix_cache=args.prefix_cache, prefix_hit_factor=args.prefix_hit_factor,
        prefix_cache_ttl_ms=args.prefix_cache_ttl_ms,
        api_key=args.api_key, context_window=args.context_window, nonconformance=args.nonconformance,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from_args(args)
    health = SharedHealth(args.health_status)
    # Bind here to learn the port (for --port 0). One process serves on this socket; with more,
    # each child binds its own SO_REUSEPORT socket to the same port so the kernel spreads connections.
    processes = max(1, args.processes)
    try:
        probe = claim_port(args.host, args.port, processes)
    except OSError as exc:
        print(f"mock-provider: cannot bind {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    port = probe.getsockname()[1]
    print(f"mock-provider {settings.name} listening on {args.host}:{port} ({processes} processes)", flush=True)
    if processes == 1:
        run_worker(probe, settings, health, args.backlog, args.seed, (args.tls_cert, args.tls_key))
        return 0
    children: list[int] = []
    for index in range(processes):
        pid = os.fork()
        if pid == 0:
            exit_code = 1
            try:
                probe.close()
                seed = None if args.seed is None else args.seed + index
                run_worker(bound_socket(args.host, port, reuse_port=True), settings, health, args.backlog, seed,
                           (args.tls_cert, args.tls_key))
                exit_code = 0
            finally:
                os._exit(exit_code)
        children.append(pid)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


# --------------------------------------------------------------------------------------------------
# In-process API for tests and benchmarks


def terminate(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


class MockProviderHandle:
    """A mock provider running as a subprocess; `stop()` (or leaving the `with` block) ends it."""

    def __init__(self, process: subprocess.Popen[bytes], host: str, port: int, name: str) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.name = name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 5.0) -> None:
        terminate(self.process, timeout)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> MockProviderHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _option_args(opts: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in opts.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def child_setup(cpus: set[int] | None) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when its parent dies, and is pinned to `cpus` if given.

    libc is resolved here, in the parent: importing in a forked child of a threaded parent can deadlock.
    """
    import ctypes

    prctl = ctypes.CDLL(None).prctl
    pr_set_pdeathsig = 1

    def setup() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def _http_status(host: str, port: int, path: str, timeout: float, tls: bool = False) -> int | None:
    """The status of one GET (over unverified TLS with ``tls``), or None when nothing answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            sock = raw
            if tls:
                context = ssl.create_default_context()
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                sock = context.wrap_socket(raw)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            head = sock.recv(64)
    except OSError:
        return None
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


def start_mock_provider_process(port: int = 0, name: str = "mock", *, host: str = "127.0.0.1",
                                startup_timeout: float = 10.0, cpus: set[int] | None = None,
                                new_session: bool = False, **opts: Any) -> MockProviderHandle:
    """Spawn `python -m loadtest.mock_provider` and return once it answers HTTP on /health.

    `opts` are the CLI flags with underscores (latency_ms=5, tokens_per_s=50, processes=2, ...).
    `port=0` lets the OS pick a free port; the handle knows the real one. `cpus` pins the process
    (and its SO_REUSEPORT children) to those cores. `new_session` keeps a terminal's Ctrl-C away from
    it, so the owner decides when it stops.
    """
    cmd = [sys.executable, "-m", "loadtest.mock_provider", "--host", host, "--port", str(port), "--name", name]
    cmd += _option_args(opts)
    project_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=project_root, start_new_session=new_session,
                               preexec_fn=child_setup(cpus))
    assert process.stdout is not None
    deadline = time.monotonic() + startup_timeout
    # The first line is "... listening on host:port (...)"; EOF means it failed to start.
    if not select.select([process.stdout], [], [], startup_timeout)[0]:
        process.kill()
        process.wait()
        raise RuntimeError(f"mock provider {name} printed nothing within {startup_timeout}s")
    line = process.stdout.readline().decode()
    if not line:
        process.wait(5)
        raise RuntimeError(f"mock provider {name} exited with {process.returncode} before listening")
    real_port = int(line.rsplit(":", 1)[1].split()[0])
    handle = MockProviderHandle(process, host, real_port, name)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mock provider {name} exited with {process.returncode}")
        # Any status counts: /health may start failing on purpose (--health-status 503).
        if _http_status(host, real_port, "/health", timeout=0.5, tls="tls_cert" in opts) is not None:
            return handle
        time.sleep(0.02)
    handle.stop()
    raise RuntimeError(f"mock provider {name} did not answer /health within {startup_timeout}s")


if __name__ == "__main__":
    sys.exit(main())
