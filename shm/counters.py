"""The single-writer tables of the segment: worker rows and health records.

Worker row (writer: that worker; reset by the supervisor once it is dead)::

    header line   0 heartbeat_ns | 1 status | 2 pid | 3..7 reserved
    slot line s   0 in_flight | 1 requests | 2 connect | 3 reset | 4 timeout | 5 http_5xx
                  6 consecutive_failures (since this worker's last success)
                  7 cooled_until_ns (monotonic ns until which this worker saw the endpoint cooled by a
                    429/503: shm.providers.EndpointCooling; 0 never)

One cache line per (worker, slot) keeps a request's increments on one line and keeps workers off
each other's lines. Readers sum the rows; nobody but the owner writes a row, so no locks.

Health record per slot (writer: the health process; seqlocked)::

    0 seq | 1 slot_generation | 2 active_down | 3 outlier_state | 4 ejected_until_ns (monotonic)
    5 ejections (multiplier) | 6 ramp_permille (0 = full weight) | 7 probe_worker (-1 = any)
    8 probe_epoch | 9 consecutive_failures | 10 total_ejections | 11 changed_at_ns | 12..15 reserved

All-zero means healthy, closed, full weight: a fresh segment starts every endpoint healthy. The health
header line holds ``generation`` (bumped after every published change, so readers poll one word),
the writer's pid and heartbeat (writer: the health process), and ``verdicts_stale`` (writer: the
supervisor, which watches that heartbeat: 1 while the verdicts are too old to trust, and readers then
treat every endpoint as unknown, that is routable, as without checks; gateway.health.watch).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace
from enum import IntEnum

from shm.segment import HEALTH_RECORD_WORDS, SLOT_LINE_WORDS, Segment
from shm.seqlock import read_record, write_record

# Slot-line word offsets.
INFLIGHT, REQUESTS, FAIL_CONNECT, FAIL_RESET, FAIL_TIMEOUT, FAIL_5XX, CONSECUTIVE, COOLED_UNTIL = range(8)
# Row-header word offsets.
HEARTBEAT, STATUS, PID = 0, 1, 2
# Health header word offsets.
HEALTH_GENERATION, WRITER_PID, WRITER_HEARTBEAT, VERDICTS_STALE = 0, 1, 2, 3


class WorkerStatus(IntEnum):
    FREE = 0  # a zeroed row
    RUNNING = 2


class WorkerRow:
    """The row one worker owns. Hot path: ``inc_inflight``/``dec_inflight`` and ``record``."""

    __slots__ = ("index", "_q", "_header")

    def __init__(self, segment: Segment, worker: int) -> None:
        segment._check_worker(worker)
        layout = segment.layout
        start = layout.row_word(worker)
        self.index = worker
        self._header = segment.words[start : start + SLOT_LINE_WORDS]
        # A view of just this row's slot lines: a bad slot raises IndexError instead of hitting a neighbour.
        first = layout.slot_line_word(worker, 0)
        self._q = segment.words[first : first + layout.max_endpoints * SLOT_LINE_WORDS]

    # -- connection accounting (called by the upstream pool) ----------------------------------
    def inc_inflight(self, slot: int) -> None:
        self._q[slot << 3] += 1

    def dec_inflight(self, slot: int) -> None:
        self._q[slot << 3] -= 1

    # -- outcomes (passive health) -------------------------------------------------------------
    def record(self, slot: int, failure_word: int) -> None:
        """Count one finished attempt: ``failure_word`` is 0 for a success, else the FAIL_* word to increment."""
        q = self._q
        base = slot << 3
        q[base + REQUESTS] += 1
        if failure_word:
            q[base + failure_word] += 1
            q[base + CONSECUTIVE] += 1
        else:
            q[base + CONSECUTIVE] = 0

    def counters(self, slot: int) -> list[int]:
        """The slot line: [in_flight, requests, connect, reset, timeout, 5xx, consecutive, cooled_until_ns]."""
        base = slot << 3
        return self._q[base : base + SLOT_LINE_WORDS].tolist()

    # -- lifecycle -----------------------------------------------------------------------------
    def mark(self, status: WorkerStatus, pid: int, now_ns: int) -> None:
        self._header[PID] = pid
        self._header[HEARTBEAT] = now_ns
        self._header[STATUS] = int(status)

    def heartbeat(self, now_ns: int) -> None:
        self._header[HEARTBEAT] = now_ns


@dataclass(frozen=True, slots=True)
class RowHeader:
    heartbeat_ns: int
    status: int
    pid: int


class RowsReader:
    """Read side of the worker rows: totals over the rows in use, and raw samples for the health process."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self._words = segment.words
        self._layout = segment.layout

    def rows_in_use(self) -> int:
        return self._segment.rows_in_use()

    def header(self, worker: int) -> RowHeader:
        start = self._layout.row_word(worker)
        w = self._words
        return RowHeader(w[start + HEARTBEAT], w[start + STATUS], w[start + PID])

    def slot_lines(self, worker: int) -> list[int]:
        """All slot lines of one row as a flat list (index ``slot * 8 + field``); one copy per poll."""
        first = self._layout.slot_line_word(worker, 0)
        return self._words[first : first + self._layout.max_endpoints * SLOT_LINE_WORDS].tolist()

    def totals(self, slot: int) -> list[int]:
        """The slot line summed over every row in use (consecutive is summed too; cooled_until is not a
        count: read it with shm.providers.EndpointCooling)."""
        acc = [0] * SLOT_LINE_WORDS
        for r in range(self.rows_in_use()):
            start = self._layout.slot_line_word(r, slot)
            for i, value in enumerate(self._words[start : start + SLOT_LINE_WORDS].tolist()):
                acc[i] += value
        return acc


@dataclass(frozen=True, slots=True)
class HealthRecord:
    """One endpoint slot's published verdict (field order = record words 1..11)."""

    slot_generation: int = 0
    active_down: int = 0
    outlier_state: int = 0  # gateway.cluster.outlier.OutlierState; 0 = closed
    ejected_until_ns: int = 0
    ejections: int = 0
    ramp_permille: int = 0  # 0 = full weight; 1..999 = slow-start share of the configured weight
    probe_worker: int = -1  # worker allowed the single half-open probe; -1 = any worker, once each
    probe_epoch: int = 0
    consecutive_failures: int = 0
    total_ejections: int = 0
    changed_at_ns: int = 0


_RECORD_FIELDS = len(HealthRecord.__dataclass_fields__)
_DATA_WORDS = HEALTH_RECORD_WORDS - 1
_PADDING = [0] * (_DATA_WORDS - _RECORD_FIELDS)


class HealthTable:
    """Seqlocked health records. ``publish``/``bump_generation`` belong to the health process alone."""

    def __init__(self, segment: Segment) -> None:
        self._words = segment.words
        self._layout = segment.layout
        self._header = self._layout.health_header_word()

    def generation(self) -> int:
        return self._words[self._header + HEALTH_GENERATION]

    def read(self, slot: int) -> HealthRecord:
        values = read_record(self._words, self._layout.health_record_word(slot), _DATA_WORDS)
        # All-zero means defaults, except probe_worker whose zero is a real worker index: the writer
        # stores probe_worker + 1 so that a fresh segment reads as "any worker".
        record = HealthRecord(*values[:_RECORD_FIELDS])
        return _decode(record)

    def publish(self, slot: int, record: HealthRecord) -> None:
        values = list(astuple(_encode(record))) + _PADDING
        write_record(self._words, self._layout.health_record_word(slot), values)

    def bump_generation(self) -> None:
        self._words[self._header + HEALTH_GENERATION] += 1

    def writer_alive(self, pid: int, now_ns: int) -> None:
        self._words[self._header + WRITER_PID] = pid
        self._words[self._header + WRITER_HEARTBEAT] = now_ns

    def writer(self) -> tuple[int, int]:
        """(pid, heartbeat_ns) of the health process, zeros if none ever ran."""
        return self._words[self._header + WRITER_PID], self._words[self._header + WRITER_HEARTBEAT]

    def stale(self) -> bool:
        """The supervisor judged the verdicts too old to trust (the health process stopped beating)."""
        return bool(self._words[self._header + VERDICTS_STALE])

    def mark_stale(self, stale: bool) -> None:
        """Supervisor only: the verdicts are (no longer) too old to trust."""
        self._words[self._header + VERDICTS_STALE] = int(stale)

    def stale_word(self) -> int:
        """Index of the stale flag in the segment's words (readers fold it into their generation)."""
        return self._header + VERDICTS_STALE


def _encode(record: HealthRecord) -> HealthRecord:
    return replace(record, probe_worker=record.probe_worker + 1)


def _decode(record: HealthRecord) -> HealthRecord:
    return replace(record, probe_worker=record.probe_worker - 1)
