"""The supervisor's judgement of the health process's heartbeat (gateway.health.watch). Pure, plus the
stale flag it keeps in a real segment, which the workers' endpoint view obeys."""

from __future__ import annotations

from gateway.cluster.balancers.base import DOWN, FULL_PERMILLE, ROUTABLE
from gateway.cluster.shared_view import SharedEndpointState
from gateway.health.watch import (
    BOOT_GRACE_S,
    HUNG_AFTER_S,
    VERDICT_MAX_AGE_S,
    HealthWatch,
    HealthWatchVerdict,
    judge,
)
from shm.counters import HealthRecord, HealthTable
from shm.segment import Segment

S = 1_000_000_000


def test_no_health_process_ever_means_nothing_is_stale() -> None:
    assert judge(0, 0, 100 * S) == HealthWatchVerdict(None, False, False)


def test_a_silent_writer_is_stale_first_and_hung_later() -> None:
    beat = 50 * S
    assert judge(7, beat, beat + S, child_pid=7) == HealthWatchVerdict(1.0, False, False)
    stale = judge(7, beat, beat + int((VERDICT_MAX_AGE_S + 0.5) * S), child_pid=7)
    assert (stale.stale, stale.hung) == (True, False)
    hung = judge(7, beat, beat + int((HUNG_AFTER_S + 0.5) * S), child_pid=7)
    assert (hung.stale, hung.hung) == (True, True)


def test_a_new_child_gets_a_boot_grace_before_its_first_beat() -> None:
    started = 100 * S
    # The last beat is an earlier process's: stale verdicts, but the new child is not hung yet.
    early = judge(6, 90 * S, started + 5 * S, child_pid=7, child_started_ns=started)
    assert (early.stale, early.hung) == (True, False)
    late = judge(6, 90 * S, started + int((BOOT_GRACE_S + 1) * S), child_pid=7, child_started_ns=started)
    assert late.hung


def test_the_watch_keeps_the_flag_the_workers_obey_and_reports_a_hang_once() -> None:
    segment = Segment.create(1, 4)
    table = HealthTable(segment)
    table.publish(0, HealthRecord(active_down=1))
    table.bump_generation()
    view = SharedEndpointState(segment, 0)
    generation = view.generation()
    assert view.slot_health(0) == (DOWN, FULL_PERMILLE)
    table.writer_alive(7, 10 * S)
    watch = HealthWatch(segment)
    now = 10 * S + int((HUNG_AFTER_S + 1) * S)
    assert watch.check(now, child_pid=7).hung
    assert not watch.check(now + S, child_pid=7).hung  # killed once, not every tick
    assert watch.hangs_total == 1 and watch.stale()
    assert view.generation() != generation  # balancers rebuild ...
    assert view.slot_health(0) == (ROUTABLE, FULL_PERMILLE)  # ... and read every endpoint as unknown
    table.writer_alive(8, now + 2 * S)  # a replacement beats
    assert not watch.check(now + 2 * S, child_pid=8).stale
    assert view.slot_health(0) == (DOWN, FULL_PERMILLE)
