from __future__ import annotations

import os

import pytest

from shm import segment as shm_segment
from shm.counters import (
    CONSECUTIVE,
    FAIL_5XX,
    FAIL_CONNECT,
    FAIL_RESET,
    FAIL_TIMEOUT,
    INFLIGHT,
    REQUESTS,
    HealthRecord,
    HealthTable,
    RowsReader,
    WorkerRow,
)
from shm.segment import LAYOUT_VERSION, LINE_BYTES, Layout, Segment, ShmCapacityError


def _segment(**extra: int) -> Segment:
    return Segment.create(max_workers=4, max_endpoints=8, extra_regions=extra or None)


def layout_from_header(words: memoryview) -> Layout:
    """The layout a segment's header describes (what a process attaching to it would read)."""
    s = shm_segment
    assert words[s.H_MAGIC] == s.MAGIC and words[s.H_VERSION] == LAYOUT_VERSION
    extras = []
    for i in range(words[s.H_EXTRA_COUNT]):
        base = s.H_EXTRAS + 4 * i
        raw = words[base].to_bytes(8, "little") + words[base + 1].to_bytes(8, "little")
        extras.append((raw.rstrip(b"\0").decode(), words[base + 2], words[base + 3]))
    return Layout(words[s.H_MAX_WORKERS], words[s.H_MAX_ENDPOINTS], words[s.H_DIRECTORY], words[s.H_ROWS],
                  words[s.H_ROW_STRIDE], words[s.H_HEALTH], tuple(extras), words[s.H_TOTAL])


def test_the_header_is_versioned_and_describes_the_whole_layout() -> None:
    segment = _segment(affinity=1000)
    assert layout_from_header(segment.words) == segment.layout
    assert segment.words[1] == LAYOUT_VERSION
    assert segment.layout.total_size == len(segment.buffer)


def test_rows_and_regions_are_cache_line_aligned() -> None:
    layout = _segment(affinity=1000).layout
    assert layout.rows_offset % LINE_BYTES == 0
    assert layout.row_stride % LINE_BYTES == 0
    assert layout.health_offset % LINE_BYTES == 0
    assert all(offset % LINE_BYTES == 0 for _, offset, _ in layout.extras)


def test_extra_region_is_carved_with_the_requested_size_and_does_not_overlap_counters() -> None:
    segment = _segment(affinity=1000)
    region = segment.region("affinity")
    assert len(region) == 1000
    region[:] = b"\xff" * 1000
    segment.directory.assign(["a/h:1"])
    row = WorkerRow(segment, 3)
    assert row.counters(7) == [0] * 8
    assert HealthTable(segment).read(7) == HealthRecord()
    with pytest.raises(KeyError):
        segment.region("missing")


def test_capacity_limits_raise_a_clear_error_naming_the_limit() -> None:
    segment = _segment()
    with pytest.raises(ShmCapacityError) as too_many:
        segment.directory.assign([f"c/h:{i}" for i in range(9)])
    assert too_many.value.limit == "max_endpoints"
    assert "max_endpoints=8" in str(too_many.value)
    assert segment.directory.slot_map() == {}  # nothing half-applied
    with pytest.raises(ShmCapacityError) as bad_worker:
        WorkerRow(segment, 4)
    assert bad_worker.value.limit == "max_workers"
    with pytest.raises(ShmCapacityError):
        Segment.create(max_workers=0, max_endpoints=1)
    with pytest.raises(ShmCapacityError) as long_id:
        segment.directory.assign(["c/" + "h" * 300])
    assert long_id.value.limit == "endpoint_id_bytes"


def test_a_reload_that_keeps_an_endpoint_keeps_its_slot_and_its_counters() -> None:
    segment = _segment()
    first = segment.directory.assign(["a/h:1", "a/h:2", "b/h:3"])
    row = WorkerRow(segment, 0)
    row.record(first["a/h:2"], FAIL_5XX)
    second = segment.directory.assign(["b/h:3", "a/h:2", "c/h:4"])  # a/h:1 removed, c/h:4 added
    assert second["a/h:2"] == first["a/h:2"]
    assert second["b/h:3"] == first["b/h:3"]
    assert second["c/h:4"] not in first.values()  # never-used slots are taken before freed ones
    assert row.counters(second["a/h:2"])[REQUESTS] == 1 and row.counters(second["a/h:2"])[FAIL_5XX] == 1
    assert segment.directory.slot_map() == second


def test_a_reused_slot_gets_a_new_generation() -> None:
    segment = Segment.create(max_workers=1, max_endpoints=2)
    first = segment.directory.assign(["a/h:1", "a/h:2"])
    generations = {e.endpoint_id: e.generation for e in segment.directory.entries()}
    second = segment.directory.assign(["a/h:2", "a/h:3"])
    assert second["a/h:3"] == first["a/h:1"]
    entry = {e.endpoint_id: e for e in segment.directory.entries()}["a/h:3"]
    assert entry.generation == generations["a/h:1"] + 1


def test_worker_row_reset_zeroes_in_flight_and_leaves_other_rows_alone() -> None:
    segment = _segment()
    slot = segment.directory.assign(["a/h:1"])["a/h:1"]
    dead, alive = WorkerRow(segment, 1), WorkerRow(segment, 2)
    for w in (1, 2):
        segment.claim_worker_row(w)
    for _ in range(3):
        dead.inc_inflight(slot)
    alive.inc_inflight(slot)
    reader = RowsReader(segment)
    assert reader.totals(slot)[INFLIGHT] == 4
    segment.reset_worker_row(1)
    assert reader.totals(slot)[INFLIGHT] == 1
    assert dead.counters(slot) == [0] * 8
    assert alive.counters(slot)[INFLIGHT] == 1


def test_failures_count_by_their_word_and_a_success_resets_the_streak() -> None:
    row = WorkerRow(_segment(), 0)
    for word in (FAIL_CONNECT, FAIL_RESET, FAIL_TIMEOUT, FAIL_5XX):
        row.record(5, word)
    assert row.counters(5)[REQUESTS : CONSECUTIVE + 1] == [4, 1, 1, 1, 1, 4]
    row.record(5, 0)
    assert row.counters(5)[REQUESTS] == 5 and row.counters(5)[CONSECUTIVE] == 0


def test_counters_are_shared_with_forked_processes() -> None:
    segment = _segment()
    slots = segment.directory.assign(["a/h:1", "a/h:2"])
    slot, idle = slots["a/h:1"], slots["a/h:2"]
    segment.claim_worker_row(0)
    segment.claim_worker_row(1)
    pid = os.fork()
    if pid == 0:
        try:
            WorkerRow(segment, 1).inc_inflight(slot)
            WorkerRow(segment, 1).inc_inflight(slot)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    WorkerRow(segment, 0).inc_inflight(slot)
    assert RowsReader(segment).totals(slot)[INFLIGHT] == 3
    assert RowsReader(segment).totals(idle)[INFLIGHT] == 0


def test_fresh_health_records_read_as_healthy_and_round_trip() -> None:
    segment = _segment()
    table = HealthTable(segment)
    fresh = table.read(3)
    assert fresh == HealthRecord() and fresh.probe_worker == -1 and fresh.ramp_permille == 0
    record = HealthRecord(slot_generation=2, outlier_state=2, probe_worker=0, probe_epoch=4,
                          ejected_until_ns=123, consecutive_failures=5)
    table.publish(3, record)
    assert table.read(3) == record


def test_the_header_holds_eight_extra_regions_and_refuses_a_ninth():
    import pytest

    from shm.segment import MAX_EXTRA_REGIONS

    regions = {f"region-{n}": 64 * (n + 1) for n in range(MAX_EXTRA_REGIONS)}
    segment = Segment.create(2, 4, extra_regions=regions)
    assert MAX_EXTRA_REGIONS == 8 and LAYOUT_VERSION == 2
    for name, size in regions.items():
        view = segment.region(name)
        assert len(view) == size
        view[:] = bytes([len(name)]) * size  # each region is its own: writing one leaves the others
    assert all(bytes(segment.region(name)) == bytes([len(name)]) * size for name, size in regions.items())
    with pytest.raises(ShmCapacityError):
        Segment.create(2, 4, extra_regions={**regions, "one-more": 64})
