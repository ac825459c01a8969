"""Passive health: one circuit breaker per endpoint, fed by the outcomes workers count (pure).

The health process samples every worker row each poll and calls :meth:`ClusterBreakers.update`
with those samples and the clock. Nothing here reads shared memory or a clock itself.

States: CLOSED -> (``consecutive_failures`` over all workers) -> EJECTED until a deadline ->
HALF_OPEN: one named worker may send one probe request; the first outcome that lands decides:
success -> CLOSED (and slow start), failure -> EJECTED again for longer.

Consecutive failures over all workers: each worker keeps its own streak (reset by its own success),
and the breaker counts, per worker, only failures after a baseline taken when the endpoint last
(re)entered service: ``min(streak, requests - requests_at_baseline)``. That equals the new failures
when the streak never broke and the post-break streak otherwise, so old streaks of other workers
cannot re-trip an endpoint that just recovered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from gateway.cluster.spec import OutlierSpec


class OutlierState(IntEnum):
    """A breaker's state, published in each endpoint's health record (0, the fresh value, is closed)."""

    CLOSED = 0
    EJECTED = 1
    HALF_OPEN = 2


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker's counters for one endpoint slot, as read this poll."""

    requests: int
    failures: int
    consecutive: int
    inflight: int = 0


@dataclass(slots=True)
class EndpointBreaker:
    state: OutlierState = OutlierState.CLOSED
    ejections: int = 0  # ejection multiplier: +1 per trip, -1 per base_ejection of trip-free service
    ejected_until: float = 0.0
    total_ejections: int = 0
    consecutive: int = 0  # failures over all workers since the baseline (what trips the breaker)
    probe_worker: int = -1
    probe_epoch: int = 0
    probe_since: float = 0.0
    recovered_at: float | None = None  # last return to service; the slow-start origin
    quiet_since: float = 0.0
    cap_blocked: bool = False
    carry_streaks: bool = False  # count streaks older than the first poll (adopted after a restart)
    baselines: list[int] = field(default_factory=list)
    probe_requests: int = 0
    probe_failures: int = 0


def slow_start_permille(elapsed_s: float, window_s: float, steps: int = 10) -> int:
    """Share of its weight a recovered endpoint gets: 1/steps at first, growing in ``steps`` steps.

    Returns 0 for "full weight" (ramp over or disabled); quantised so the health process publishes
    (and balancers rebuild) only ``steps`` times per recovery.
    """
    if window_s <= 0 or elapsed_s >= window_s:
        return 0
    step = max(1, int(max(0.0, elapsed_s) / window_s * steps))
    permille = step * 1000 // steps
    return 0 if permille >= 1000 else permille


class ClusterBreakers:
    """The breakers of one cluster plus the ejection cap across them."""

    def __init__(self, spec: OutlierSpec, slots: Sequence[int]) -> None:
        self.spec = spec
        self.breakers = {slot: EndpointBreaker() for slot in slots}
        self.cap_blocked_trips = 0  # trips the cap refused (a counter for metrics)
        self._primed = False

    @property
    def max_ejected(self) -> int:
        return max(1, len(self.breakers) * self.spec.max_ejection_percent // 100)

    def adopt(self, slot: int, state: OutlierState, ejections: int, ejected_until: float, total_ejections: int,
              probe_epoch: int) -> None:
        """Carry over a published verdict (health-process restart on reload): ejected stays ejected."""
        b = self.breakers[slot]
        b.ejections, b.total_ejections, b.probe_epoch = ejections, total_ejections, probe_epoch
        b.carry_streaks = True
        if state != OutlierState.CLOSED:
            b.state = OutlierState.EJECTED  # a half-open probe in flight is re-offered under a new epoch
            b.ejected_until = ejected_until

    def update(self, now: float, samples: Mapping[int, Sequence[WorkerSample]],
               live_workers: Sequence[int] = ()) -> set[int]:
        """Advance every breaker; return the slots whose state changed."""
        changed: set[int] = set()
        out = sum(1 for b in self.breakers.values() if b.state != OutlierState.CLOSED)
        for slot, b in self.breakers.items():
            rows = samples.get(slot, ())
            consecutive = self._streak(b, rows)
            if consecutive != b.consecutive:
                b.consecutive = consecutive
                changed.add(slot)
            if b.state == OutlierState.CLOSED:
                if self._decay(b, now):
                    changed.add(slot)
                if self.spec.consecutive_failures and consecutive >= self.spec.consecutive_failures:
                    if out < self.max_ejected:
                        self._trip(b, now)
                        out += 1
                        changed.add(slot)
                    elif not b.cap_blocked:
                        b.cap_blocked = True
                        self.cap_blocked_trips += 1
                else:
                    b.cap_blocked = False
            elif b.state == OutlierState.EJECTED:
                if now >= b.ejected_until:
                    self._half_open(b, now, rows, live_workers)
                    changed.add(slot)
            elif self._judge_probe(b, now, rows, live_workers):
                if b.state == OutlierState.CLOSED:
                    out -= 1
                changed.add(slot)
        self._primed = True
        return changed

    # -- transitions --------------------------------------------------------------------------
    def _streak(self, b: EndpointBreaker, rows: Sequence[WorkerSample]) -> int:
        bases = b.baselines
        while len(bases) < len(rows):
            # Rows that appear after the first poll are fresh workers: everything they counted is new.
            # At the first poll, old streaks count only for an adopted endpoint (the same endpoint
            # before a health-process restart), not for one that took over a reused slot.
            row = rows[len(bases)]
            if self._primed:
                bases.append(0)
            else:
                bases.append(row.requests - (row.consecutive if b.carry_streaks else 0))
        total = 0
        for w, row in enumerate(rows):
            if row.requests < bases[w]:
                bases[w] = 0  # the row was reset (its worker died)
            total += max(0, min(row.consecutive, row.requests - bases[w]))
        return total

    def _trip(self, b: EndpointBreaker, now: float) -> None:
        spec = self.spec
        b.ejections += 1
        b.total_ejections += 1
        duration = min(spec.base_ejection_s * b.ejections, max(spec.base_ejection_s, spec.max_ejection_s))
        b.ejected_until = max(b.ejected_until, now + duration)  # a re-trip never shortens a deadline
        b.state = OutlierState.EJECTED
        b.cap_blocked = False
        b.probe_worker = -1

    def _decay(self, b: EndpointBreaker, now: float) -> bool:
        if b.ejections and now - b.quiet_since >= self.spec.base_ejection_s:
            b.ejections -= 1
            b.quiet_since = now
            return True
        return False

    def _half_open(self, b: EndpointBreaker, now: float, rows: Sequence[WorkerSample],
                   live_workers: Sequence[int]) -> None:
        b.state = OutlierState.HALF_OPEN
        b.probe_epoch += 1
        b.probe_worker = live_workers[b.probe_epoch % len(live_workers)] if live_workers else -1
        b.probe_since = now
        b.probe_requests = sum(r.requests for r in rows)
        b.probe_failures = sum(r.failures for r in rows)

    def _judge_probe(self, b: EndpointBreaker, now: float, rows: Sequence[WorkerSample],
                     live_workers: Sequence[int]) -> bool:
        requests = sum(r.requests for r in rows)
        failures = sum(r.failures for r in rows)
        if requests < b.probe_requests:  # a row was reset: re-take the reference point
            b.probe_requests, b.probe_failures = requests, failures
            return False
        if requests > b.probe_requests:
            # The first outcome(s) since half-open decide; any failure among them counts as failure.
            if failures > b.probe_failures:
                self._trip(b, now)
            else:
                self._close(b, now, rows)
            return True
        holder_busy = 0 <= b.probe_worker < len(rows) and rows[b.probe_worker].inflight > 0
        if live_workers and not holder_busy and now - b.probe_since >= self.spec.probe_reassign_s:
            self._half_open(b, now, rows, live_workers)  # the holder got no request
            return True
        return False

    def _close(self, b: EndpointBreaker, now: float, rows: Sequence[WorkerSample]) -> None:
        b.state = OutlierState.CLOSED
        b.recovered_at = now
        b.quiet_since = now
        b.probe_worker = -1
        b.consecutive = 0
        b.baselines = [r.requests for r in rows]
