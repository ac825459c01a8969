"""Micro-benchmark of the quota path against the real embedded Valkey.

    .venv/bin/python -m loadtest.bench_quota [--n 20000] [--concurrency 64] [--tcp] [--limits]

Prints µs per operation: authenticate, admit (one Lua round trip; sequential latency, and concurrent
throughput, the admits of one loop tick pipelined into one round trip; wall time and this process's
CPU), settle (reconciliation, pipelined off the request path), and the pure helpers a worker runs
per request (estimate, request rewrite, usage scanning/filtering per SSE chunk). Every admit is decided
in Valkey (no worker-held blocks). ``--limits``: each admit also takes a slot of the rule's request limit
and of its key's own (docs/limits.md): what the one atomic call costs with every kind of limit in it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable

import uvloop

from gateway.identity.auth import Authenticator, KeyIdentity, hash_api_key
from gateway.identity.limits import Limits, RequestLimit
from gateway.quota.gate import Admission, QuotaGate
from gateway.quota.ledger import QuotaLedger
from gateway.quota.rules import Budget, QuotaRule
from gateway.request.estimate import estimate_tokens
from gateway.request.usage import SseUsageFilter, UsageScanner, rewrite_request_for_usage
from gateway.valkey.client import create_client
from gateway.valkey.embedded import EmbeddedValkey

SSE_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"hello"},"finish_reason":null}],"usage":null}\n\n'
)
REQUEST = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"' + b"x" * 2000 + b'"}]}'


def per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


KEYS: dict[str, KeyIdentity] = {}  # --limits: each tenant's key, with a request limit of its own


async def admit(gate: QuotaGate, tenant: str) -> Admission:
    """One admission as a worker makes it: decided at once, or awaited from this tick's batch."""
    admission = gate.admission(tenant, "m", 2048, 256, KEYS.get(tenant))
    assert admission is not None
    return admission if admission.__class__ is Admission else await admission  # type: ignore[misc,return-value]


async def bench_gate(url: str, n: int, concurrency: int, limits: bool = False) -> dict[str, float]:
    tenants = [f"bench-{i}" for i in range(16)]
    requests = (RequestLimit(60, 50_000_000, 50_000_000),) if limits else ()
    rules = [QuotaRule("bench", (Budget(60, 10**15), Budget(86400, 10**15)), 1024, requests=requests)]
    if limits:
        KEYS.update({tenant: KeyIdentity(tenant, f"key-{tenant}", None, Limits(requests=requests)) for tenant in tenants})
    gate = QuotaGate(
        QuotaLedger(create_client(url), reservation_timeout_s=120), rules, reconcile_queue_size=n * 2
    )
    await gate.start()
    results: dict[str, float] = {}
    try:
        for i in range(200):  # warm the connection pool and the script
            gate.settle(await admit(gate, tenants[i % 16]), 100)
        await gate.drain()

        latencies = []
        admissions = []
        for i in range(n):
            start = time.perf_counter()
            admissions.append(await admit(gate, tenants[i % 16]))
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        results["admit sequential, mean"] = statistics.fmean(latencies) * 1e6
        results["admit sequential, p50"] = latencies[len(latencies) // 2] * 1e6
        results["admit sequential, p99"] = latencies[int(len(latencies) * 0.99)] * 1e6

        start = time.perf_counter()
        for admission in admissions:
            gate.settle(admission, 100)
        enqueue = time.perf_counter() - start
        await gate.drain()
        results["settle enqueue (request path)"] = enqueue / n * 1e6
        results["settle reconciled (pipelined), per item"] = (time.perf_counter() - start) / n * 1e6

        async def worker(count: int) -> None:
            for i in range(count):
                gate.settle(await admit(gate, tenants[i % 16]), 100)

        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
        await gate.drain()
        done = (n // concurrency) * concurrency
        results[f"admit+settle x{concurrency} concurrent, per request"] = (
            (time.perf_counter() - start) / done * 1e6
        )
        # This process's CPU only (the worker's cost; Valkey's is its own): steadier on a busy machine.
        results[f"admit+settle x{concurrency} concurrent, gateway CPU per request"] = (
            (time.process_time() - cpu) / done * 1e6
        )
        assert gate.counters.reconcile_failures == 0 and gate.counters.reconcile_drops == 0
    finally:
        await gate.close()
    return results


def bench_pure(n: int) -> dict[str, float]:
    auth = Authenticator([(f"team-{i}", hash_api_key(f"sk-{i:040d}")) for i in range(1000)])
    header = b"Bearer sk-" + b"%040d" % 500
    scanner = UsageScanner()
    sse = SseUsageFilter()
    return {
        "authenticate (1000 keys)": per_call_us(lambda: auth.authenticate(header, None), n),
        "estimate_tokens": per_call_us(lambda: estimate_tokens(2048, None, 256, 1024), n),
        "rewrite_request_for_usage (2 KB body)": per_call_us(lambda: rewrite_request_for_usage(REQUEST), n),
        "UsageScanner.feed per SSE chunk": per_call_us(lambda: scanner.feed(SSE_CHUNK), n),
        "SseUsageFilter.feed per SSE chunk": per_call_us(lambda: sse.feed(SSE_CHUNK), n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tcp", action="store_true", help="loopback TCP instead of the unix socket")
    parser.add_argument("--limits", action="store_true", help="a request limit on the rule and on each key too")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="gg-bench-") as data_dir:
        server = EmbeddedValkey(data_dir, unix_socket=not args.tcp)
        url = server.start()
        try:
            results = bench_pure(args.n)
            results |= uvloop.run(bench_gate(url, args.n, args.concurrency, args.limits))
        finally:
            server.stop()
    transport = "tcp loopback" if args.tcp else "unix socket"
    limits = ", a request limit on the rule and the key" if args.limits else ""
    print(f"quota path, embedded valkey over {transport}, n={args.n}, uvloop{limits}")
    for name, us in results.items():
        print(f"  {name:<48} {us:9.2f} µs")


if __name__ == "__main__":
    main()
