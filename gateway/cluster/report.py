"""The ``/admin/endpoints`` document: per cluster and endpoint, health, in-flight and ejection state."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from gateway.cluster.balancers.base import FULL_PERMILLE
from gateway.cluster.outlier import OutlierState
from gateway.cluster.shared_view import is_routable
from gateway.cluster.spec import ClusterSpec, endpoint_id
from shm.counters import (
    FAIL_5XX,
    FAIL_CONNECT,
    FAIL_RESET,
    FAIL_TIMEOUT,
    INFLIGHT,
    REQUESTS,
    HealthRecord,
    HealthTable,
    RowsReader,
)
from shm.providers import EndpointCooling
from shm.segment import Segment
from shm.seqlock import SeqlockBusy


def _health_word(record: HealthRecord) -> str:
    if record.active_down:
        return "unhealthy"
    if record.outlier_state == OutlierState.EJECTED:
        return "ejected"
    if record.outlier_state == OutlierState.HALF_OPEN:
        return "half_open"
    return "slow_start" if record.ramp_permille else "healthy"


def _iso(wall_s: float) -> str:
    return datetime.fromtimestamp(wall_s, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def endpoints_report(segment: Segment, clusters: Sequence[ClusterSpec], *, wall_clock: Callable[[], float] = time.time,
                     monotonic_ns: Callable[[], int] = time.monotonic_ns) -> dict[str, Any]:
    """The ``/admin/endpoints`` document, read from shared memory (the supervisor serves it)."""
    now_wall, now_ns = wall_clock(), monotonic_ns()
    health = HealthTable(segment)
    rows = RowsReader(segment)
    slot_map = segment.directory.slot_map()
    writer_pid, writer_beat = health.writer()
    cooling = EndpointCooling(segment, 0)  # read only: the latest cooling any worker wrote
    report_clusters = []
    for cluster in clusters:
        endpoints = []
        routable = 0
        for spec in cluster.endpoints:
            slot = slot_map.get(endpoint_id(cluster.name, spec.address))
            entry: dict[str, Any] = {"address": spec.address, "weight": spec.weight, "slot": slot}
            if slot is None:
                entry["health"] = "unknown"
                endpoints.append(entry)
                continue
            try:
                record = health.read(slot)
            except SeqlockBusy:
                record = HealthRecord()
            routable += is_routable(record)
            totals = rows.totals(slot)
            state = OutlierState(record.outlier_state)
            cooled_ns = cooling.cooled_until(slot)  # a 429/503 from it (docs/routing.md#cooling)
            until = None
            if state != OutlierState.CLOSED and record.ejected_until_ns:
                until = _iso(now_wall + (record.ejected_until_ns - now_ns) / 1e9)
            entry.update({
                "health": _health_word(record),
                "active_check": "disabled" if cluster.health_check is None
                else ("down" if record.active_down else "up"),
                "in_flight": totals[INFLIGHT],
                "requests": totals[REQUESTS],
                "failures": {"connect": totals[FAIL_CONNECT], "reset": totals[FAIL_RESET],
                             "timeout": totals[FAIL_TIMEOUT], "5xx": totals[FAIL_5XX]},
                "consecutive_failures": record.consecutive_failures,
                "weight_permille": record.ramp_permille or FULL_PERMILLE,
                "ejection": {"state": state.name.lower(), "until": until, "multiplier": record.ejections,
                             "total": record.total_ejections},
                "cooled_until": _iso(now_wall + (cooled_ns - now_ns) / 1e9) if cooled_ns > now_ns else None,
            })
            endpoints.append(entry)
        report_clusters.append({
            "name": cluster.name, "strategy": cluster.strategy, "hash_header": cluster.hash_header,
            "panic": routable == 0, "healthy_endpoints": routable, "endpoints": endpoints,
        })
    return {
        "health_process": None if not writer_pid else
        {"pid": writer_pid, "heartbeat_age_s": round((now_ns - writer_beat) / 1e9, 3),
         "verdicts_stale": health.stale()},  # too old: workers read every endpoint as unknown (routable)
        "clusters": report_clusters,
    }
