"""The sink of one upstream attempt: relays the provider's response to the client as it arrives, and
says what the attempt came to (``result``: an ``AttemptResult``).

The upstream connection calls ``upstream_head``/``_data``/``_flush``/``_end``/``_failed``; the client
connection calls ``client_lost`` and the flow-control pair (it is the exchange's listener). ``done``
resolves once, with the attempt's result, when the attempt is over: failed before the head (the proxy
may try again), ended, failed mid-response, or abandoned.

The response's end goes through the exchange (``end`` or ``abort``), which closes the request's record
(workers/request_record.py) before the last bytes leave: so everything ``result`` reports (status,
failure, usage, events, timings) is set before the relay ends the exchange.

With ``hold_retryable`` set (another provider may still be tried), a 429/502/503/504 head is *held*:
nothing reaches the client, the result says so (``held``, ``retry_after``), ``done`` resolves at once,
and the rest of that response is read and discarded so the connection can be reused.
"""

from __future__ import annotations

import asyncio
import re
import time

from gateway.http.errors import sse_error_event_in
from gateway.http.media import is_event_stream
from gateway.models.fallbacks import MAX_REFUSAL_BYTES, refusal_code
from gateway.request.attempts import AttemptResult
from gateway.request.failures import Failure
from gateway.request.first_token import OVERLAP, first_token_pattern
from gateway.request.headers import connection_tokens
from gateway.request.surfaces import MESSAGES_USAGE, OPENAI_USAGE, RESPONSES_USAGE
from gateway.request.usage import SseUsageFilter, UsageObserver, UsageScanner
from gateway.request.usage_surfaces import AnswerUsage, observer_for
from gateway.routing.cooling import cooling_signals
from gateway.routing.failover import RETRYABLE_STATUSES
from workers.exchange import Exchange
from workers.upstream import UpstreamConnection

_monotonic = time.monotonic

# Response headers never relayed: hop-by-hop ones, framing (re-done by the codec), and the provider's
# request id (the gateway's own is sent).
_RESPONSE_DROP = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer", b"upgrade",
     b"x-request-id", b"content-length")
)
# With CORS on (docs/cors.md), CORS is the gateway's to answer: the provider's own are never relayed.
_RESPONSE_DROP_CORS = _RESPONSE_DROP | frozenset(
    (b"access-control-allow-origin", b"access-control-allow-credentials", b"access-control-allow-methods",
     b"access-control-allow-headers", b"access-control-expose-headers", b"access-control-max-age",
     b"access-control-allow-private-network")
)
# A metered response's token headers are the gateway's, not the provider's.
_QUOTA_HEADERS = frozenset(
    (b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens")
)
# A data event's field name. Counted after a line feed: inside an event's JSON a line feed is escaped,
# so the bytes ``\ndata:`` only ever start a field (plus one for a chunk that starts with an event).
_DATA_FIELD = b"\ndata:"
_DATA_START = b"data:"


class ResponseRelay:
    __slots__ = (
        "exchange", "conn", "done", "failure", "detail", "client_left", "status", "extra_headers",
        "response_started", "is_sse", "metering", "usage", "length_framed", "hold_retryable", "held_status",
        "retry_after", "provider_wide", "sent_at", "first_byte_at", "ended_at", "events", "answer_usage", "_result",
        "hold_refusals", "held_head", "held_body", "refusal", "token_watch", "token_tail", "first_token_at",
    )

    def __init__(
        self, exchange: Exchange, conn: UpstreamConnection, extra_headers: list[tuple[bytes, bytes]],
        metering: bool | None, hold_retryable: bool = False, hold_refusals: frozenset[str] | None = None,
    ) -> None:
        self.exchange = exchange
        self.conn = conn
        # The connection's loop: asyncio.get_running_loop() costs a getpid system call per request.
        self.done: asyncio.Future[AttemptResult] = conn.pool.loop.create_future()
        self.failure: Failure | None = None
        self.detail = ""
        self.client_left = False
        self.status = 0
        self.extra_headers = extra_headers
        self.response_started = False
        self.is_sse = False
        # None: not metered; False/True: metered, and whether the request was rewritten to ask for usage.
        self.metering = metering
        self.usage: UsageObserver | None = None
        self.length_framed = False  # the client was promised a Content-Length
        self.hold_retryable = hold_retryable
        self.held_status = 0  # a retryable status held back from the client (0: none)
        self.retry_after: bytes | None = None  # the provider's Retry-After, when it sent one
        self.provider_wide = False  # a retryable answer said the whole provider is limited
        self.sent_at = 0.0  # monotonic time the request was written (set by the sender)
        self.first_byte_at = 0.0  # monotonic time the response head arrived
        self.ended_at = 0.0  # monotonic time the attempt was over
        # Data events relayed: counted for a metered event stream only (a hang-up's floor), else None.
        self.events: int | None = None
        # The Responses or Messages API's usage observer (None on the chat path): it also sees error events.
        self.answer_usage: AnswerUsage | None = None
        self._result: AttemptResult | None = None
        # A fallback chain that moves on a provider's refusal (docs/models.md): a 400 is held and its body
        # read (bounded) for its error code; one of these codes ends the attempt as held (``refusal``),
        # any other 400 is relayed as it came.
        self.hold_refusals = hold_refusals
        self.held_head: list[tuple[bytes, bytes]] | None = None
        self.held_body: bytearray | None = None
        self.refusal: str | None = None
        # Prefix affinity's first token (gateway/request/first_token.py): a placed stream's content-event
        # pattern until the first such event arrived (then None), the last bytes scanned, and its time.
        self.token_watch: re.Pattern[bytes] | None = None
        self.token_tail = b""
        self.first_token_at = 0.0

    def result(self) -> AttemptResult:
        """What the attempt came to, built once: when it is over, or when its response ends the exchange
        (whichever asks first; the relay has set every field by then)."""
        result = self._result
        if result is None:
            ended = self.ended_at = self.ended_at or _monotonic()
            sent = self.sent_at
            answer_usage = self.answer_usage
            first_byte_s = self.first_byte_at - sent if self.first_byte_at else 0.0
            result = self._result = AttemptResult(
                self.status, self.response_started, self.held_status != 0, self.failure, self.detail,
                self.client_left, self.retry_after, self.usage, self.events,
                first_byte_s, ended - sent, self.provider_wide,
                None if answer_usage is None else answer_usage.stream_error, self.refusal,
                self.first_token_at - sent if self.first_token_at else first_byte_s,
            )
        return result

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(self.result())

    # -- from the upstream connection -----------------------------------------------------------
    def upstream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.first_byte_at = _monotonic()
        if (status in RETRYABLE_STATUSES or status == 400) and self._held(status, headers):
            return
        out = []
        metered = self.metering is not None
        admitted = self.exchange.admitted
        drop = _RESPONSE_DROP if admitted is None or admitted.cors is None else _RESPONSE_DROP_CORS
        chunked, content_type = False, None
        content_length: int | None = None
        listed: set[bytes] | None = None
        for name, value in headers:
            if name in drop:
                if name == b"content-length":
                    content_length = int(value)  # the codec accepted it, so it is digits
                elif name == b"transfer-encoding":
                    chunked = True
                elif name == b"connection":
                    listed = connection_tokens(value)
                continue
            if name == b"content-type":
                content_type = value
            elif metered and name in _QUOTA_HEADERS:
                continue
            out.append((name, value))
        self.is_sse = is_event_stream(content_type)
        usage_kind = OPENAI_USAGE if admitted is None else admitted.route.surface.usage
        if usage_kind == OPENAI_USAGE:
            if metered or self.exchange.record.prefix is not None:  # prefix affinity reads cached_tokens
                # ``usage_observer`` inlined: the SSE filter for a stream rewritten to report usage, else the scanner.
                self.usage = SseUsageFilter() if self.metering and self.is_sse else UsageScanner()
        elif metered or usage_kind == RESPONSES_USAGE or usage_kind == MESSAGES_USAGE:
            # The Responses and Messages APIs' observer by their surface; not metered, their answers are read
            # all the same (never changed): the access line shows their tokens, an error event is seen.
            self.usage = self.answer_usage = observer_for(  # type: ignore[assignment]
                usage_kind, self.is_sse, bool(self.metering))
        if metered and self.is_sse:
            self.events = 0
        if self.is_sse and self.exchange.record.prefix is not None:  # a placed stream: time its first token
            self.token_watch = first_token_pattern(usage_kind)
        # Re-frame as chunked when the provider did, or when the usage filter may shorten the body.
        if chunked or self.metering is True:
            content_length = None
        if listed:
            out = [(n, v) for n, v in out if n not in listed]
        self.length_framed = content_length is not None
        out += self.extra_headers
        self.response_started = True
        self.exchange.start(status, out, content_length)

    def _held(self, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a 429/502/503/504 or 400 head is held back from the client (the relay then reads its
        body: discarded, or read for a refusal code); a retryable one's cooling signals are read either way."""
        if status == 400:
            if not self.hold_refusals:
                return False
            self.held_status, self.held_head, self.held_body = 400, headers, bytearray()
            self.conn.resume()  # read for its code, whatever the client's pace
            return True
        self.retry_after, self.provider_wide = cooling_signals(headers)
        if not self.hold_retryable:
            return False
        self.held_status = status
        self.conn.resume()  # its body is read and discarded, whatever the client's pace
        self._finish()
        return True

    def upstream_data(self, data: bytes) -> None:
        if self.held_status:
            body = self.held_body
            if body is not None:  # a 400 read for its code; past the bound it is relayed as it came
                body += data
                if len(body) > MAX_REFUSAL_BYTES:
                    self._release()
            return  # the body of a held answer is discarded
        usage = self.usage
        if usage is not None:  # set whenever a stream is watched for its first token (prefix affinity)
            if self.token_watch is not None:
                self._watch_first_token(data)
            data = usage.feed(data)
            if self.events is not None:  # two scans in C, only for a metered event stream
                self.events += data.count(_DATA_FIELD) + data.startswith(_DATA_START)
        self.exchange.write(data)

    def _watch_first_token(self, data: bytes) -> None:
        """A placed stream's chunk: the first content event in it is the first token (its time kept)."""
        scanned = self.token_tail + data
        if self.token_watch.search(scanned) is not None:  # type: ignore[union-attr]
            self.first_token_at = _monotonic()
            self.token_watch, self.token_tail = None, b""
        else:
            self.token_tail = scanned[-OVERLAP:]

    def upstream_flush(self) -> None:
        if not self.held_status:
            self.exchange.flush()

    def upstream_end(self) -> None:
        if self.held_status:
            if self.held_body is None:
                return
            code = refusal_code(bytes(self.held_body), self.hold_refusals)  # type: ignore[arg-type]
            if code is not None:
                self.refusal = code
                self.ended_at = _monotonic()
                self._finish()
                return
            self._release()
        elif self.is_sse:
            # The events relayed so far leave now, before the end's accounting (the record, the access
            # line, spend): a short stream's first token must not wait for its last event's bookkeeping.
            self.exchange.flush()
            if self.token_watch is not None:  # a stream that ended with no content event: its end is the first
                self.first_token_at = _monotonic()
        usage = self.usage
        if usage is not None:
            held = usage.flush()
            if held:
                if self.events is not None:
                    self.events += held.count(_DATA_FIELD) + held.startswith(_DATA_START)
                self.exchange.write(held)
        self.ended_at = _monotonic()
        self.exchange.end()  # closes the request's record, then the last bytes leave
        self._finish()

    def upstream_failed(self, failure: Failure, detail: str) -> None:
        if self.held_status:
            if self.held_body is None:
                return  # the held answer counts; its body was being discarded
            self._release()  # a 400 cut while read for its code: relayed as far as it came, then cut
        self.failure, self.detail = failure, detail
        self.ended_at = _monotonic()
        if self.response_started:
            # After the first byte the attempt cannot be retried: end it visibly, never silently (a client
            # that stopped reading would never read an error event: it is cut).
            exchange = self.exchange
            readable = not exchange.client_gone and failure != Failure.CLIENT_STALLED
            if self.is_sse and not self.length_framed and readable:
                exchange.write(sse_error_event_in(exchange.error_shape, failure.code,
                                                  f"upstream stream failed: {detail}"))
                exchange.end()
            else:
                exchange.abort()
        self._finish()

    def _release(self) -> None:
        """A held 400 is not a refusal the chain moves on: relay it as it came (head, then the body so far)."""
        head, body, first_byte_at = self.held_head, self.held_body, self.first_byte_at
        self.held_status, self.held_head, self.held_body, self.hold_refusals = 0, None, None, None
        self.upstream_head(400, head or [])
        self.first_byte_at = first_byte_at
        if body:
            self.upstream_data(bytes(body))

    # -- from the client connection -------------------------------------------------------------
    def client_lost(self) -> None:
        conn = self.conn
        if conn.sink is self and not self.held_status:
            conn.abandon()
        self.client_left = True
        self._finish()

    # Flow control: only while the connection still serves this call (after its end it may already
    # be back in the pool, serving someone else).
    def pause_writing(self) -> None:
        conn = self.conn
        if conn.sink is self and not self.held_status:  # a held answer's body is discarded, not written
            conn.pause()

    def resume_writing(self) -> None:
        conn = self.conn
        if conn.sink is self:
            conn.resume()
