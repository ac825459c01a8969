"""The balancers' view of shared memory: health verdicts per worker, in-flight sums over rows."""

from __future__ import annotations

import pytest

from gateway.cluster.balancers.base import DOWN, FULL_PERMILLE, PROBE, ROUTABLE
from gateway.cluster.outlier import OutlierState
from gateway.cluster.shared_view import SharedEndpointState, is_routable
from shm.counters import HealthRecord, HealthTable, WorkerRow
from shm.segment import Segment


def _segment() -> Segment:
    return Segment.create(max_workers=4, max_endpoints=8)


def test_routable_means_actively_up_and_breaker_closed() -> None:
    assert is_routable(HealthRecord())
    assert is_routable(HealthRecord(ramp_permille=200))
    assert not is_routable(HealthRecord(active_down=1))
    assert not is_routable(HealthRecord(outlier_state=OutlierState.EJECTED))
    assert not is_routable(HealthRecord(outlier_state=OutlierState.HALF_OPEN))


def test_fresh_slots_read_routable_at_full_weight_and_verdicts_follow_the_record() -> None:
    segment = _segment()
    view, table = SharedEndpointState(segment, 0), HealthTable(segment)
    assert view.slot_health(4) == (ROUTABLE, FULL_PERMILLE)
    table.publish(4, HealthRecord(active_down=1))
    assert view.slot_health(4) == (DOWN, FULL_PERMILLE)
    table.publish(4, HealthRecord(outlier_state=OutlierState.EJECTED))
    assert view.slot_health(4)[0] == DOWN


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_in_flight_readers_sum_every_row_in_use(rows: int) -> None:
    segment = _segment()
    slots = segment.directory.assign(["a/h:1", "a/h:2", "a/h:3"])
    a, b, c = slots["a/h:1"], slots["a/h:2"], slots["a/h:3"]
    for worker in range(rows):
        segment.claim_worker_row(worker)
        row = WorkerRow(segment, worker)
        for _ in range(worker + 1):
            row.inc_inflight(a)
        row.inc_inflight(c)
    view = SharedEndpointState(segment, 0)
    expected_a = sum(range(1, rows + 1))
    assert view.inflight_getter(a)() == expected_a
    assert view.inflight_getter(b)() == 0
    assert list(view.inflight_reader([b, a, c])()) == [0, expected_a, rows]
    assert list(view.inflight_reader([c])()) == [rows]


def test_in_flight_readers_read_zero_before_any_row_is_in_use() -> None:
    view = SharedEndpointState(_segment(), 0)
    assert view.inflight_getter(1)() == 0
    assert list(view.inflight_reader([1, 2])()) == [0, 0]


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


def test_a_record_left_mid_write_keeps_the_last_verdict_this_worker_read() -> None:
    segment = _segment()
    view, table = SharedEndpointState(segment, 0), HealthTable(segment)
    table.publish(2, HealthRecord(ramp_permille=400))
    assert view.slot_health(2) == (ROUTABLE, 400)
    segment.words[segment.layout.health_record_word(2)] += 1  # the writer died with the record odd
    assert view.slot_health(2) == (ROUTABLE, 400)
    assert view.slot_health(3) == (ROUTABLE, FULL_PERMILLE)
    segment.words[segment.layout.health_record_word(3)] += 1
    assert view.slot_health(3) == (ROUTABLE, FULL_PERMILLE)  # never read: fresh slots start routable
