"""The host's shared-memory segment as gridgate lays it out: endpoint rows plus five extra regions.

Created once by the supervisor before it forks (or privately by a worker run on its own for
profiling). Capacities are fixed for the segment's life, so they leave room for reloads.
"""

from __future__ import annotations

from gateway.cluster.spec import all_endpoint_ids, cluster_specs_from_config
from gateway.config import Config
from gateway.metrics.catalogue import COUNTERS, MAX_CLUSTERS
from shm.affinity import AffinityTable
from shm.conformance import ConformanceFlags
from shm.metrics import MetricsTable
from shm.prefixes import PrefixCells
from shm.providers import ProviderCells
from shm.segment import Segment

# Extra regions of the segment (names travel to workers in the WorkerContext).
AFFINITY_REGION = "affinity"
METRICS_REGION = "metrics"  # shm.metrics.MetricsTable: one gateway.metrics counter row per worker slot
PROVIDERS_REGION = "providers"  # shm.providers.ProviderCells: cooling and latency per provider, per worker
# shm.conformance.ConformanceFlags: providers the supervisor's conformance checks keep out of selection
CONFORMANCE_REGION = "conformance"
# shm.prefixes.PrefixCells: prefix affinity's placements, one row per worker slot (routing.prefix_affinity)
PREFIXES_REGION = "prefixes"
MAX_PROVIDERS = MAX_CLUSTERS


def endpoint_capacity(config: Config) -> int:
    # Reloads may add endpoints; the segment cannot grow after fork, so leave headroom.
    configured = sum(len(cluster.endpoints) for cluster in config.clusters)
    return max(256, 4 * configured)


def create_segment(config: Config, worker_rows: int) -> Segment:
    """The shared-memory segment (anonymous mmap, inherited by every fork)."""
    regions = {
        AFFINITY_REGION: AffinityTable.required_bytes(config.routing.session_affinity.capacity),
        METRICS_REGION: MetricsTable.required_bytes(worker_rows, COUNTERS),
        PROVIDERS_REGION: ProviderCells.required_bytes(worker_rows, MAX_PROVIDERS),
        CONFORMANCE_REGION: ConformanceFlags.required_bytes(MAX_PROVIDERS),
        # Carved whether prefix affinity is on or not (a reload may turn it on); pages never written cost no memory.
        PREFIXES_REGION: PrefixCells.required_bytes(worker_rows, prefix_slots(config)),
    }
    segment = Segment.create(worker_rows, endpoint_capacity(config), extra_regions=regions)
    PrefixCells(segment.region(PREFIXES_REGION), worker_rows, prefix_slots(config))  # writes its header
    return segment


def prefix_slots(config: Config) -> int:
    """The prefix table's slots for the segment's life (``table_size`` at start; a reload keeps them)."""
    return config.routing.prefix_affinity.table_size


def endpoint_ids(*configs: Config) -> list[str]:
    """Every endpoint id of these configs: their shared-memory slots (kept across reloads by id)."""
    return list(dict.fromkeys(eid for config in configs for eid in all_endpoint_ids(cluster_specs_from_config(config))))
