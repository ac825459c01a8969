"""The balancers' view of endpoint state in shared memory: health verdicts and in-flight counts.

One :class:`SharedEndpointState` per worker process implements ``balancers.base.StateView`` over the
segment the supervisor created before fork; the health process is the single writer of what it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import add, itemgetter

from gateway.cluster.balancers.base import DOWN, FULL_PERMILLE, PROBE, ROUTABLE
from gateway.cluster.outlier import OutlierState
from shm.counters import INFLIGHT, HealthRecord, HealthTable
from shm.segment import H_ROWS_IN_USE, Segment
from shm.seqlock import SeqlockBusy


def is_routable(record: HealthRecord) -> bool:
    """Whether a published verdict lets the endpoint take traffic (at its slow-start share)."""
    return not record.active_down and record.outlier_state == OutlierState.CLOSED


class SharedEndpointState:
    """The balancers' StateView over shared memory, one per worker process.

    ``generation`` combines the health writer's generation word, the verdicts-stale flag and the
    rows-in-use mark, so a balancer rebuilds its cached candidates and in-flight readers exactly when
    one changes. While the flag is up (the health process stopped beating, gateway.health.watch)
    every slot reads routable at full weight: unknown, as without checks.
    Half-open probes: a slot reads PROBE only for the worker the health process named in the record
    (or for every worker once, if it named none) and only until this worker hands that probe out.
    """

    def __init__(self, segment: Segment, worker: int) -> None:
        self._words = segment.words
        self._layout = segment.layout
        self._segment = segment
        self._health = HealthTable(segment)
        self._generation_word = self._layout.health_header_word()
        self._stale_word = self._health.stale_word()
        self._worker = worker
        self._offered: dict[int, int] = {}
        self._probed: dict[int, int] = {}
        self._last: dict[int, tuple[int, int]] = {}

    def generation(self) -> int:
        w = self._words
        return (((w[self._generation_word] << 1) | w[self._stale_word]) << 11) | w[H_ROWS_IN_USE]

    def slot_health(self, slot: int) -> tuple[int, int]:
        if self._words[self._stale_word]:
            return ROUTABLE, FULL_PERMILLE
        try:
            record = self._health.read(slot)
        except SeqlockBusy:
            # The writer stalled or died mid-publish: keep what we knew (fresh slots start routable).
            return self._last.get(slot, (ROUTABLE, FULL_PERMILLE))
        verdict = self._verdict(slot, record)
        self._last[slot] = verdict
        return verdict

    def _verdict(self, slot: int, record: HealthRecord) -> tuple[int, int]:
        if record.active_down:
            return DOWN, FULL_PERMILLE
        if record.outlier_state == OutlierState.CLOSED:
            return ROUTABLE, record.ramp_permille or FULL_PERMILLE
        if record.outlier_state == OutlierState.HALF_OPEN and record.probe_worker in (self._worker, -1):
            if self._probed.get(slot) != record.probe_epoch:
                self._offered[slot] = record.probe_epoch
                return PROBE, FULL_PERMILLE
        return DOWN, FULL_PERMILLE

    def mark_probe_sent(self, slot: int) -> None:
        self._probed[slot] = self._offered.get(slot, -1)

    def _slot_words(self, slot: int) -> list[int]:
        return [self._layout.slot_line_word(w, slot) + INFLIGHT for w in range(self._segment.rows_in_use())]

    def inflight_getter(self, slot: int) -> Callable[[], int]:
        q = self._words
        indexes = self._slot_words(slot)
        if not indexes:
            return lambda: 0
        if len(indexes) == 1:
            (i,) = indexes
            return lambda: q[i]
        if len(indexes) == 2:
            i, j = indexes
            return lambda: q[i] + q[j]
        return lambda: sum(q[i] for i in indexes)

    def inflight_reader(self, slots: Sequence[int]) -> Callable[[], Sequence[int]]:
        q = self._words
        slots = list(slots)
        rows = self._segment.rows_in_use()
        if not rows or len(slots) < 2:
            getters = [self.inflight_getter(s) for s in slots]
            return lambda: [g() for g in getters]
        # itemgetter(*indexes)(q) reads one worker's counts for all slots in a single C call.
        per_row = [itemgetter(*(self._layout.slot_line_word(w, s) + INFLIGHT for s in slots)) for w in range(rows)]
        if rows == 1:
            (g0,) = per_row
            return lambda: g0(q)
        if rows == 2:
            g0, g1 = per_row
            return lambda: list(map(add, g0(q), g1(q)))
        return lambda: [sum(c) for c in zip(*(g(q) for g in per_row), strict=True)]
