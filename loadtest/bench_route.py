"""Microbenchmark of the intelligent route (µs per request, one process).

    .venv/bin/python -m loadtest.bench_route [--requests N]

Cases: capability lookup of a typical chat body; route without affinity (round robin
inside a 3-member group); route with affinity where the session is already bound
(reused); route with affinity for a never-seen session (lookup miss + bind). The table
lives in an anonymous shared mapping, as the supervisor allocates it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import time
from collections.abc import Callable

from gateway.capability import lookup_capability, session_key
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from gateway.routing import Router
from shm.affinity import AffinityTable

CAPABILITIES = 50
MEMBERS = 3
SESSIONS = 4096


def build_snapshot() -> Snapshot:
    candidates = []
    for m in range(CAPABILITIES):
        for group, admission in ((0, "none"), (1, "new_and_existing")):
            for k in range(MEMBERS):
                candidates.append(
                    {
                        "kind": "inference_model",
                        "name": f"model-{m}",
                        "site": f"site-{group}-{k}",
                        "cluster": f"provider-{group}-{k}",
                        "admission_state": admission,
                        "selection_group": group,
                        "score": 0.5 + k / 10,
                    }
                )
    overlay = {"local_site": "bench", "selection_policy": {"mode": "roundRobin"}, "candidates": candidates}
    return snapshot_from_bytes(json.dumps(overlay).encode())


WARMUP = 10_000
RUNS = 3


def measure(label: str, requests: int, step: Callable[[int], object]) -> None:
    """Best of RUNS; ``step`` gets an index that never repeats across warm-up and runs."""
    for i in range(WARMUP):
        step(i)
    best = float("inf")
    for run in range(RUNS):
        first = WARMUP + run * requests
        start = time.perf_counter_ns()
        for i in range(first, first + requests):
            step(i)
        best = min(best, (time.perf_counter_ns() - start) / requests / 1000)
    print(f"{label:<34} {best:6.2f} µs/request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    n = args.requests

    snapshot = build_snapshot()
    capacity = 1 << 16
    table = AffinityTable(memoryview(mmap.mmap(-1, AffinityTable.required_bytes(capacity))), capacity)
    plain = Router(worker_index=0)
    sticky = Router(worker_index=0, affinity=table, affinity_ttl_s=3600.0)
    names = [f"model-{i % CAPABILITIES}" for i in range(1024)]
    bound = [session_key(f"session-{i}".encode()) for i in range(SESSIONS)]
    fresh = [b"fresh-session-%d" % i for i in range(WARMUP + RUNS * n)]
    now = 1000.0
    for i, key in enumerate(bound):
        sticky.route(snapshot, "inference_model", names[i % 1024], key, now)

    body = json.dumps(
        {
            "model": "model-7",
            "max_tokens": 256,
            "stream": True,
            "messages": [{"role": "user", "content": "hi " * 200}],
        }
    ).encode()
    measure("capability lookup (chat body)", n, lambda i: lookup_capability(None, body, b"application/json"))
    measure("route, no affinity", n, lambda i: plain.route(snapshot, "inference_model", names[i & 1023]))
    measure(
        "route, affinity reused",
        n,
        lambda i: sticky.route(
            snapshot, "inference_model", names[(i % SESSIONS) & 1023], bound[i % SESSIONS], now
        ),
    )
    # Each iteration is a never-seen session: lookup miss, pick, bind (evicting when full).
    measure(
        "route, affinity new",
        n,
        lambda i: sticky.route(snapshot, "inference_model", names[i & 1023], fresh[i], now),
    )


if __name__ == "__main__":
    main()
