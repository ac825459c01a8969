"""The supervisor's pure bookkeeping and decisions, without processes: rows, backoff, start-up
failures, reload plans, generation swaps, readiness and the metrics cluster registry."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.metrics.catalogue import COUNTERS, MAX_CLUSTERS
from gateway.metrics.labels import LabelRegistry
from gateway.metrics.render import render_prometheus
from gateway.metrics.writer import WorkerMetrics
from gateway.supervisor.generations import SwapStep, plan_reload, swap_step
from gateway.supervisor.lifecycle import Child, PendingGeneration, SlotPool, StartupGuard, max_workers_for
from gateway.supervisor.listeners import ListenerSockets, lowest_free_position
from gateway.supervisor.policy import HEARTBEAT_STALE_AFTER
from gateway.supervisor.readiness import readiness_of, serving_revision
from shm.segment import MAX_WORKERS_LIMIT
from tests.harness import free_port

BASE = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\nworkers: 2\n'


def config(extra: str = ""):
    return parse_config(BASE + extra)


def child(pid: int = 100, *, ready: bool = True, started_at: float = 0.0, heartbeat: float | None = None,
          revision: str | None = "rev-1", generation: int = 1) -> Child:
    record = Child("worker", pid, slot=pid % 10, generation=generation, status_fd=-1, started_at=started_at)
    record.ready, record.revision, record.last_heartbeat = ready, revision, heartbeat
    return record


# --------------------------------------------------------------------------- rows and restarts


def test_slot_pool_reuses_released_rows_lowest_first_and_ignores_foreign_ones():
    pool = SlotPool(4)
    assert [pool.acquire() for _ in range(4)] == [0, 1, 2, 3]
    pool.release(2)
    pool.release(0)
    pool.release(-1)  # the health process has no row
    pool.release(99)
    assert pool.free == 2
    assert [pool.acquire(), pool.acquire()] == [0, 2]


def test_a_worker_takes_the_lowest_free_position_of_its_generation():
    assert lowest_free_position([]) == 0
    assert lowest_free_position([0, 1]) == 2
    assert lowest_free_position([2, 0]) == 1  # a crashed worker's replacement takes its position back


def test_listener_sockets_are_bound_once_per_key_and_closed_when_no_longer_held():
    address = f"127.0.0.1:{free_port()}"
    sockets = ListenerSockets()
    first = sockets.acquire((address, 0))
    assert sockets.acquire((address, 0)) is first
    second = sockets.acquire((address, 1))  # SO_REUSEPORT: one address, a socket per position
    assert sockets.fds(but=(address, 0)) == [second.fileno()]
    sockets.keep_only([(address, 0)])
    assert sockets.keys() == [(address, 0)] and second.fileno() == -1 and first.fileno() >= 0
    sockets.keep_only([])
    assert first.fileno() == -1


def test_shared_memory_is_sized_for_sigttin_headroom_within_the_segment_limit():
    assert max_workers_for(1) == 9  # room for +8 workers
    assert max_workers_for(16) == 32  # or twice the count
    assert max_workers_for(MAX_WORKERS_LIMIT) == MAX_WORKERS_LIMIT  # never below the configured count
    assert 2 * max_workers_for(MAX_WORKERS_LIMIT // 2) <= 2 * MAX_WORKERS_LIMIT


def test_startup_guard_gives_up_at_the_limit():
    guard = StartupGuard(limit=3)
    assert [guard.boot_failed() for _ in range(3)] == [False, False, True]
    assert guard.failures == 3


# --------------------------------------------------------------------------- reload plans


def test_unchanged_config_is_applied_in_place_keeping_the_sigttin_count():
    plan = plan_reload(config(), config(), target=3, max_workers=8, free_rows=0)
    assert (plan.new_generation, plan.workers, plan.admin_moved) == (False, 3, False)


def test_worker_count_and_admin_listener_are_supervisor_side_changes():
    new = parse_config(BASE.replace("workers: 2", "workers: 4") + "admin: {listen: '127.0.0.1:9999'}\n")
    plan = plan_reload(new, config(), target=3, max_workers=8, free_rows=0)
    assert (plan.new_generation, plan.workers, plan.admin_moved) == (False, 4, True)


def test_a_change_workers_care_about_forks_a_generation_of_the_current_size():
    new = config("timeouts: {keepalive_idle: 31s}\n")
    plan = plan_reload(new, config(), target=3, max_workers=8, free_rows=3)
    assert (plan.new_generation, plan.workers, plan.listen_moved, plan.admin_moved) == (True, 3, False, False)
    moved = config("listen: '127.0.0.1:8181'\n")
    assert plan_reload(moved, config(), target=2, max_workers=8, free_rows=8).listen_moved


def test_a_generation_without_free_rows_is_refused():
    new = config("timeouts: {keepalive_idle: 31s}\n")
    with pytest.raises(ConfigError) as refused:
        plan_reload(new, config(), target=3, max_workers=8, free_rows=2)
    assert refused.value.problems == [
        "workers: 3 new workers need shared-memory rows but only 2 are free (older generations are still "
        "draining); retry when they have finished"
    ]


def test_more_workers_than_the_segment_was_sized_for_is_refused_even_in_place():
    new = parse_config(BASE.replace("workers: 2", "workers: 9"))
    with pytest.raises(ConfigError) as refused:
        plan_reload(new, config(), target=2, max_workers=8, free_rows=16)
    assert refused.value.problems[0].startswith("workers: 9 exceeds the 8 the shared memory was sized for")


# --------------------------------------------------------------------------- generation swaps


def pending(workers: int = 2, deadline: float = 60.0) -> PendingGeneration:
    return PendingGeneration(config(), generation=2, deadline=deadline, admin_sock=None, workers=workers)


def test_a_generation_is_promoted_only_when_all_its_workers_are_ready():
    assert swap_step(pending(), [child(1), child(2, ready=False)], now=1.0) is SwapStep.WAIT
    assert swap_step(pending(), [child(1)], now=1.0) is SwapStep.WAIT  # one has not even started
    assert swap_step(pending(), [child(1), child(2)], now=1.0) is SwapStep.PROMOTE


def test_a_late_generation_is_abandoned_but_a_ready_one_still_wins_at_the_deadline():
    assert swap_step(pending(deadline=5.0), [child(1), child(2, ready=False)], now=5.0) is SwapStep.ABANDON
    assert swap_step(pending(deadline=5.0), [child(1), child(2)], now=5.0) is SwapStep.PROMOTE


# --------------------------------------------------------------------------- readiness


def test_readiness_names_what_is_missing():
    assert readiness_of([], now=1.0) == (False, "no worker is running")
    assert readiness_of([child(1), child(2, ready=False)], now=1.0) == (
        False, "1 of 2 workers have not reported ready")
    stale = HEARTBEAT_STALE_AFTER + 1.0
    assert readiness_of([child(1, heartbeat=0.0), child(2, heartbeat=stale)], now=stale) == (
        False, f"worker pid 1 sent no heartbeat for {stale:.1f}s")
    assert readiness_of([child(1, heartbeat=0.5), child(2, heartbeat=0.9)], now=1.0) == (True, "ok")


def test_the_serving_revision_is_the_one_most_ready_workers_report():
    workers = [child(1, revision="new"), child(2, revision="old"), child(3, revision="new"),
               child(4, ready=False, revision="other")]
    assert serving_revision(workers) == "new"
    assert serving_revision([child(1, ready=False)]) is None


# --------------------------------------------------------------------------- the metrics cluster registry


def test_registry_indexes_never_change_meaning_when_clusters_are_reordered_or_removed():
    registry = LabelRegistry(MAX_CLUSTERS)
    assert registry.register(["provider-a", "provider-b"]) == []
    assert registry.register(["provider-c", "provider-b"]) == []  # reordered, a removed, c added
    assert registry.names == ("provider-a", "provider-b", "provider-c")


def test_counts_written_before_and_after_a_reorder_render_under_their_own_cluster():
    registry = LabelRegistry(MAX_CLUSTERS)
    registry.register(["provider-a", "provider-b"])
    row = [0] * COUNTERS
    old_worker = WorkerMetrics(row, registry.names)
    for _ in range(3):
        old_worker.request("provider-a", 200)
    old_worker.request("provider-b", 200)
    registry.register(["provider-b", "provider-a"])  # the reload reorders the config
    new_worker = WorkerMetrics(row, registry.names)
    new_worker.request("provider-a", 200)
    text = render_prometheus(row, registry.names).decode()
    assert 'gridgate_requests_total{cluster="provider-a",code="2xx"} 4.0' in text
    assert 'gridgate_requests_total{cluster="provider-b",code="2xx"} 1.0' in text


def test_clusters_beyond_the_registry_capacity_count_as_other_not_as_the_gateway():
    registry = LabelRegistry(capacity=1)
    assert registry.register(["a", "b", "c"]) == ["b", "c"]
    assert registry.register(["c", "d"]) == ["d"]  # each overflow is reported once
    row = [0] * COUNTERS
    metrics = WorkerMetrics(row, registry.names)
    metrics.request("c", 503)
    metrics.request(None, 404)
    text = render_prometheus(row, registry.names).decode()
    assert 'gridgate_requests_total{cluster="other",code="5xx"} 1.0' in text
    assert 'gridgate_requests_total{cluster="gateway",code="4xx"} 1.0' in text
    assert 'cluster="gateway",code="5xx"' not in text
