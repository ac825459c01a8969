from __future__ import annotations

import pytest

from gateway.cluster.outlier import ClusterBreakers, OutlierState, WorkerSample, slow_start_permille
from gateway.cluster.spec import OutlierSpec

SPEC = OutlierSpec(consecutive_failures=5, base_ejection_s=10.0, max_ejection_s=25.0, max_ejection_percent=50,
                   probe_reassign_s=2.0)


class Rows:
    """Per-worker counters of endpoints, as the workers would count them."""

    def __init__(self, slots: list[int], workers: int = 2) -> None:
        self.lines = {s: [[0, 0, 0, 0] for _ in range(workers)] for s in slots}  # requests, failures, streak, inflight

    def fail(self, slot: int, worker: int, times: int = 1) -> None:
        line = self.lines[slot][worker]
        line[0] += times
        line[1] += times
        line[2] += times

    def succeed(self, slot: int, worker: int) -> None:
        line = self.lines[slot][worker]
        line[0] += 1
        line[2] = 0

    def samples(self) -> dict[int, list[WorkerSample]]:
        return {s: [WorkerSample(*line) for line in rows] for s, rows in self.lines.items()}


def _cluster(n: int = 4, spec: OutlierSpec = SPEC) -> tuple[ClusterBreakers, Rows]:
    breakers = ClusterBreakers(spec, list(range(n)))
    rows = Rows(list(range(n)))
    breakers.update(0.0, rows.samples(), [0, 1])
    return breakers, rows


def test_ejects_after_consecutive_failures_summed_over_workers() -> None:
    breakers, rows = _cluster()
    rows.fail(0, worker=0, times=3)
    rows.fail(0, worker=1, times=1)
    breakers.update(1.0, rows.samples(), [0, 1])
    assert breakers.breakers[0].state == OutlierState.CLOSED
    assert breakers.breakers[0].consecutive == 4
    rows.fail(0, worker=1)
    assert breakers.update(1.1, rows.samples(), [0, 1]) == {0}
    b = breakers.breakers[0]
    assert b.state == OutlierState.EJECTED and b.ejected_until == pytest.approx(11.1)


def test_a_success_resets_only_that_workers_streak() -> None:
    breakers, rows = _cluster()
    rows.fail(0, worker=0, times=4)
    rows.fail(0, worker=1, times=3)
    rows.succeed(0, worker=1)
    breakers.update(1.0, rows.samples(), [0, 1])
    assert breakers.breakers[0].consecutive == 4
    assert breakers.breakers[0].state == OutlierState.CLOSED


def test_half_open_success_closes_and_starts_slow_start() -> None:
    breakers, rows = _cluster()
    rows.fail(1, worker=0, times=5)
    breakers.update(1.0, rows.samples(), [0, 1])
    breakers.update(10.0, rows.samples(), [0, 1])
    assert breakers.breakers[1].state == OutlierState.EJECTED
    breakers.update(11.0, rows.samples(), [0, 1])
    b = breakers.breakers[1]
    assert b.state == OutlierState.HALF_OPEN and b.probe_worker in (0, 1) and b.probe_epoch == 1
    rows.succeed(1, worker=b.probe_worker)
    breakers.update(11.1, rows.samples(), [0, 1])
    assert b.state == OutlierState.CLOSED and b.recovered_at == 11.1


def test_old_streaks_of_other_workers_do_not_re_trip_a_recovered_endpoint() -> None:
    breakers, rows = _cluster()
    rows.fail(1, worker=0, times=3)
    rows.fail(1, worker=1, times=2)
    breakers.update(1.0, rows.samples(), [0, 1])
    breakers.update(11.0, rows.samples(), [1])  # half-open, probe for worker 1
    rows.succeed(1, worker=1)
    breakers.update(11.1, rows.samples(), [1])
    assert breakers.breakers[1].state == OutlierState.CLOSED
    rows.fail(1, worker=0, times=4)  # worker 0's streak is now 7, but only 4 are new
    breakers.update(11.2, rows.samples(), [1])
    assert breakers.breakers[1].consecutive == 4
    assert breakers.breakers[1].state == OutlierState.CLOSED
    rows.fail(1, worker=1)
    breakers.update(11.3, rows.samples(), [1])
    assert breakers.breakers[1].state == OutlierState.EJECTED


def test_failed_probes_eject_for_growing_capped_times_never_shortening() -> None:
    breakers, rows = _cluster()
    rows.fail(2, worker=0, times=5)
    breakers.update(1.0, rows.samples(), [0])
    b = breakers.breakers[2]
    durations = [b.ejected_until - 1.0]
    now = 1.0
    for _ in range(3):
        now = b.ejected_until
        breakers.update(now, rows.samples(), [0])  # -> half-open
        assert b.state == OutlierState.HALF_OPEN
        rows.fail(2, worker=0)  # the probe fails
        deadline_before = b.ejected_until
        breakers.update(now + 0.1, rows.samples(), [0])
        assert b.state == OutlierState.EJECTED
        assert b.ejected_until >= deadline_before
        durations.append(b.ejected_until - (now + 0.1))
    assert durations == pytest.approx([10.0, 20.0, 25.0, 25.0])
    assert b.total_ejections == 4


def test_ejection_multiplier_decays_after_trip_free_service() -> None:
    breakers, rows = _cluster()
    rows.fail(0, worker=0, times=5)
    breakers.update(1.0, rows.samples(), [0])
    breakers.update(11.0, rows.samples(), [0])
    rows.succeed(0, worker=0)
    breakers.update(11.5, rows.samples(), [0])
    assert breakers.breakers[0].ejections == 1
    breakers.update(21.6, rows.samples(), [0])
    assert breakers.breakers[0].ejections == 0


def test_ejection_cap_limits_the_share_of_a_cluster_ejected_at_once() -> None:
    breakers, rows = _cluster(n=4)
    for slot in range(4):
        rows.fail(slot, worker=0, times=5)
    breakers.update(1.0, rows.samples(), [0])
    states = [b.state for b in breakers.breakers.values()]
    assert states.count(OutlierState.EJECTED) == 2
    assert breakers.cap_blocked_trips == 2
    single, rows1 = _cluster(n=1)
    rows1.fail(0, worker=0, times=5)
    single.update(1.0, rows1.samples(), [0])
    assert single.breakers[0].state == OutlierState.EJECTED  # the cap is at least one endpoint


def test_half_open_probe_moves_to_another_worker_if_the_holder_sends_nothing() -> None:
    breakers, rows = _cluster()
    rows.fail(3, worker=0, times=5)
    breakers.update(1.0, rows.samples(), [0, 1])
    breakers.update(11.0, rows.samples(), [0, 1])
    b = breakers.breakers[3]
    first_holder, first_epoch = b.probe_worker, b.probe_epoch
    breakers.update(12.0, rows.samples(), [0, 1])
    assert b.probe_worker == first_holder  # not yet
    rows.lines[3][first_holder][3] = 1  # the holder's probe is in flight: keep waiting
    breakers.update(13.5, rows.samples(), [0, 1])
    assert b.probe_epoch == first_epoch
    rows.lines[3][first_holder][3] = 0
    breakers.update(13.6, rows.samples(), [0, 1])
    assert b.probe_worker != first_holder and b.probe_epoch == first_epoch + 1


def test_disabled_detection_counts_streaks_but_never_ejects() -> None:
    breakers, rows = _cluster(spec=OutlierSpec(consecutive_failures=0))
    rows.fail(0, worker=0, times=50)
    breakers.update(1.0, rows.samples(), [0])
    assert breakers.breakers[0].state == OutlierState.CLOSED
    assert breakers.breakers[0].consecutive == 50


def test_a_reset_worker_row_counts_from_zero() -> None:
    breakers, rows = _cluster()
    rows.fail(0, worker=1, times=3)
    breakers.update(1.0, rows.samples(), [0])
    rows.lines[0][1] = [0, 0, 0, 0]  # the supervisor reset a dead worker's row
    rows.fail(0, worker=1, times=2)
    breakers.update(1.1, rows.samples(), [0])
    assert breakers.breakers[0].consecutive == 2


def test_slow_start_ramps_in_steps_to_full_weight() -> None:
    assert slow_start_permille(0.0, 10.0) == 100
    assert slow_start_permille(3.5, 10.0) == 300
    assert slow_start_permille(9.99, 10.0) == 900
    assert slow_start_permille(10.0, 10.0) == 0  # full weight
    assert slow_start_permille(1.0, 0.0) == 0  # disabled


def test_streaks_from_before_a_restart_count_only_for_adopted_endpoints() -> None:
    rows = Rows([0, 1])
    rows.fail(0, worker=0, times=4)
    rows.fail(1, worker=0, times=4)
    breakers = ClusterBreakers(SPEC, [0, 1])
    breakers.adopt(0, OutlierState.CLOSED, 0, 0.0, 0, 0)  # slot 0: same endpoint as before the restart
    breakers.update(0.0, rows.samples(), [0])
    assert breakers.breakers[0].consecutive == 4
    assert breakers.breakers[1].consecutive == 0  # slot 1 was reassigned: its old streak is not ours
