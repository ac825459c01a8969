"""The access log (docs/operations.md, "Access log"): one JSON object per request, written off the
request path.

``AccessLog.record`` runs once when a request ends, with its closed ``RequestRecord``
(workers/request_record.py), which holds what the line needs (clock readings, the exchange's fields, the
route decision, the outcome): it keeps the record and returns. Before each write-out
(every ``flush_delay_s``, at reopen and at close) the ``LineWriter`` asks for the lines: the pending
records are formatted and encoded with msgspec, joined into its bounded buffer, in one tight loop.
The work is the same, but a batch runs with warm caches, where one line at the end of each request
ran cold: a third of the CPU per line on the request path. Most lines share all but a dozen values
with others (the same path, route, endpoint and model): such a line is a ``TemplateLine``
(workers/access_line.py), its own values beside runs of the shared ones as raw JSON, made once per set
of shared values and kept in a small bounded dict; a response cache hit's line comes from a ``%``
template of its own; lines with the rarer fields are encoded whole. A write-out's lines are encoded by
one msgspec call (``encode_lines``). Never keys, prompts or bodies: a closed record holds none (it lets
go of the body and headers when it closes), the line has no field that could, and ``path`` stops before
the query string (some APIs take keys there).

Successful requests are sampled (``access_log.sample``); errors (status >= 400, or an ``error`` code
such as a stream that failed after its head) are always logged.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from operator import attrgetter, itemgetter
from typing import Any

import msgspec

from gateway.config import AccessLog as AccessLogConfig
from gateway.config import Config
from gateway.routing.eligibility import reason_names
from gateway.routing.plan import RouteDecision
from workers.access_line import AccessLine, TemplateLine, line_runs
from workers.line_writer import LineWriter
from workers.request_record import RequestRecord

_perf = time.perf_counter
_time = time.time
_random = random.random
_astuple = msgspec.structs.astuple
_encode = msgspec.json.encode
_encode_lines = msgspec.json.Encoder().encode_lines
_Raw = msgspec.Raw
_UNSET = msgspec.UNSET


# How often a worker writes its lines out. 50 ms: 200 ms read 82.9-83.4 % of the core against 81.0-81.8 % at
# 50 ms in a copy of main, but nothing once landed (81.7/81.6 % against 81.9/81.8 % before, alternated), and
# its larger batches held the loop longer (LineWriter's FILL_SLICE_LINES). The pending bound
# (``_max_pending``, 8,192 lines) holds 50 ms of far more requests than one worker serves.
WRITE_OUT_S = 0.05
_NO_ROUTE = (None, None, None, None, None, None, None)  # a RouteDecision's fields up to _ROUTE_FIELDS' end
_MAX_PATHS = 256
# Templates kept, at most (about 1 kB each with its key): paths x routes x endpoints x models in use. The
# tenant is not among the shared values (a store of managed keys may hold many): a line's own, like its id.
_MAX_TEMPLATES = 1024
_MAX_TENANTS = 4096  # tenants' JSON texts kept (`_JsonTexts`)
_MAX_MILLIS_TEXTS = 4096  # a cache hit's times' texts kept (`_MillisTexts`)

# A line from a template (`_template`): what it takes from its record as it is, read in one C call each.
# `_fill`'s own values; the per-request numbers, in the line's order; the values the line shares with
# others (with the route's, the path, how many token counts and which spend fields are None: its
# template's key; the endpoint as itself: the worker's own for its life, its address fixed), the rarer
# fields among them: a line with one set is encoded whole (no template is kept under its key).
_LINE_VALUES = ("ended", "t_start", "t_first_byte", "overhead_s", "request_id", "tenant", "route", "target",
                "cost_nusd", "tokens_cached", "tokens_reasoning", "subject")
_NUMBERS = ("status", "attempts", "bytes_in", "bytes_out", "tokens_prompt", "tokens_completion")
_SHARED = ("method", "capability", "endpoint", "error", "served_model", "identity",
           "filtered", "evidence", "trace", "shadow", "model_route", "spend_alert", "cache")
_RARE = ("filtered", "evidence", "trace", "shadow", "model_route", "spend_alert")
_numbers = attrgetter(*_NUMBERS)
_rare_fields = attrgetter(*_RARE)
_PLAIN = (0, None, None, None, None, None)
# What a line is made of, read off its kept record in one C call at the write-out (`_fill`): its own values,
# then the numbers, then the shared values; the savings last (a cache hit's: `_hit_line`). Reading them as the
# request ended instead (and freeing the record then) measured slower: a frame and the reads on the request
# path cost more than a record kept cold until the write-out. (``_record_of`` makes a record again of such
# values, for a cache hit's line encoded whole.)
_KEPT = (*_LINE_VALUES, *_NUMBERS, *_SHARED, "saved_tokens", "saved_nusd")
_kept = attrgetter(*_KEPT)
_OWN = slice(0, len(_LINE_VALUES))
_NUMBERS_AT = slice(len(_LINE_VALUES), len(_LINE_VALUES) + len(_NUMBERS))
_SHARED_AT = slice(_NUMBERS_AT.stop, _NUMBERS_AT.stop + len(_SHARED))
_RARE_AT = slice(_SHARED_AT.start + _SHARED.index(_RARE[0]), _SHARED_AT.start + _SHARED.index(_RARE[-1]) + 1)
assert _KEPT[_RARE_AT] == _RARE
# The route's values on the line, a slice of the decision (a tuple): cluster .. affinity.
_ROUTE_FIELDS = slice(1, 7)
assert RouteDecision._fields[_ROUTE_FIELDS] == (
    "cluster", "stable_id", "selection_group", "mode", "revision", "affinity")
# A timestamp's milliseconds and zone, its text after the second's (`_fill`).
_MILLIS_Z = tuple(f"{millis:03d}Z" for millis in range(1000))
_SKIP = b"%.0a"  # takes its argument and writes nothing: an optional field that is not on a hit's line
# A per-request field None on a hit template's line, written as msgspec writes None (the tenant: encoded by it).
_NULL_SPECS = {"tenant": b"%s", "tokens_prompt": b"null" + _SKIP, "tokens_completion": b"null" + _SKIP}
# A response cache hit's line (docs/cache.md) from a template of its own: its overhead_ms is null (no
# upstream), the savings are its own values and the token counts are null. Kept under the line's `_fill` key
# and whether each saving is None; the arguments: `_HIT_FIELDS`' values in this order, as `_hit_line` reads them.
_HIT_FIELDS = (
    ("ts", b'"%s%03dZ"'), ("request_id", b"%s"), ("tenant", b"%s"), ("status", b"%d"), ("attempts", b"%d"),
    ("bytes_in", b"%d"), ("bytes_out", b"%d"), ("first_byte_ms", b"%s"), ("duration_ms", b"%s"),
    ("cost_nusd", b"%d"), ("subject", b"%s"), ("saved_tokens", b"%d"), ("saved_nusd", b"%d"),
)
_HIT_OPTIONAL_FIELDS = frozenset(("cost_nusd", "subject", "saved_tokens", "saved_nusd"))
# A hit's values, read off its kept values (``_KEPT``: no record is made again for its line).
_hit_values = itemgetter(*map(_KEPT.index, ("t_start", "t_first_byte", "ended", "status", "attempts", "bytes_in",
                                            "bytes_out", "cost_nusd", "subject", "saved_tokens", "saved_nusd",
                                            "request_id", "tenant")))
_CACHE_AT = _KEPT.index("cache")
# The others of a template's line: none of them may be None.
_required = attrgetter("ts", "request_id", "status", "attempts", "bytes_in", "bytes_out", "overhead_ms", "first_byte_ms",
                       "duration_ms")


class _JsonTexts(dict[str | None, bytes]):
    """A tenant -> its JSON text (null for None), encoded once: a worker's lines name few tenants (bounded all
    the same: a store of managed keys may hold many)."""

    def __missing__(self, value: str | None) -> bytes:
        if len(self) >= _MAX_TENANTS:
            self.clear()
        text = self[value] = _encode(value)
        return text


class _MillisTexts(dict[int, bytes]):
    """Whole microseconds -> the milliseconds (three decimals) as msgspec encodes them, for a cache hit's
    times: short (no upstream), they span few values, so nearly each is encoded once and then looked up
    (bounded). Not for the other lines: their latencies spread too wide (under bench_opcodes' tracing even
    their overheads missed once a line)."""

    def __missing__(self, micros: int) -> bytes:
        if len(self) >= _MAX_MILLIS_TEXTS:
            self.clear()
        text = self[micros] = _encode(micros / 1000)
        return text


class _Paths(dict[bytes | None, str | None]):
    """Request target -> its logged path: up to the query string (some APIs take keys there). A target
    without a query is remembered (a gateway serves a handful of paths; bounded all the same); one with a
    query never is, so no key sent in one stays in memory. No target (no exchange): no path."""

    def __missing__(self, target: bytes | None) -> str | None:
        if target is None:
            return None
        query = target.find(b"?")
        if query >= 0:
            return target[:query].decode("latin-1")
        path = target.decode("latin-1")
        if len(self) >= _MAX_PATHS:
            self.clear()
        self[target] = path
        return path


def _record_of(entry: RequestRecord | tuple) -> RequestRecord:
    """The record a pending entry stands for: itself, or one made again of a plain line's kept values
    (``_KEPT``: all a line with no rarer field is made of), for a line encoded whole."""
    if entry.__class__ is not tuple:
        return entry  # type: ignore[return-value]
    return RequestRecord(**dict(zip(_KEPT, entry, strict=True)), closed=True)  # type: ignore[arg-type]


class AccessLog:
    """Per-worker access log. ``record`` never blocks and never raises for a full output."""

    def __init__(self, writer: LineWriter | None, sample: float = 1.0) -> None:
        self.writer = writer  # None: the access log is off
        self.sample = sample
        self._pending: list[RequestRecord] = []  # what `record` keeps until `_fill`
        self._second = -1
        self._second_text = b""
        # Lines waiting for a write-out, at most: about what the writer's buffer holds.
        self._max_pending = 16 if writer is None else max(16, writer.max_buffer_bytes // 512)
        self._paths = _Paths()
        self._tenant_texts = _JsonTexts()
        self._millis_texts = _MillisTexts()  # a cache hit's times (`_hit_line`)
        # The values a line shares with others (`_fill`'s key) -> its TemplateLine's runs (`line_runs`).
        self._templates: dict[tuple, tuple] = {}
        self._hit_templates: dict[tuple, bytes] = {}  # (the `_fill` key, savings None) -> a hit's template
        if writer is not None:
            writer.fill = self._fill
            if sample >= 1.0:
                # Every line kept: ``record`` is the pending list's own append, one C call on the request path
                # (no frame, no checks), and the writer writes out on its timer whether or not a line came
                # (``LineWriter.keep_flushing``), so no request arms it; `_fill` applies the bound.
                self.record = self._pending.append  # type: ignore[method-assign]
                writer.keep_flushing()

    @classmethod
    def from_config(cls, config: Config) -> AccessLog:
        """Opens the output (raises OSError when it cannot); call with the event loop running."""
        settings: AccessLogConfig = config.access_log
        if not settings.enabled:
            return cls(None)
        path = settings.path if settings.path == "-" else config.file_path(settings.path)
        return cls(LineWriter(path, flush_delay_s=WRITE_OUT_S), settings.sample)

    @property
    def dropped(self) -> int:
        """Lines lost since start (buffer full or output failing), for the metrics."""
        return 0 if self.writer is None else self.writer.dropped

    def _date(self, second: int) -> bytes:
        """b"YYYY-MM-DDTHH:MM:SS." (RFC 3339 UTC) of ``second`` since the epoch, formatted once per second."""
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second)).encode()
        return self._second_text

    def _timestamp(self, millis: int) -> str:
        """RFC 3339 UTC with milliseconds (``millis`` since the epoch); ``_fill`` has this written out."""
        second, fraction = divmod(millis, 1000)
        return (b"%s%03dZ" % (self._date(second), fraction)).decode()

    def record(self, record: RequestRecord) -> None:
        """One request ended (a closed record: ``status`` as answered, 499 when the client left before
        any answer). The record itself is kept until the next write-out: it holds what its line says.
        Sampled lines only: unsampled, ``record`` is the pending list's append (``__init__``)."""
        writer = self.writer
        if writer is None:
            return
        sample = self.sample  # asked first: a line is kept unsampled (1.0) without reading the record
        if (sample < 1.0 and record.status < 400 and record.error is None
                and (sample <= 0.0 or _random() >= sample)):
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

    def _taken(self, most: int | None) -> list[RequestRecord]:
        """The first ``most`` pending records (None: all) of at most ``_max_pending`` (more: the loop was held
        up; dropped and counted), taken out in place: the same list keeps taking lines (``record`` may be
        its bound append)."""
        kept = self._pending
        if len(kept) > self._max_pending and self.writer is not None:
            self.writer.dropped += len(kept) - self._max_pending
            del kept[self._max_pending:]
        if most is not None and len(kept) > most:
            pending = kept[:most]
            del kept[:most]
            return pending
        pending = kept.copy()
        kept.clear()
        return pending

    def _fill(self, most: int | None = None) -> bool:
        """The writer is about to write out: the first ``most`` pending lines (None: all), encoded by one call
        into its buffer; True: more are pending. Lines past its bound are dropped and counted by it (``trim``)."""
        pending = self._taken(most)
        if not pending:
            return False
        writer, paths, templates = self.writer, self._paths, self._templates
        assert writer is not None
        lines: list[Any] = []  # AccessLine, TemplateLine or Raw (a hit's from its template): one encode for all
        add = lines.append
        wall_offset = _time() - _perf()  # perf_counter -> epoch seconds, for the lines' timestamps
        second, date, date_text = -1, b"", ""  # the date part of the lines' timestamps, formatted once per second
        for entry in pending:
            values = _kept(entry)
            (ended, t_start, t_first_byte, overhead_s, request_id, tenant, route, target, cost, cached, reasoning,
             subject) = values[_OWN]
            millis = int((ended + wall_offset) * 1000)
            if millis // 1000 != second:  # _timestamp written out, its date formatted once per second
                second = millis // 1000
                date = self._date(second)
                date_text = date.decode()
            if not t_first_byte:  # no answer was sent (or the record has no exchange): no first_byte_ms
                self._encode_line(_record_of(entry), millis, add, None)
                continue
            numbers = values[_NUMBERS_AT]
            key = ((route or _NO_ROUTE)[_ROUTE_FIELDS], paths[target], values[_SHARED_AT], cost is None)
            if overhead_s is None:  # a cache hit's line (never the common template's: no overhead_ms)
                self._hit_line(entry, values, millis, date, add,
                               (key, numbers.count(None), cached is None, reasoning is None, subject is None))
                continue
            try:
                # Times: whole microseconds in ms (round() costs 4x). Spend fields only when priced; the subject with an identity.
                runs = templates[key]
                status, attempts, bytes_in, bytes_out, prompt, completion = numbers
                add(TemplateLine(
                    date_text + _MILLIS_Z[millis % 1000], request_id.decode("latin-1"), tenant, runs[0], status,
                    runs[1], attempts, runs[2], bytes_in, bytes_out, prompt, completion,
                    int(overhead_s * 1e6 + 0.5) / 1000, int((t_first_byte - t_start) * 1e6 + 0.5) / 1000,
                    int((ended - t_start) * 1e6 + 0.5) / 1000, runs[3], _UNSET if cost is None else cost,
                    _UNSET if cost is None or cached is None else cached,
                    _UNSET if cost is None or reasoning is None else reasoning, runs[4],
                    _UNSET if subject is None or runs[4] is _UNSET else subject, runs[5]))
            except (KeyError, TypeError, AttributeError):
                # No runs yet for its shared values (the line makes them), a rarer field set (its key is unhashable
                # or never kept), or a None among its request id and times (no runs are made of such a line): whole.
                self._encode_line(_record_of(entry), millis, add, key)
        start = len(writer.buffer)
        writer.buffer += _encode_lines(lines)
        writer.trim(start)
        return bool(self._pending)

    def _line(self, entry: RequestRecord, ts: str) -> AccessLine:
        """The line of ``entry``, field by field."""
        ended, t_start, t_first_byte, target = entry.ended, entry.t_start, entry.t_first_byte, entry.target
        route, request_id, method, overhead_s = entry.route, entry.request_id, entry.method, entry.overhead_s
        if route is None:
            provider, stable_id, group, mode, revision, affinity = _NO_ROUTE[_ROUTE_FIELDS]
        else:
            provider, stable_id, group, mode, revision, affinity = route[_ROUTE_FIELDS]
        filtered, evidence, trace = entry.filtered, entry.evidence, entry.trace
        line = AccessLine(
            ts, None if request_id is None else request_id.decode("latin-1"), entry.tenant,
            None if method is None else method.decode("latin-1"), self._paths[target], entry.status,
            entry.capability, provider, stable_id, group, mode, affinity, entry.attempts,
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
            (line.site, line.admission_state, line.candidates, line.excluded, line.picker_inputs,
             line.prefix) = _astuple(evidence)
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
        if entry.identity is not None:
            line.identity, line.subject = entry.identity, entry.subject
        if entry.cache is not None:  # a hit's line is never the common template's (no overhead_ms): `_hit_line`
            line.cache, line.saved_tokens, line.saved_nusd = entry.cache, entry.saved_tokens, entry.saved_nusd
        return line

    def _encode_line(self, entry: RequestRecord, millis: int, add: Callable[[Any], None],
                     key: tuple | None) -> None:
        """The line of ``entry`` (ended at ``millis`` since the epoch), whole, given to ``add``; and the runs
        of ``key``'s TemplateLine made of it (``line_runs``), when a line can have one and ``key`` has none
        yet. ``key`` holds every other value the runs are made of: nothing of one request's own reaches
        another's line."""
        line = self._line(entry, self._timestamp(millis))
        add(line)
        if (key is not None and _rare_fields(entry) == _PLAIN and None not in _required(line)
                and line.saved_tokens is None and line.saved_nusd is None and key not in self._templates):
            templates = self._templates
            if len(templates) >= _MAX_TEMPLATES:
                templates.clear()
            templates[key] = line_runs(line)

    def _hit_line(self, entry: RequestRecord | tuple, values: tuple, millis: int, date: bytes,
                  add: Callable[[Any], None], key: tuple) -> None:
        """A line with no overhead_ms (``values``: its kept values, ``_KEPT``): a response cache hit's from its
        template (the first line of its kind is encoded whole, and its template made of it unless a value no
        template can hold is None); any other, or with a rarer field set, encoded whole."""
        (t_start, t_first_byte, ended, status, attempts, bytes_in, bytes_out, cost, subject, saved_tokens,
         saved_nusd, request_id, tenant) = _hit_values(values)
        if (values[_CACHE_AT] != "hit" or t_start is None or request_id is None
                or values[_RARE_AT] != _PLAIN):  # (a rarer field: the key may not even be hashable)
            self._encode_line(_record_of(entry), millis, add, None)
            return
        hit_key = (key, saved_tokens is None, saved_nusd is None)
        template = self._hit_templates.get(hit_key)
        if template is None:  # the first of its kind: encoded whole, and its template made of it when it can be
            line = self._line(_record_of(values), self._timestamp(millis))
            add(line)
            if (line.tokens_prompt is None and line.tokens_completion is None and line.tokens_cached is None
                    and line.tokens_reasoning is None):
                self._template(line, self._hit_templates, hit_key)
            return
        millis_texts = self._millis_texts  # a hit's times are short (no upstream): their texts looked up
        add(_Raw(template % (
            date, millis % 1000, _encode(request_id.decode("latin-1")), self._tenant_texts[tenant],
            status, attempts, bytes_in, bytes_out, millis_texts[int((t_first_byte - t_start) * 1e6 + 0.5)],
            millis_texts[int((ended - t_start) * 1e6 + 0.5)], cost, subject if subject is None else _encode(subject),
            saved_tokens, saved_nusd)))

    def _template(self, line: AccessLine, templates: dict[tuple, bytes], kept_as: tuple) -> bytes | None:
        """The template of the hit lines that share ``kept_as``, made of ``line`` (one of them, with no rarer
        field and no None where `_required`), kept under ``kept_as`` (bounded): the line as msgspec encodes
        it, with its per-request values (_HIT_FIELDS) in as unique markers, each marker then replaced by its
        ``%`` spec (a literal ``%`` doubled first). An optional field not on the line takes its argument with
        ``_SKIP`` after the spec before it. ``kept_as`` holds every other value the line is made of (those
        read only with a rarer field set aside): nothing of one request's own reaches another's line. No
        template is made should a marker not come out exactly once (a shared value holds one)."""
        line = msgspec.structs.replace(line)  # a copy: ``line`` itself is still to be written
        replaced: list[tuple[bytes, bytes]] = []
        for index, (name, spec) in enumerate(_HIT_FIELDS):
            if getattr(line, name) is None:
                if name in _HIT_OPTIONAL_FIELDS:
                    marker, previous = replaced[-1]
                    replaced[-1] = (marker, previous + _SKIP)
                    continue
                spec = _NULL_SPECS[name]
            marker = f"\0{index}"
            setattr(line, name, marker)
            replaced.append((_encode(marker), spec))
        text = _encode(line).replace(b"%", b"%%")
        template = text
        for marker, spec in replaced:
            if text.count(marker) != 1:
                return None
            template = template.replace(marker, spec)
        if len(templates) >= _MAX_TEMPLATES:
            templates.clear()
        templates[kept_as] = template
        return template

    def reopen(self) -> None:
        if self.writer is not None:
            self.writer.reopen()

    async def close(self) -> None:
        if self.writer is not None:
            await self.writer.close()
