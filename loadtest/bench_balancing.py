"""Micro-benchmark: microseconds per endpoint pick, per strategy, over real shared memory.

    .venv/bin/python -m loadtest.bench_balancing [--picks N]

Two worker rows are in use (the least-connections and p2c strategies sum both) and every endpoint
carries some in-flight load; the hot-path in-flight inc/dec and outcome record are measured too.
"""

from __future__ import annotations

import argparse
import time

from gateway.cluster.balancers import build_balancer
from gateway.cluster.outcome import Outcome
from gateway.cluster.shared_view import SharedEndpointState
from shm.counters import WorkerRow
from shm.segment import Segment

STRATEGIES = ["round_robin", "least_connections", "p2c", "random", "consistent_hash", "maglev"]


class BenchEndpoint:
    """Shaped like the worker's endpoint objects (slotted, identity hash): what balancers hand back."""

    __slots__ = ("slot", "address", "weight")

    def __init__(self, slot: int, address: str, weight: int) -> None:
        self.slot, self.address, self.weight = slot, address, weight


def _segment(endpoints: int) -> tuple[Segment, list[BenchEndpoint], WorkerRow]:
    segment = Segment.create(max_workers=4, max_endpoints=max(64, endpoints))
    slots = segment.directory.assign(f"bench/10.0.{i // 250}.{i % 250}:8000" for i in range(endpoints))
    refs = [BenchEndpoint(slot, eid.split("/", 1)[1], 1 + slot % 3) for eid, slot in slots.items()]
    rows = [WorkerRow(segment, w) for w in range(2)]
    for w, row in enumerate(rows):
        segment.claim_worker_row(w)
        for ref in refs:
            for _ in range((ref.slot * 7 + w) % 5):
                row.inc_inflight(ref.slot)
    return segment, refs, rows[0]


def bench_pick(strategy: str, endpoints: int, picks: int, repeats: int = 3) -> float:
    """Best of ``repeats`` runs: the figure least disturbed by other load on the machine."""
    segment, refs, _ = _segment(endpoints)
    balancer = build_balancer(strategy, refs, SharedEndpointState(segment, 0), hash_header="X-User-Id")
    keys = [b"user-%d" % i for i in range(1024)]
    pick = balancer.pick
    for key in keys:  # warm up (first pick builds the cached candidates)
        pick(key)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(picks):
            pick(keys[i & 1023])
        best = min(best, time.perf_counter() - start)
    return best / picks * 1e6


def bench_hot_path(operations: int) -> dict[str, float]:
    _, refs, row = _segment(16)
    slot = refs[3].slot
    inc, dec, record = row.inc_inflight, row.dec_inflight, row.record
    start = time.perf_counter()
    for _ in range(operations):
        inc(slot)
        dec(slot)
    pair = (time.perf_counter() - start) / operations * 1e9
    start = time.perf_counter()
    for _ in range(operations):
        record(slot, Outcome.OK)
    recorded = (time.perf_counter() - start) / operations * 1e9
    return {"inc+dec in-flight (ns/pair)": pair, "record outcome (ns)": recorded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--picks", type=int, default=100_000)
    args = parser.parse_args()
    sizes = (4, 16, 64)
    print(f"{'strategy':<20}" + "".join(f"{n:>10} ep" for n in sizes) + "   (us/pick, 2 worker rows)")
    for name in STRATEGIES:
        figures = [bench_pick(name, n, args.picks) for n in sizes]
        print(f"{name:<20}" + "".join(f"{f:>13.2f}" for f in figures))
    for label, value in bench_hot_path(args.picks).items():
        print(f"{label:<30}{value:>8.0f}")


if __name__ == "__main__":
    main()
