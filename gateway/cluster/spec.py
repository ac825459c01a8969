"""A cluster as plain data (endpoints, strategy, TLS, health check, outlier detection) and the one
mapping from the config onto it. Balancers, the health process, the admin report and the worker all
read these specs, never the config structs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.config import Cluster, Config

Strategy = Literal["round_robin", "least_connections", "p2c", "random", "consistent_hash", "maglev"]


@dataclass(frozen=True, slots=True)
class TlsSpec:
    """TLS towards a cluster's endpoints (requests and health probes alike)."""

    sni: str | None = None  # None: the endpoint's host
    ca_file: str | None = None  # None: the system CAs
    verify: bool = True


@dataclass(frozen=True, slots=True)
class HealthCheckSpec:
    """Active health check of every endpoint of a cluster."""

    type: Literal["http", "tcp"] = "http"  # http: GET path, expect 2xx | tcp: connect
    path: str = "/health"
    interval_s: float = 5.0
    timeout_s: float = 2.0
    healthy_threshold: int = 2
    unhealthy_threshold: int = 3


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
    strategy: Strategy = "round_robin"
    hash_header: str | None = None  # hashing strategies: the header whose value is the key
    tls: TlsSpec | None = None
    health_check: HealthCheckSpec | None = None
    outlier: OutlierSpec | None = None
    slow_start_s: float = 10.0  # weight ramp after recovery; 0 disables

    def endpoint_ids(self) -> list[str]:
        return [endpoint_id(self.name, e.address) for e in self.endpoints]

    def slots(self, slot_map: Mapping[str, int]) -> list[int]:
        """Each endpoint's shared-memory slot, in endpoint order; ``slot_map`` from ``directory.slot_map()``."""
        slots = []
        for eid in self.endpoint_ids():
            if eid not in slot_map:
                raise KeyError(f"endpoint {eid!r} has no shared-memory slot (directory not assigned?)")
            slots.append(slot_map[eid])
        return slots


def endpoint_id(cluster: str, address: str) -> str:
    """The stable key of an endpoint's shared-memory slot."""
    return f"{cluster}/{address}"


def all_endpoint_ids(clusters: Iterable[ClusterSpec]) -> list[str]:
    """Every endpoint id of these clusters, for ``segment.directory.assign`` (supervisor)."""
    return [eid for cluster in clusters for eid in cluster.endpoint_ids()]


def cluster_specs_from_config(config: Config) -> list[ClusterSpec]:
    """The config's ``clusters`` as specs, in config order."""
    return [cluster_spec(cluster) for cluster in config.clusters]


def cluster_spec(cluster: Cluster) -> ClusterSpec:
    strategy = cluster.load_balancer_strategy
    hash_header = None
    if not isinstance(strategy, str):  # {consistent_hash: {header}} or {maglev: {header}}, validated by the config
        ((strategy, options),) = strategy.items()
        hash_header = options.header
    tls = cluster.tls
    check, outlier = cluster.health_check, cluster.outlier_detection
    return ClusterSpec(
        name=cluster.name,
        endpoints=tuple(EndpointSpec(address, weight) for address, weight in cluster.weighted_endpoints()),
        strategy=strategy,  # type: ignore[arg-type]  # the config allows only the Strategy names
        hash_header=hash_header,
        tls=None if tls is False else TlsSpec() if tls is True else TlsSpec(tls.sni, tls.ca_file, tls.verify),
        health_check=None if check is None else HealthCheckSpec(
            type=check.type, path=check.path, interval_s=float(check.interval), timeout_s=float(check.timeout),
            healthy_threshold=check.healthy_threshold, unhealthy_threshold=check.unhealthy_threshold,
        ),
        outlier=None if outlier is None else OutlierSpec(
            consecutive_failures=outlier.consecutive_failures, base_ejection_s=float(outlier.base_ejection),
            max_ejection_percent=outlier.max_ejection_percent,
        ),
    )
