"""Microbenchmark of the intelligent route (µs per request, one process).

    .venv/bin/python -m loadtest.bench_route [--requests N]

Cases: capability lookup of a typical chat body; route without affinity (round robin
inside a 3-member group); route with affinity where the session is already bound
(reused); route with affinity for a never-seen session (lookup miss + bind). The table
lives in an anonymous shared mapping, as the supervisor allocates it. Then, at 16 candidates in one
group: each picker, and the eligibility filters (context window, tools, region) with request facts.
"""

from __future__ import annotations

import argparse
import json
import mmap
import time
from collections.abc import Callable

from gateway.config import ModelFacts, ModelMatch
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from gateway.request.capability import lookup_capability, request_features, session_key
from gateway.routing import ProviderView, Router
from gateway.routing.eligibility import TOOLS, FactsTable, Needs
from shm.affinity import AffinityTable

CAPABILITIES = 50
MEMBERS = 3
SESSIONS = 4096
WIDE = 16  # candidates in the one group of the picker cases


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


def wide_snapshot() -> Snapshot:
    candidates = [{"kind": "inference_model", "name": "wide", "site": f"s{k}", "cluster": f"p{k}",
                   "selection_group": 0} for k in range(WIDE)]
    overlay = {"local_site": "bench", "selection_policy": {"mode": "roundRobin"}, "candidates": candidates}
    return snapshot_from_bytes(json.dumps(overlay).encode())


def wide_router(picker: str, facts: FactsTable | None = None) -> Router:
    view = ProviderView(WIDE, inflight=lambda provider: provider % 3)  # as if read from shared memory
    for provider in range(WIDE):
        view.latency[provider] = 0.05 + provider / 1000
    return Router(provider_index={f"p{k}": k for k in range(WIDE)}, providers=view, picker=picker, facts=facts)


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

    wide = wide_snapshot()
    facts = FactsTable([
        ModelFacts(match=ModelMatch(capability="wide", cluster=f"p{k}"), context_window=8192 if k % 4 else 2048,
                   features=["tools"] if k % 2 else [], region="eu" if k % 3 else "us", traffic_weight=1 + k % 3)
        for k in range(WIDE)
    ])
    keys = [b"tenant-%d\x00session-%d" % (i % 64, i) for i in range(1024)]
    for picker in ("overlay", "weighted", "stable_hash", "least_loaded"):
        router = wide_router(picker)
        measure(f"route, {WIDE} candidates, {picker}", n,
                lambda i, r=router: r.route(wide, "inference_model", "wide", key=keys[i & 1023]))
    filtered = wide_router("overlay", facts)
    needs = Needs(tokens=4000, features=TOOLS, regions=frozenset({"eu"}))
    measure(f"route, {WIDE} candidates, filters", n,
            lambda i: filtered.route(wide, "inference_model", "wide", needs=needs))
    tool_body = json.dumps({"model": "wide", "max_tokens": 256, "tools": [{"type": "function"}],
                            "messages": [{"role": "user", "content": "hi " * 200}]}).encode()

    def facts_lookup(_: int) -> object:
        request = lookup_capability(None, tool_body, b"application/json", True)
        return request_features(request.body, b"/v1/chat/completions")  # type: ignore[union-attr]

    measure("capability lookup + request facts", n, facts_lookup)


if __name__ == "__main__":
    main()
