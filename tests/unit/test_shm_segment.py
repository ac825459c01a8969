from __future__ import annotations

import os

import pytest

from gateway.balancing import DOWN, PROBE, ROUTABLE
from gateway.endpoints import SharedEndpointState
from shm.counters import (
    HealthRecord,
    HealthTable,
    Outcome,
    OutlierState,
    RowsReader,
    WorkerRow,
)
from shm.segment import LAYOUT_VERSION, LINE_BYTES, Segment, ShmCapacityError, ShmLayoutError


def _segment(**extra: int) -> Segment:
    return Segment.create(max_workers=4, max_endpoints=8, extra_regions=extra or None)


def test_header_is_versioned_and_attach_validates_it() -> None:
    segment = _segment(affinity=1000)
    again = Segment.attach(segment.buffer)
    assert again.layout == segment.layout
    assert segment.words[1] == LAYOUT_VERSION
    assert segment.layout.total_size == len(segment.buffer)
    with pytest.raises(ShmLayoutError):
        Segment.attach(bytearray(len(segment.buffer)))


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
    row.record(first["a/h:2"], Outcome.HTTP_5XX)
    second = segment.directory.assign(["b/h:3", "a/h:2", "c/h:4"])  # a/h:1 removed, c/h:4 added
    assert second["a/h:2"] == first["a/h:2"]
    assert second["b/h:3"] == first["b/h:3"]
    assert second["c/h:4"] not in first.values()  # never-used slots are taken before freed ones
    assert row.counters(second["a/h:2"])[1:3] == [1, 0]
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
    assert reader.inflight_total(slot) == 4
    segment.reset_worker_row(1)
    assert reader.inflight_total(slot) == 1
    assert dead.counters(slot) == [0] * 8
    assert alive.inflight(slot) == 1


def test_in_flight_helpers_respect_the_per_worker_limit() -> None:
    segment = _segment()
    row = WorkerRow(segment, 0)
    assert row.try_acquire(2, limit=2) and row.try_acquire(2, limit=2)
    assert not row.try_acquire(2, limit=2)
    row.dec_inflight(2)
    assert row.try_acquire(2, limit=2)
    assert row.inflight(2) == 2


def test_outcomes_count_by_kind_and_a_success_resets_the_streak() -> None:
    row = WorkerRow(_segment(), 0)
    for outcome in (Outcome.CONNECT, Outcome.RESET, Outcome.TIMEOUT, Outcome.HTTP_5XX):
        row.record(5, outcome)
    assert row.counters(5)[1:7] == [4, 1, 1, 1, 1, 4]
    row.record(5, Outcome.OK)
    assert row.counters(5)[1] == 5 and row.counters(5)[6] == 0
    assert Outcome.from_reason(None) is Outcome.OK
    assert Outcome.from_reason("timeout") is Outcome.TIMEOUT
    assert Outcome.from_reason("protocol") is Outcome.RESET


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
    assert RowsReader(segment).inflight_total(slot) == 3
    assert SharedEndpointState(segment, 0).inflight_getter(slot)() == 3
    assert list(SharedEndpointState(segment, 0).inflight_reader([idle, slot])()) == [0, 3]


def test_fresh_health_records_read_as_healthy_and_round_trip() -> None:
    segment = _segment()
    table = HealthTable(segment)
    fresh = table.read(3)
    assert fresh.routable and fresh.probe_worker == -1 and fresh.ramp_permille == 0
    record = HealthRecord(slot_generation=2, outlier_state=OutlierState.HALF_OPEN, probe_worker=0, probe_epoch=4,
                          ejected_until_ns=123, consecutive_failures=5)
    table.publish(3, record)
    assert table.read(3) == record


def test_state_view_generation_follows_health_bumps_and_rows_in_use() -> None:
    segment = _segment()
    view = SharedEndpointState(segment, 0)
    g0 = view.generation()
    HealthTable(segment).bump_generation()
    g1 = view.generation()
    segment.claim_worker_row(2)
    g2 = view.generation()
    assert len({g0, g1, g2}) == 3


def test_state_view_offers_the_half_open_probe_only_to_the_named_worker_and_once() -> None:
    segment = _segment()
    HealthTable(segment).publish(1, HealthRecord(outlier_state=OutlierState.HALF_OPEN, probe_worker=1, probe_epoch=1))
    holder, other = SharedEndpointState(segment, 1), SharedEndpointState(segment, 0)
    assert other.slot_health(1)[0] == DOWN
    assert holder.slot_health(1)[0] == PROBE
    holder.mark_probe_sent(1)
    assert holder.slot_health(1)[0] == DOWN
    HealthTable(segment).publish(1, HealthRecord(outlier_state=OutlierState.HALF_OPEN, probe_worker=1, probe_epoch=2))
    assert holder.slot_health(1)[0] == PROBE  # a new epoch is a new probe
    HealthTable(segment).publish(1, HealthRecord(ramp_permille=300))
    assert holder.slot_health(1) == (ROUTABLE, 300)
