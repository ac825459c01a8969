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
    from gateway.routing import RouteDecision
    from gateway.routing.evidence import RouteEvidence
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

    __slots__ = ("sample", "exporter", "issuers", "_bits", "_random")

    def __init__(self, sample: float, exporter: SpanExporter, rng: random.Random | None = None,
                 issuers: dict[str, str] | None = None) -> None:
        self.sample = sample
        self.exporter = exporter
        self.issuers = issuers or {}  # a JWT identity (``jwt:<name>``) -> its issuer's ``iss`` (auth.jwt)
        rng = rng or random.Random()
        self._bits = rng.getrandbits
        self._random = rng.random

    @classmethod
    def from_config(cls, config: Config) -> Tracer | None:
        """The worker's tracer (its exporter thread starts), or None when ``tracing`` is not configured."""
        settings = config.tracing
        if settings is None:
            return None
        issuers = {f"jwt:{entry.name}": entry.issuer for entry in config.auth.jwt} if config.auth is not None else {}
        return cls(settings.sample, SpanExporter(settings), issuers=issuers)

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
        span = Span(trace_id, self._span_id(), parent_id, surface, SPAN_KIND_SERVER, start_ns,
                    trace_state="" if state is None else state.decode("latin-1"))
        return RequestTrace(self, span, OPERATIONS.get(surface, surface))

    def _span_id(self) -> str:
        return span_id_hex(self._bits(64) or 1)


class RequestTrace:
    """A traced request's spans: its own, the attempt in progress, the attempts done.

    The request path records ids, clock readings and the values the attributes come from (immutable, or
    copied); the attribute lists themselves are made on the exporter's thread (``Span.deferred``)."""

    __slots__ = ("tracer", "span", "operation", "attempt", "attempt_of", "done")

    def __init__(self, tracer: Tracer, span: Span, operation: str) -> None:
        self.tracer = tracer
        self.span = span
        self.operation = operation
        self.attempt: Span | None = None
        self.attempt_of: tuple[str, str, str, int] = ("", "", "", 0)  # model, cluster, endpoint, attempt number
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
        model = record.capability or ""
        trace_id = self.span.trace_id
        span = self.attempt = Span(trace_id, self.tracer._span_id(), self.span.span_id, f"{self.operation} {model}",
                                   SPAN_KIND_CLIENT, _time_ns(), trace_state=self.span.trace_state)
        self.attempt_of = (model, "" if route is None else route.cluster, endpoint.address, record.attempts)
        own = (TRACEPARENT, traceparent(trace_id, span.span_id))
        return [*[h for h in headers if h[0] != TRACEPARENT], own]

    def attempt_ended(self, result: AttemptResult | None, record: RequestRecord | None = None) -> None:
        """The attempt in progress is over (``result``: what it came to; None: nothing is known)."""
        span = self.attempt
        if span is None:
            return
        self.attempt = None
        span.end_ns = _time_ns()
        if result is None:
            _fail(span, "no_result", "the attempt ended without a result")
            span.deferred = (attempt_attributes, (self.operation, *self.attempt_of, 0, None, None, None))
        else:
            status, failure = result.status, result.failure
            if failure is not None:
                _fail(span, failure.code, result.detail or failure.code)
            elif status >= 400:  # a client span's 4xx is an error too (OpenTelemetry HTTP conventions)
                _fail(span, str(status), f"the provider answered {status}")
            usage = result.usage if record is not None else None
            usage_values = None if usage is None else (usage.prompt_tokens, usage.completion_tokens)
            served = result.started and record is not None and record.route is not None
            span.deferred = (attempt_attributes, (self.operation, *self.attempt_of, status, usage_values,
                                                  record.route.candidate.name if served else None,  # type: ignore[union-attr]
                                                  None))
        self.done.append(span)

    def end(self, record: RequestRecord, result: AttemptResult | None) -> None:
        """The request is over (``Outcomes.close``): close its spans and hand them to the exporter."""
        if self.attempt is not None:
            self.attempt_ended(result, record)
        span = self.span
        span.end_ns = _time_ns()
        model = record.capability
        span.name = f"{self.operation} {model}" if model else self.operation
        status, error = record.status, record.error
        # A server span's 4xx is the client's mistake, not the span's (OpenTelemetry HTTP conventions): its
        # code is an attribute; a 5xx, or a response cut after its head, is an error.
        if status >= 500 or (error is not None and status < 400):
            _fail(span, error or str(status), error or f"status {status}")
        elif error is not None:
            span.attributes.append(("error.type", error))
        span.deferred = (request_attributes, (
            self.operation, model, record.method, record.target, status, record.attempts, record.request_id,
            record.tenant, record.route, result is not None and result.started,
            record.tokens_prompt, record.tokens_completion, record.evidence, record.filtered,
            record.identity, self.tracer.issuers,
        ))
        done = self.done
        done.append(span)
        self.tracer.exporter.submit(done)
        self.done = []


# -- attributes, made on the exporter's thread ---------------------------------------------------------
def attempt_attributes(operation: str, model: str, cluster: str, address: str, attempt: int, status: int,
                       usage: tuple[int | None, int | None] | None, response_model: str | None,
                       _unused: None) -> list[tuple[str, AttributeValue]]:
    host, _, port = address.rpartition(":")
    attributes: list[tuple[str, AttributeValue]] = [
        ("gen_ai.operation.name", operation), ("gen_ai.request.model", model), ("gen_ai.provider.name", cluster),
        ("server.address", host or address), ("gridgate.attempt", attempt),
    ]
    if port.isdigit():
        attributes.append(("server.port", int(port)))
    if status:
        attributes.append(("http.response.status_code", status))
    if response_model is not None:
        attributes.append(("gen_ai.response.model", response_model))
    if usage is not None:
        _usage(attributes, *usage)
    return attributes


def request_attributes(operation: str, model: str | None, method: bytes | None, target: bytes | None, status: int,
                       attempts: int, request_id: bytes | None, tenant: str | None,
                       route: RouteDecision | None, served: bool, prompt: int | None, completion: int | None,
                       evidence: RouteEvidence | None, filtered: int, identity: str | None = None,
                       issuers: dict[str, str] | None = None) -> list[tuple[str, AttributeValue]]:
    attributes: list[tuple[str, AttributeValue]] = [
        ("gen_ai.operation.name", operation), ("gen_ai.request.model", model or ""),
        ("http.request.method", (method or b"").decode("latin-1")),
        ("url.path", (target or b"").split(b"?", 1)[0].decode("latin-1")),
        ("http.response.status_code", status), ("gridgate.attempts", attempts),
    ]
    if request_id is not None:
        attributes.append(("gridgate.request_id", request_id.decode("latin-1")))
    if tenant is not None:
        attributes.append(("gridgate.tenant", tenant))
    if identity is not None:
        attributes += identity_attributes(identity, issuers or {})
    if route is not None:
        attributes += [
            ("gen_ai.provider.name", route.cluster), ("gridgate.route.stable_id", route.stable_id),
            ("gridgate.route.selection_mode", route.mode), ("gridgate.route.affinity", route.affinity),
            ("gridgate.route.overlay_revision", route.revision),
        ]
        if route.selection_group is not None:
            attributes.append(("gridgate.route.selection_group", route.selection_group))
        if served:
            attributes.append(("gen_ai.response.model", route.candidate.name))
    _usage(attributes, prompt, completion)
    if evidence is not None:
        attributes += evidence_attributes(evidence)
    if filtered:
        attributes.append(("gridgate.route.filtered", filtered))
    return attributes


def identity_attributes(identity: str, issuers: dict[str, str]) -> list[tuple[str, AttributeValue]]:
    """Who a request a JWT, a client certificate or a managed key's previous secret identified is
    (docs/tracing.md): the access line's ``identity``, its kind and a JWT's issuer. Never the subject: a
    trace goes to a collector outside the gateway, and a subject may be a person (CONTRACT 21 gives the
    subject to the access log and the spend report, not to traces or metrics)."""
    if identity.startswith("jwt:"):
        attributes: list[tuple[str, AttributeValue]] = [("gridgate.identity", identity),
                                                        ("gridgate.identity.kind", "jwt")]
        issuer = issuers.get(identity)
        if issuer is not None:
            attributes.append(("gridgate.identity.issuer", issuer))
        return attributes
    return [("gridgate.identity", identity), ("gridgate.identity.kind", "mtls" if identity == "mtls" else "api_key")]


def evidence_attributes(evidence: RouteEvidence) -> list[tuple[str, AttributeValue]]:
    """The route evidence (gateway/routing/evidence.py) as span attributes."""
    attributes: list[tuple[str, AttributeValue]] = [
        ("gridgate.route.site", evidence.site), ("gridgate.route.admission_state", evidence.admission_state),
        ("gridgate.route.candidates", evidence.candidates),
    ]
    attributes += [(f"gridgate.route.excluded.{reason}", count) for reason, count in evidence.excluded.items()]
    if evidence.picker_inputs:
        attributes.append(("gridgate.route.picker_inputs",
                           ",".join(f"{p.provider}={p.score}" for p in evidence.picker_inputs)))
    prefix = evidence.prefix
    if prefix is not None:  # prefix affinity placed it (docs/routing.md, "Prefix affinity")
        attributes += [("gridgate.route.prefix.hash", prefix.hash), ("gridgate.route.prefix.moved", prefix.moved),
                       ("gridgate.route.prefix.spilled", prefix.spilled)]
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
