"""The worker's provider clusters: per cluster its endpoints (each with its keep-alive pool), the
shared-memory balancer that picks among them, and the passive-health and in-flight bookkeeping.

Built once per worker from the config; the request path finds the routed provider's cluster in
``ClusterManager.by_provider``, calls ``pick`` and holds an ``EndpointLease`` on the endpoint for the
attempt (``with cluster.lease(endpoint) as lease``): in flight while held, and what the attempt told
it feeds outlier detection when it ends. Provider selection asks ``routable`` and ``inflight`` by
provider index.
"""

from __future__ import annotations

import os

from gateway.cluster.balancers import build_balancer
from gateway.cluster.balancers.base import DOWN
from gateway.cluster.balancers.hashing import hash_key
from gateway.cluster.outcome import Outcome
from gateway.cluster.shared_view import SharedEndpointState
from gateway.cluster.spec import ClusterSpec, cluster_specs_from_config
from gateway.config import Cluster, Config
from gateway.net import client_tls_context, parse_host_port
from gateway.request.failures import Failure
from shm.counters import WorkerRow
from shm.segment import Segment
from workers.upstream import UpstreamPool

# Passive health: how each upstream failure counts for outlier detection (a malformed response breaks
# the exchange like a reset does; a busy pool says nothing about the endpoint's health).
_OUTCOME_OF = {
    Failure.REFUSED: Outcome.CONNECT,
    Failure.CONNECT_TIMEOUT: Outcome.TIMEOUT,
    Failure.RESET: Outcome.RESET,
    Failure.MALFORMED: Outcome.RESET,
    Failure.TIMEOUT: Outcome.TIMEOUT,
}


def _no_counts() -> list[int]:
    return []


class EndpointLease:
    """One attempt's hold on an endpoint: counted in flight from the pick until the attempt is over
    (a hanging connect attracts no more picks), and its outcome (``answered``/``failed``) recorded for
    outlier detection when it ends. A context manager without generator overhead: two method calls."""

    __slots__ = ("_row", "_slot", "outcome")

    def __init__(self, row: WorkerRow, slot: int) -> None:
        self._row = row
        self._slot = slot
        self.outcome: Outcome | None = None  # None: the attempt says nothing about the endpoint

    def __enter__(self) -> EndpointLease:
        self._row.inc_inflight(self._slot)
        return self

    def __exit__(self, *_: object) -> None:
        row = self._row
        row.dec_inflight(self._slot)
        if self.outcome is not None:
            row.record(self._slot, self.outcome)

    def answered(self, status: int) -> None:
        """A response arrived: a 5xx counts against the endpoint, anything else for it (a 429 is a
        cooling signal, not a failure)."""
        self.outcome = Outcome.HTTP_5XX if status >= 500 else Outcome.OK

    def failed(self, failure: Failure) -> None:
        """No response: a connect failure, a reset, a timeout count against the endpoint (a busy pool
        or a stalled client says nothing about it)."""
        self.outcome = _OUTCOME_OF.get(failure)


class UpstreamEndpoint:
    """One endpoint of a cluster in this worker."""

    __slots__ = ("slot", "address", "weight", "pool", "host_header")

    def __init__(self, slot: int, address: str, weight: int, pool: UpstreamPool) -> None:
        self.slot = slot  # the endpoint's shared-memory slot
        self.address = address
        self.weight = weight
        self.pool = pool
        self.host_header = address.encode()


class UpstreamCluster:
    """One provider cluster in one worker."""

    __slots__ = ("name", "provider", "provider_hop", "auth_headers", "endpoints", "balancer", "pick", "key_header",
                 "hashing", "_row", "_view", "_reader", "_reader_generation")

    def __init__(self, cluster: Cluster, spec: ClusterSpec, provider: int, provider_hop: bool,
                 slot_map: dict[str, int], view: SharedEndpointState, row: WorkerRow, head_wait: float,
                 client_stall: float = 60.0) -> None:
        self.name = cluster.name
        self.provider = provider  # index in the worker's provider table (routing and shared provider state)
        self.provider_hop = provider_hop
        self._row = row
        self._view = view
        self._reader_generation = -1
        self._reader = _no_counts
        self.auth_headers: list[tuple[bytes, bytes]] = []
        if cluster.upstream_auth is not None:
            secret = os.environ.get(cluster.upstream_auth.value_env, "")
            self.auth_headers.append((cluster.upstream_auth.header.lower().encode(), b"Bearer " + secret.encode()))
        tls = spec.tls
        ssl_context = None if tls is None else client_tls_context(ca_file=tls.ca_file, verify=tls.verify)
        sni = None if tls is None else tls.sni
        self.endpoints: list[UpstreamEndpoint] = []
        for endpoint, slot in zip(spec.endpoints, spec.slots(slot_map), strict=True):
            host, port = parse_host_port(endpoint.address)
            pool = UpstreamPool(
                host, port, max_connections=cluster.max_connections,
                connect_timeout=float(cluster.connect_timeout), read_timeout=float(cluster.read_timeout),
                ssl_context=ssl_context, server_hostname=sni or host, head_wait=head_wait,
                client_stall=client_stall,
            )
            self.endpoints.append(UpstreamEndpoint(slot, endpoint.address, endpoint.weight, pool))
        self.balancer = build_balancer(spec.strategy, self.endpoints, view, hash_header=spec.hash_header,
                                       cluster=spec.name)
        # ``pick(key, excluded)``: the balancer hands back one of these endpoint objects (or None);
        # ``excluded`` is None or the endpoints already tried. Bound once: no wrapper call per request.
        self.pick = self.balancer.pick
        self.key_header = self.balancer.key_header
        self.hashing = self.balancer.strategy in ("consistent_hash", "maglev")

    def balance_key(self, keys: dict[bytes, bytes] | None, target: bytes) -> bytes | None:
        """The hashing key of a request (hashing strategies only)."""
        if not self.hashing:
            return None
        header = self.key_header
        return hash_key(keys.get(header) if keys and header else None, target)

    def has_routable_endpoint(self) -> bool:
        """False when every endpoint is unhealthy or ejected (the provider is skipped by selection)."""
        health = self._view.slot_health
        return any(health(endpoint.slot)[0] != DOWN for endpoint in self.endpoints)

    def inflight(self) -> int:
        """Requests in flight to this provider on every worker of the host (least_loaded)."""
        generation = self._view.generation()
        if generation != self._reader_generation:  # rows or health changed: rebuild the cheap reader
            self._reader = self._view.inflight_reader([endpoint.slot for endpoint in self.endpoints])
            self._reader_generation = generation
        return sum(self._reader())

    def lease(self, endpoint: UpstreamEndpoint) -> EndpointLease:
        """Hold ``endpoint`` for one attempt (``with cluster.lease(endpoint) as lease: ...``)."""
        return EndpointLease(self._row, endpoint.slot)

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.pool.close()


class ClusterManager:
    """Every configured cluster of this worker, by name and by provider index."""

    __slots__ = ("_clusters", "by_provider", "provider_index")

    def __init__(self, config: Config, segment: Segment, row: WorkerRow, provider_index: dict[str, int]) -> None:
        hop = set(config.routing.provider_hop_clusters)
        slot_map = segment.directory.slot_map()
        view = SharedEndpointState(segment, row.index)
        retry = config.routing.retry
        head_wait = min(float(retry.deadline), float(retry.first_byte_timeout or retry.deadline))
        client_stall = float(config.timeouts.client_stall)
        self.provider_index = provider_index
        self._clusters = {
            cluster.name: UpstreamCluster(cluster, spec, provider_index[cluster.name], cluster.name in hop, slot_map,
                                          view, row, head_wait, client_stall)
            for cluster, spec in zip(config.clusters, cluster_specs_from_config(config), strict=True)
        }
        self.by_provider: dict[int, UpstreamCluster] = {c.provider: c for c in self._clusters.values()}

    def routable(self, provider: int) -> bool:
        cluster = self.by_provider.get(provider)
        return cluster is not None and cluster.has_routable_endpoint()

    def inflight(self, provider: int) -> int:
        cluster = self.by_provider.get(provider)
        return 0 if cluster is None else cluster.inflight()

    def balance_key_headers(self) -> list[str]:
        return [c.key_header.decode() for c in self._clusters.values() if c.key_header]

    def panic_entries(self) -> dict[str, int]:
        return {name: cluster.balancer.panic_entries for name, cluster in self._clusters.items()}

    def close(self) -> None:
        for cluster in self._clusters.values():
            cluster.close()
