"""The access log (docs/operations.md, "Access log"): one JSON object per request, written off the
request path.

``AccessLog.record`` runs once when a request ends, with its closed ``RequestRecord``
(workers/request_record.py), which holds what the line needs (clock readings, the exchange's fields, the
route decision, the outcome): it keeps the record and returns. Before each write-out
(every ``flush_delay_s``, at reopen and at close) the ``LineWriter`` asks for the lines: the pending
records are formatted and encoded with msgspec straight into its bounded buffer, in one tight loop.
The work is the same, but a batch runs with warm caches, where one line at the end of each request
ran cold: a third of the CPU per line on the request path.
Never keys, prompts or bodies: a closed record holds none (it lets go of the body and headers when it
closes), the line has no field that could, and ``path`` stops before the query string (some APIs take
keys there).

Successful requests are sampled (``access_log.sample``); errors (status >= 400, or an ``error`` code
such as a stream that failed after its head) are always logged.
"""

from __future__ import annotations

import random
import time

import msgspec

from gateway.config import AccessLog as AccessLogConfig
from gateway.config import Config
from gateway.routing.eligibility import reason_names
from gateway.routing.evidence import PickerInput
from workers.line_writer import LineWriter
from workers.request_record import RequestRecord

_perf = time.perf_counter
_time = time.time
_random = random.random
_astuple = msgspec.structs.astuple


class AccessLine(msgspec.Struct, omit_defaults=True, gc=False):
    """One line, in the documented key order; ``filtered`` (candidates the eligibility filters removed)
    and ``filtered_reasons`` (why: context_window, feature, region) only when there were any."""

    ts: str
    request_id: str | None
    tenant: str | None
    method: str | None
    path: str | None
    status: int
    capability: str | None
    provider: str | None
    stable_id: str | None
    selection_group: int | None
    selection_mode: str | None
    affinity: str | None
    attempts: int
    endpoint: str | None
    overlay_revision: str | None
    bytes_in: int
    bytes_out: int
    tokens_prompt: int | None
    tokens_completion: int | None
    overhead_ms: float | None
    first_byte_ms: float | None
    duration_ms: float | None
    error: str | None
    filtered: int = 0
    filtered_reasons: list[str] | None = None
    # The route evidence of a sampled request (access_log.evidence_sample; gateway/routing/evidence.py).
    site: str | None = None
    admission_state: str | None = None
    candidates: int | None = None
    excluded: dict[str, int] | None = None
    picker_inputs: list[PickerInput] | None = None
    trace_id: str | None = None  # a traced request's trace (docs/tracing.md)
    shadow: tuple[str, ...] | None = None  # quota limits in shadow mode that would have refused it
    # An alias or a fallback chain (docs/models.md): the name asked for (when an alias), the model that
    # served (or was tried last), the moves along the chain and why, and chain models skipped.
    requested_model: str | None = None
    served_model: str | None = None
    fallback_hops: int = 0
    fallback_reasons: list[str] | None = None
    fallback_skipped: int = 0
    # Spend (docs/pricing.md): the request's cost in nano-USD at the served model's price, the cached
    # and reasoning parts of its usage, and a budget threshold it crossed; present when known.
    cost_nusd: int | None = None
    tokens_cached: int | None = None
    tokens_reasoning: int | None = None
    spend_alert: str | None = None


_NO_ROUTE = (None, None, None, None, None, None)
_MAX_PATHS = 256
# A timestamp's end after the second: "123Z" for millisecond 123 (a lookup, not a format, per millisecond).
_MILLIS_TEXT = tuple(f"{fraction:03d}Z" for fraction in range(1000))


class AccessLog:
    """Per-worker access log. ``record`` never blocks and never raises for a full output."""

    def __init__(self, writer: LineWriter | None, sample: float = 1.0) -> None:
        self.writer = writer  # None: the access log is off
        self.sample = sample
        self._encode_into = msgspec.json.Encoder().encode_into
        self._pending: list[RequestRecord] = []  # what `record` keeps until `_fill`
        self._second = -1
        self._second_text = ""
        # Lines waiting for a write-out, at most: about what the writer's buffer holds.
        self._max_pending = 16 if writer is None else max(16, writer.max_buffer_bytes // 512)
        self._paths: dict[bytes, str] = {}  # request target -> its logged path
        if writer is not None:
            writer.fill = self._fill

    @classmethod
    def from_config(cls, config: Config) -> AccessLog:
        """Opens the output (raises OSError when it cannot); call with the event loop running."""
        settings: AccessLogConfig = config.access_log
        if not settings.enabled:
            return cls(None)
        path = settings.path if settings.path == "-" else config.file_path(settings.path)
        return cls(LineWriter(path), settings.sample)

    @property
    def dropped(self) -> int:
        """Lines lost since start (buffer full or output failing), for the metrics."""
        return 0 if self.writer is None else self.writer.dropped

    def _timestamp(self, millis: int) -> str:
        """RFC 3339 UTC with milliseconds (``millis`` since the epoch); the date part is formatted once
        per second (``_fill`` has this written out, per millisecond)."""
        second, fraction = divmod(millis, 1000)
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second))
        return self._second_text + _MILLIS_TEXT[fraction]

    def record(self, record: RequestRecord) -> None:
        """One request ended (a closed record: ``status`` as answered, 499 when the client left before
        any answer). The record itself is kept until the next write-out: it holds what its line says."""
        writer = self.writer
        if writer is None:
            return
        if record.status < 400 and record.error is None:
            sample = self.sample
            if sample < 1.0 and (sample <= 0.0 or _random() >= sample):
                return
        # _keep written out: this runs once per request, on the request path.
        pending = self._pending
        if len(pending) >= self._max_pending:
            writer.dropped += 1
            return
        if not pending:
            writer.wrote()
        pending.append(record)

    def rejected(self, status: int, error: str, request_id: bytes | None = None, method: bytes | None = None,
                 target: bytes | None = None, tenant: str | None = None) -> None:
        """A request refused before it reached the handler (malformed HTTP, limits, timeouts; or refused on
        its head by the head gate, which knows the request's id, method, path and maybe tenant)."""
        if self.writer is not None:
            self._keep(self.writer, RequestRecord(
                request_id=request_id, tenant=tenant, status=status, error=error, ended=_perf(), method=method,
                target=target, closed=True,
            ))

    def spend_alert(self, tenant: str, text: str) -> None:
        """A USD budget threshold was crossed (docs/pricing.md, "Alerts"): a line of its own, with
        ``tenant``, ``spend_alert`` and ``status`` 0 (it answers no request; the request fields are null)."""
        if self.writer is not None:
            self._keep(self.writer, RequestRecord(tenant=tenant, status=0, spend_alert=text, ended=_perf(),
                                                  closed=True))

    def _keep(self, writer: LineWriter, entry: RequestRecord) -> None:
        """Hold a line's values for the next write-out (dropped and counted past the bound). The first
        line after a write-out asks for the next one; the others find it coming (``_fill`` empties the list)."""
        pending = self._pending
        if len(pending) >= self._max_pending:
            writer.dropped += 1
            return
        if not pending:
            writer.wrote()
        pending.append(entry)

    def _fill(self) -> None:
        """The writer is about to write out: encode the pending lines into its buffer. Lines past its bound
        are dropped and counted by it, after the loop (``trim``): the loop does no per-line checks."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        writer = self.writer
        assert writer is not None
        buffer, encode_into, paths = writer.buffer, self._encode_into, self._paths
        start = len(buffer)
        wall_offset = _time() - _perf()  # perf_counter -> epoch seconds, for the lines' timestamps
        millis_done, ts = -1, ""  # lines ending in the same millisecond share one timestamp
        for entry in pending:
            ended, t_start, t_first_byte, target = entry.ended, entry.t_start, entry.t_first_byte, entry.target
            millis = int((ended + wall_offset) * 1000)
            if millis != millis_done:  # _timestamp written out for the common case, a second already formatted
                millis_done = millis
                ts = (self._second_text + _MILLIS_TEXT[millis % 1000] if millis // 1000 == self._second
                      else self._timestamp(millis))
            route, request_id, method, overhead_s = entry.route, entry.request_id, entry.method, entry.overhead_s
            if route is None:
                provider, stable_id, group, mode, affinity, revision = _NO_ROUTE
            else:
                provider, stable_id, group = route.cluster, route.stable_id, route.selection_group
                mode, affinity, revision = route.mode, route.affinity, route.revision
            filtered, evidence, trace = entry.filtered, entry.evidence, entry.trace
            line = AccessLine(
                ts, None if request_id is None else request_id.decode("latin-1"), entry.tenant,
                None if method is None else method.decode("latin-1"),
                None if target is None else paths.get(target) or self._path(target), entry.status, entry.capability,
                provider, stable_id, group, mode, affinity, entry.attempts,
                None if entry.endpoint is None else entry.endpoint.address, revision, entry.bytes_in,
                entry.bytes_out, entry.tokens_prompt, entry.tokens_completion,
                # Milliseconds with three decimals: whole microseconds, a quarter of the cost of round().
                None if overhead_s is None else int(overhead_s * 1e6 + 0.5) / 1000,
                int((t_first_byte - t_start) * 1e6 + 0.5) / 1000 if t_first_byte and t_start is not None else None,
                None if t_start is None else int((ended - t_start) * 1e6 + 0.5) / 1000,
                entry.error, filtered, reason_names(entry.filtered_reasons) if filtered else None,
            )
            # The rarer fields are set after the fact (the same line: keys follow the struct's order): a call
            # with every field spelled out, or unpacked from a tuple, costs more on every line.
            if evidence is not None:
                line.site, line.admission_state, line.candidates, line.excluded, line.picker_inputs = (
                    _astuple(evidence))
            if trace is not None:
                line.trace_id = trace.trace_id
            if entry.shadow is not None:
                line.shadow = entry.shadow
            if entry.model_route is not None:
                line.requested_model, line.served_model = entry.requested_model, entry.served
                line.fallback_hops, line.fallback_reasons = entry.fallback_hops, entry.fallback_reasons
                line.fallback_skipped = entry.fallback_skipped
            cost = entry.cost_nusd
            if cost is not None:  # priced: the served model (an alias's target, or a chain's) and the parts
                line.served_model, line.cost_nusd = entry.served, cost
                line.tokens_cached, line.tokens_reasoning = entry.tokens_cached, entry.tokens_reasoning
            if entry.spend_alert is not None:
                line.spend_alert = entry.spend_alert
            encode_into(line, buffer, -1)
            buffer.append(10)  # "\n"
        writer.trim(start)

    def _path(self, target: bytes) -> str:
        """The logged path of a request target: up to the query string (some APIs take keys there).
        A target without a query is remembered (a gateway serves a handful of paths; bounded all the
        same); one with a query never is, so no key sent in one stays in memory."""
        query = target.find(b"?")
        if query >= 0:
            return target[:query].decode("latin-1")
        path = target.decode("latin-1")
        if len(self._paths) >= _MAX_PATHS:
            self._paths.clear()
        self._paths[target] = path
        return path

    def reopen(self) -> None:
        if self.writer is not None:
            self.writer.reopen()

    async def close(self) -> None:
        if self.writer is not None:
            await self.writer.close()
