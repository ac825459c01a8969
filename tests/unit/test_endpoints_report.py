"""The /admin/endpoints document, read from an in-process shared-memory segment."""

from __future__ import annotations

import msgspec

from gateway.cluster.outcome import Outcome
from gateway.cluster.outlier import OutlierState
from gateway.cluster.report import endpoints_report
from gateway.cluster.spec import ClusterSpec, EndpointSpec, HealthCheckSpec, all_endpoint_ids
from shm.counters import HealthRecord, HealthTable, WorkerRow
from shm.segment import Segment

WALL = 1_700_000_000.0  # 2023-11-14T22:13:20Z
MONO_NS = 5_000_000_000


def _setup() -> tuple[Segment, list[ClusterSpec], dict[str, int]]:
    clusters = [
        ClusterSpec("a", (EndpointSpec("h:1"), EndpointSpec("h:2", 3)), health_check=HealthCheckSpec()),
        ClusterSpec("b", (EndpointSpec("h:3"),), strategy="maglev", hash_header="X-User-Id"),
    ]
    segment = Segment.create(max_workers=2, max_endpoints=8)
    slots = segment.directory.assign(all_endpoint_ids(clusters))
    return segment, clusters, slots


def _report(segment: Segment, clusters: list[ClusterSpec]) -> dict:
    report = endpoints_report(segment, clusters, wall_clock=lambda: WALL, monotonic_ns=lambda: MONO_NS)
    msgspec.json.encode(report)  # served as JSON as it is
    return report


def test_outcomes_and_in_flight_of_every_worker_add_up_per_endpoint() -> None:
    segment, clusters, slots = _setup()
    slot = slots["a/h:1"]
    for worker in (0, 1):
        segment.claim_worker_row(worker)
        row = WorkerRow(segment, worker)
        row.inc_inflight(slot)
        for outcome in (Outcome.OK, Outcome.CONNECT, Outcome.RESET, Outcome.TIMEOUT, Outcome.HTTP_5XX):
            row.record(slot, outcome)
    entry = _report(segment, clusters)["clusters"][0]["endpoints"][0]
    assert entry["in_flight"] == 2 and entry["requests"] == 10
    assert entry["failures"] == {"connect": 2, "reset": 2, "timeout": 2, "5xx": 2}
    assert entry["health"] == "healthy" and entry["active_check"] == "up" and entry["weight_permille"] == 1000


def test_ejection_state_deadline_and_panic_are_reported() -> None:
    segment, clusters, slots = _setup()
    table = HealthTable(segment)
    table.publish(slots["a/h:1"], HealthRecord(outlier_state=OutlierState.EJECTED, ejections=2, total_ejections=5,
                                               ejected_until_ns=MONO_NS + 1_500_000_000, consecutive_failures=5))
    table.publish(slots["a/h:2"], HealthRecord(active_down=1))
    table.publish(slots["b/h:3"], HealthRecord(ramp_permille=250))
    table.writer_alive(4242, MONO_NS - 250_000_000)
    report = _report(segment, clusters)
    a, b = report["clusters"]
    ejected, down = a["endpoints"]
    assert ejected["health"] == "ejected" and ejected["consecutive_failures"] == 5
    assert ejected["ejection"] == {"state": "ejected", "until": "2023-11-14T22:13:21.500Z", "multiplier": 2,
                                   "total": 5}
    assert down["health"] == "unhealthy" and down["active_check"] == "down" and down["weight"] == 3
    assert a["panic"] and a["healthy_endpoints"] == 0 and a["strategy"] == "round_robin"
    assert b["endpoints"][0]["health"] == "slow_start" and b["endpoints"][0]["weight_permille"] == 250
    assert b["endpoints"][0]["active_check"] == "disabled"
    assert not b["panic"] and b["strategy"] == "maglev" and b["hash_header"] == "X-User-Id"
    assert report["health_process"] == {"pid": 4242, "heartbeat_age_s": 0.25, "verdicts_stale": False}


def test_an_endpoint_without_a_slot_is_unknown_and_no_writer_is_none() -> None:
    segment, clusters, _ = _setup()
    added = ClusterSpec("c", (EndpointSpec("h:9"),))
    report = _report(segment, [*clusters, added])
    assert report["clusters"][2]["endpoints"] == [{"address": "h:9", "weight": 1, "slot": None, "health": "unknown"}]
    assert report["health_process"] is None


def test_an_endpoint_cooled_by_a_429_shows_until_when() -> None:
    from shm.providers import EndpointCooling

    segment, clusters, slots = _setup()
    segment.claim_worker_row(0)
    segment.claim_worker_row(1)
    EndpointCooling(segment, 1).cool(slots["a/h:2"], MONO_NS + 2_000_000_000)
    a, _ = _report(segment, clusters)["clusters"]
    assert [e["cooled_until"] for e in a["endpoints"]] == [None, "2023-11-14T22:13:22.000Z"]
