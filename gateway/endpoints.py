"""Endpoints as the balancing/health rooms see them: plain specs, the shared-memory state view the
balancers read, and the ``/admin/endpoints`` report.

The config (gateway.config) is mapped onto these specs by the caller; nothing here imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import add, itemgetter
from typing import Any

from gateway.balancing import (
    DOWN,
    FULL_PERMILLE,
    PROBE,
    ROUTABLE,
    Balancer,
    EndpointRef,
    build_balancer,
)
from shm.counters import (
    FAIL_5XX,
    FAIL_CONNECT,
    FAIL_RESET,
    FAIL_TIMEOUT,
    INFLIGHT,
    REQUESTS,
    HealthRecord,
    HealthTable,
    OutlierState,
    RowsReader,
)
from shm.segment import H_ROWS_IN_USE, Segment
from shm.seqlock import SeqlockBusy


@dataclass(frozen=True, slots=True)
class HealthCheckSpec:
    """Active health check of every endpoint of a cluster."""

    type: str = "http"  # "http" (GET path, expect 2xx) | "tcp" (connect)
    path: str = "/health"
    interval_s: float = 5.0
    timeout_s: float = 2.0
    healthy_threshold: int = 2
    unhealthy_threshold: int = 3
    tls: bool = False
    tls_server_name: str | None = None
    tls_ca_file: str | None = None
    tls_verify: bool = True


@dataclass(frozen=True, slots=True)
class OutlierSpec:
    """Passive health / circuit breaking. ``consecutive_failures=0`` disables ejection."""

    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: int = 50
    probe_reassign_s: float = 2.0  # hand the half-open probe to another worker if it went unused


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    address: str
    weight: int = 1


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    name: str
    endpoints: tuple[EndpointSpec, ...]
    strategy_spec: str | Mapping[str, Any] = "round_robin"
    health_check: HealthCheckSpec | None = None
    outlier: OutlierSpec | None = None
    slow_start_s: float = 10.0  # weight ramp after recovery; 0 disables

    def endpoint_ids(self) -> list[str]:
        return [endpoint_id(self.name, e.address) for e in self.endpoints]


def endpoint_id(cluster: str, address: str) -> str:
    """The stable key of an endpoint's shared-memory slot."""
    return f"{cluster}/{address}"


def all_endpoint_ids(clusters: Iterable[ClusterSpec]) -> list[str]:
    """Every endpoint id of the config, for ``segment.directory.assign`` (supervisor)."""
    return [eid for cluster in clusters for eid in cluster.endpoint_ids()]


def cluster_refs(cluster: ClusterSpec, slot_map: Mapping[str, int]) -> list[EndpointRef]:
    """The balancer's view of a cluster's endpoints; ``slot_map`` from ``segment.directory.slot_map()``."""
    refs = []
    for spec in cluster.endpoints:
        eid = endpoint_id(cluster.name, spec.address)
        if eid not in slot_map:
            raise KeyError(f"endpoint {eid!r} has no shared-memory slot (directory not assigned?)")
        refs.append(EndpointRef(slot_map[eid], spec.address, spec.weight))
    return refs


def build_cluster_balancer(cluster: ClusterSpec, slot_map: Mapping[str, int], view: Any) -> Balancer:
    return build_balancer(cluster.strategy_spec, cluster_refs(cluster, slot_map), view, cluster=cluster.name)


class SharedEndpointState:
    """The balancers' StateView over shared memory, one per worker process.

    ``generation`` combines the health writer's generation word with the rows-in-use mark, so a
    balancer rebuilds its cached candidates and in-flight readers exactly when either changes.
    Half-open probes: a slot reads PROBE only for the worker the health process named in the record
    (or for every worker once, if it named none) and only until this worker hands that probe out.
    """

    def __init__(self, segment: Segment, worker: int) -> None:
        self._words = segment.words
        self._layout = segment.layout
        self._segment = segment
        self._health = HealthTable(segment)
        self._generation_word = self._layout.health_header_word()
        self._worker = worker
        self._offered: dict[int, int] = {}
        self._probed: dict[int, int] = {}
        self._last: dict[int, tuple[int, int]] = {}

    def generation(self) -> int:
        w = self._words
        return (w[self._generation_word] << 11) | w[H_ROWS_IN_USE]

    def slot_health(self, slot: int) -> tuple[int, int]:
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


# -- /admin/endpoints ----------------------------------------------------------------------------

def _strategy_name(spec: str | Mapping[str, Any]) -> tuple[str, str | None]:
    if isinstance(spec, str):
        return spec, None
    ((name, options),) = spec.items()
    header = options.get("header") if isinstance(options, Mapping) else getattr(options, "header", None)
    return name, header


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
    """The ``/admin/endpoints`` document: per cluster and endpoint, health, in-flight, ejection state."""
    now_wall, now_ns = wall_clock(), monotonic_ns()
    health = HealthTable(segment)
    rows = RowsReader(segment)
    slot_map = segment.directory.slot_map()
    writer_pid, writer_beat = health.writer()
    report_clusters = []
    for cluster in clusters:
        strategy, header = _strategy_name(cluster.strategy_spec)
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
            routable += record.routable
            totals = rows.totals(slot)
            state = OutlierState(record.outlier_state)
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
            })
            endpoints.append(entry)
        report_clusters.append({
            "name": cluster.name, "strategy": strategy, "hash_header": header,
            "panic": routable == 0, "healthy_endpoints": routable, "endpoints": endpoints,
        })
    return {
        "health_process": None if not writer_pid else
        {"pid": writer_pid, "heartbeat_age_s": round((now_ns - writer_beat) / 1e9, 3)},
        "clusters": report_clusters,
    }


def cluster_specs_from_config(config: Any) -> list[ClusterSpec]:
    """The config's ``clusters`` (gateway.config structs, duck-typed) as specs for balancers and health."""
    specs = []
    for cluster in config.clusters:
        tls = cluster.tls if not isinstance(cluster.tls, bool) else None
        check, outlier = cluster.health_check, cluster.outlier_detection
        strategy = cluster.load_balancer_strategy
        if not isinstance(strategy, str):
            strategy = {name: {"header": options.header} for name, options in strategy.items()}
        specs.append(ClusterSpec(
            name=cluster.name,
            endpoints=tuple(EndpointSpec(address, weight) for address, weight in cluster.weighted_endpoints()),
            strategy_spec=strategy,
            health_check=None if check is None else HealthCheckSpec(
                type=check.type, path=check.path, interval_s=float(check.interval), timeout_s=float(check.timeout),
                healthy_threshold=check.healthy_threshold, unhealthy_threshold=check.unhealthy_threshold,
                tls=bool(cluster.tls), tls_server_name=tls.sni if tls else None,
                tls_ca_file=tls.ca_file if tls else None, tls_verify=tls.verify if tls else True,
            ),
            outlier=None if outlier is None else OutlierSpec(
                consecutive_failures=outlier.consecutive_failures, base_ejection_s=float(outlier.base_ejection),
                max_ejection_percent=outlier.max_ejection_percent,
            ),
        ))
    return specs
