"""OpenTelemetry traces of one worker's requests (docs/tracing.md): which requests are traced, their
spans, and the context sent to the provider.

``Tracer.begin`` runs once per request when ``tracing`` is configured (the proxy holds None otherwise:
one attribute check per request, nothing else). It reads the client's ``traceparent`` (captured by the
header scan), applies the sampling rule (gateway/tracing/context.py) and, for a traced request, gives the
record a ``RequestTrace``: the request's span (kind SERVER), then one span per attempt sent to a provider
(kind CLIENT, child of the request's span), whose id goes upstream in our ``traceparent``. The client's
``tracestate`` is forwarded as it came. The spans carry the GenAI semantic-convention attributes
(https://github.com/open-telemetry/semantic-conventions-genai) and the route's evidence; finished, they go
to the worker's exporter queue (workers/span_export.py), never to the network from here.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from gateway.config import Config
from gateway.tracing.context import parse_traceparent, span_id_hex, trace_id_hex, traceparent
from gateway.tracing.otlp import SPAN_KIND_CLIENT, SPAN_KIND_SERVER, STATUS_ERROR, AttributeValue, Span
from workers.span_export import SpanExporter

if TYPE_CHECKING:
    from gateway.request.attempts import AttemptResult
    from workers.request_record import RequestRecord

_time_ns = time.time_ns
_perf = time.perf_counter
TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
# Header names the scan must capture when tracing is on (read from ``RequestHeaders.balance_keys``).
TRACE_HEADERS = ("traceparent", "tracestate")
# gen_ai.operation.name per API surface (gateway/request/surfaces.py); others use the surface's name.
OPERATIONS = {"chat_completions": "chat", "messages": "chat", "responses": "chat",
              "completions": "text_completion", "embeddings": "embeddings", "mcp": "execute_tool"}


class Tracer:
    """One per worker: the sampling rule, the id source and the exporter."""

    __slots__ = ("sample", "exporter", "_bits", "_random")

    def __init__(self, sample: float, exporter: SpanExporter, rng: random.Random | None = None) -> None:
        self.sample = sample
        self.exporter = exporter
        rng = rng or random.Random()
        self._bits = rng.getrandbits
        self._random = rng.random

    @classmethod
    def from_config(cls, config: Config) -> Tracer | None:
        """The worker's tracer (its exporter thread starts), or None when ``tracing`` is not configured."""
        settings = config.tracing
        return None if settings is None else cls(settings.sample, SpanExporter(settings))

    def begin(self, record: RequestRecord, headers: dict[bytes, bytes] | None, surface: str,
              t_start: float) -> RequestTrace | None:
        """The request's trace, when it is traced (docs/tracing.md, "Sampling")."""
        parent = None if headers is None else parse_traceparent(headers.get(TRACEPARENT))
        if parent is not None:
            if not parent.sampled:
                return None  # the client decided; its traceparent goes upstream untouched
            trace_id, parent_id = parent.trace_id, parent.span_id
        else:
            sample = self.sample
            if sample < 1.0 and (sample <= 0.0 or self._random() >= sample):
                return None
            trace_id, parent_id = trace_id_hex(self._bits(128) or 1), ""
        state = None if headers is None else headers.get(TRACESTATE)
        start_ns = _time_ns() - int((_perf() - t_start) * 1e9)  # the request's first byte, in epoch time
        span = Span(trace_id, self._span_id(), parent_id, surface, SPAN_KIND_SERVER, start_ns)
        return RequestTrace(self, span, OPERATIONS.get(surface, surface),
                            None if state is None else state.decode("latin-1"))

    def _span_id(self) -> str:
        return span_id_hex(self._bits(64) or 1)


class RequestTrace:
    """A traced request's spans: its own, the attempt in progress, the attempts done."""

    __slots__ = ("tracer", "span", "operation", "tracestate", "attempt", "done")

    def __init__(self, tracer: Tracer, span: Span, operation: str, tracestate: str | None) -> None:
        self.tracer = tracer
        self.span = span
        self.operation = operation
        self.tracestate = tracestate
        self.attempt: Span | None = None
        self.done: list[Span] = []

    @property
    def trace_id(self) -> str:
        return self.span.trace_id

    def attempt_started(self, record: RequestRecord, endpoint: Any,
                        headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """A span for the attempt about to be sent to ``endpoint``; returns the attempt's upstream headers
        with our ``traceparent`` (the attempt's span as the provider's parent) instead of the client's."""
        if self.attempt is not None:  # an attempt that ended without a word (defensive): close it
            self.attempt_ended(None)
        route = record.route
        cluster = "" if route is None else route.cluster
        model = record.capability or ""
        host, _, port = endpoint.address.rpartition(":")
        span = self.attempt = Span(self.span.trace_id, self.tracer._span_id(), self.span.span_id,
                                   f"{self.operation} {model}", SPAN_KIND_CLIENT, _time_ns())
        span.attributes = [
            ("gen_ai.operation.name", self.operation), ("gen_ai.request.model", model),
            ("gen_ai.provider.name", cluster), ("server.address", host or endpoint.address),
            ("gridgate.attempt", record.attempts),
        ]
        if port.isdigit():
            span.attributes.append(("server.port", int(port)))
        own = traceparent(span.trace_id, span.span_id)
        return [*(h for h in headers if h[0] != TRACEPARENT), (TRACEPARENT, own)]

    def attempt_ended(self, result: AttemptResult | None, record: RequestRecord | None = None) -> None:
        """The attempt in progress is over (``result``: what it came to; None: nothing is known)."""
        span = self.attempt
        if span is None:
            return
        self.attempt = None
        span.end_ns = _time_ns()
        attributes = span.attributes
        if result is None:
            _fail(span, "no_result", "the attempt ended without a result")
        else:
            if result.status:
                attributes.append(("http.response.status_code", result.status))
            if result.failure is not None:
                _fail(span, result.failure.code, result.detail or result.failure.code)
            elif result.status >= 500 or (result.held and result.status):
                _fail(span, str(result.status), f"the provider answered {result.status}")
            usage = result.usage
            if usage is not None and record is not None:
                _usage(attributes, usage.prompt_tokens, usage.completion_tokens)
            if result.started and record is not None and record.route is not None:
                attributes.append(("gen_ai.response.model", record.route.candidate.name))
        self.done.append(span)

    def end(self, record: RequestRecord, result: AttemptResult | None) -> None:
        """The request is over (``Outcomes.close``): close its spans and hand them to the exporter."""
        if self.attempt is not None:
            self.attempt_ended(result, record)
        span = self.span
        span.end_ns = _time_ns()
        model = record.capability or ""
        span.name = f"{self.operation} {model}" if model else self.operation
        attributes: list[tuple[str, AttributeValue]] = [
            ("gen_ai.operation.name", self.operation), ("gen_ai.request.model", model),
            ("http.request.method", (record.method or b"").decode("latin-1")),
            ("url.path", (record.target or b"").split(b"?", 1)[0].decode("latin-1")),
            ("http.response.status_code", record.status), ("gridgate.attempts", record.attempts),
        ]
        if record.request_id is not None:
            attributes.append(("gridgate.request_id", record.request_id.decode("latin-1")))
        if record.tenant is not None:
            attributes.append(("gridgate.tenant", record.tenant))
        if self.tracestate:
            attributes.append(("gridgate.client_tracestate", self.tracestate))
        route = record.route
        if route is not None:
            attributes += [
                ("gen_ai.provider.name", route.cluster), ("gridgate.route.stable_id", route.stable_id),
                ("gridgate.route.selection_mode", route.mode), ("gridgate.route.affinity", route.affinity),
                ("gridgate.route.overlay_revision", route.revision),
            ]
            if route.selection_group is not None:
                attributes.append(("gridgate.route.selection_group", route.selection_group))
            if result is not None and result.started:
                attributes.append(("gen_ai.response.model", route.candidate.name))
        _usage(attributes, record.tokens_prompt, record.tokens_completion)
        evidence = record.evidence
        if evidence is not None:
            attributes += evidence_attributes(evidence)
        if record.filtered:
            attributes.append(("gridgate.route.filtered", record.filtered))
        span.attributes = attributes
        if record.status >= 500 or record.error is not None and record.status >= 400:
            _fail(span, record.error or str(record.status), record.error or f"status {record.status}")
        self.tracer.exporter.submit([*self.done, span])
        self.done = []


def evidence_attributes(evidence: Any) -> list[tuple[str, AttributeValue]]:
    """The route evidence (gateway/routing/evidence.py) as span attributes."""
    attributes: list[tuple[str, AttributeValue]] = [
        ("gridgate.route.site", evidence.site), ("gridgate.route.admission_state", evidence.admission_state),
        ("gridgate.route.candidates", evidence.candidates),
    ]
    attributes += [(f"gridgate.route.excluded.{reason}", count) for reason, count in evidence.excluded.items()]
    if evidence.picker_inputs:
        attributes.append(("gridgate.route.picker_inputs",
                           ",".join(f"{p.provider}={p.score}" for p in evidence.picker_inputs)))
    return attributes


def _usage(attributes: list[tuple[str, AttributeValue]], prompt: int | None, completion: int | None) -> None:
    if prompt is not None:
        attributes.append(("gen_ai.usage.input_tokens", prompt))
    if completion is not None:
        attributes.append(("gen_ai.usage.output_tokens", completion))


def _fail(span: Span, error_type: str, message: str) -> None:
    span.status_code = STATUS_ERROR
    span.status_message = message
    span.attributes.append(("error.type", error_type))
