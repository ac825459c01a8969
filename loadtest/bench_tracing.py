"""Microbenchmark of route evidence and tracing on the request path (µs per request, one process).

    .venv/bin/python -m loadtest.bench_tracing [--requests N] [--profile]

Times, with timeit-style loops (best of 3), the code each request adds and nothing else:

- route evidence (``access_log.evidence_sample``): ``route_evidence`` right after a route, for a
  3-candidate round-robin group and a 16-candidate ``least_loaded`` group, and the per-request draw;
- tracing off: the four ``is not None`` checks (begin, attempt start, attempt end, close);
- tracing on, not sampled (what 99 % of requests cost at ``sample: 0.01``): ``Tracer.begin`` saying no;
- tracing on, sampled: begin + one attempt span (with its upstream ``traceparent``) + the request span
  ended with its attributes + the hand-over to the exporter's queue;
- the exporter thread's OTLP/JSON encoding, per span (off the request path, but the worker's CPU).

``--profile`` adds cProfile's call counts per sampled request (what runs, how often).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from collections.abc import Callable

import h11

from gateway.config import Tracing
from gateway.overlay.snapshot import snapshot_from_bytes
from gateway.request.attempts import AttemptResult
from gateway.routing import ProviderView, RouteDecision, Router
from gateway.routing.evidence import route_evidence
from gateway.tracing.otlp import OtlpEncoder
from workers.request_record import RequestRecord
from workers.span_export import SpanExporter
from workers.tracing import Tracer

WARMUP = 10_000
RUNS = 3
CHUNK = 1000  # calls per timed run


class _Endpoint:
    address = "10.0.0.7:8000"


def measure(label: str, requests: int, step: Callable[[int], object]) -> float:
    """µs per call: the best of many short runs (``requests`` calls in all), so a run that the scheduler
    gave the whole CPU wins on a shared machine; ``step`` gets an index."""
    for i in range(min(WARMUP, requests)):
        step(i)
    best = float("inf")
    chunk = max(1, min(CHUNK, requests // RUNS))
    for run in range(max(RUNS, requests // chunk)):
        first = run * chunk
        start = time.perf_counter_ns()
        for i in range(first, first + chunk):
            step(i)
        best = min(best, (time.perf_counter_ns() - start) / chunk / 1000)
    print(f"{label:<52} {best:7.3f} µs/request")
    return best


CHAT_BODY = json.dumps({"model": "m", "max_tokens": 256, "messages": [{"role": "user", "content": "hi " * 80}]}).encode()
CHAT_REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer sk-bench\r\nUser-Agent: OpenAI/Python 1.54.0\r\nAccept: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(CHAT_BODY)) + CHAT_BODY


def h11_parse(raw: bytes) -> None:
    """What the codec does with one request (the data plane's largest per-request cost)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    while type(conn.next_event()) is not h11.EndOfMessage:
        pass


def router_of(members: int, picker: str) -> tuple[Router, object, ProviderView]:
    candidates = [{"kind": "inference_model", "name": "m", "site": f"s{k}", "cluster": f"p{k}", "selection_group": 0}
                  for k in range(members)]
    overlay = {"local_site": "bench", "selection_policy": {"mode": "roundRobin"}, "candidates": candidates}
    snapshot = snapshot_from_bytes(json.dumps(overlay).encode())
    view = ProviderView(members, inflight=lambda provider: provider % 3)
    for provider in range(members):
        view.measured(provider, 0.05 + provider / 1000, 1.0)
    view.down[1] = True  # one unhealthy, one cooled: the evidence has something to count
    view.cooled_until[2] = 1e18
    view.recompute(0.0)
    router = Router(provider_index={f"p{k}": k for k in range(members)}, providers=view, picker=picker)
    return router, snapshot, view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--profile", action="store_true", help="cProfile call counts per sampled request")
    args = parser.parse_args()
    n = args.requests

    print("-- reference: what a request costs anyway (yardsticks measured under the same load)")
    router, snapshot, view = router_of(3, "overlay")
    measure("Router.route (3 candidates, round robin)", n, lambda i: router.route(snapshot, "inference_model", "m"))
    measure("h11: parse a chat request (head + 300 B body)", n, lambda i: h11_parse(CHAT_REQUEST))
    print("-- route evidence")
    for members, picker in ((3, "overlay"), (16, "least_loaded")):
        router, snapshot, view = router_of(members, picker)
        decision = router.route(snapshot, "inference_model", "m")
        assert type(decision) is RouteDecision
        measure(f"route_evidence, {members} candidates, {picker}", n,
                lambda i, d=decision, v=view: route_evidence(d, v, None, None))
    sample, draw = 0.1, random.random
    measure("evidence draw (evidence_sample < 1)", n, lambda i: sample >= 1.0 or (sample > 0.0 and draw() < sample))

    print("-- tracing")
    record = RequestRecord()
    measure("off: four `trace is not None` checks", n, lambda i: (
        record.trace is not None, record.trace is not None, record.trace is not None, record.trace is not None))
    settings = Tracing(endpoint="http://127.0.0.1:9", flush_interval=60.0, queue_size=1_000_000,
                       batch_size=100_000)
    exporter = SpanExporter(settings)  # its thread sleeps through the measurement (60 s, a batch never fills)
    unsampled = Tracer(0.0, exporter)
    headers: dict[bytes, bytes] = {}
    t_start = time.perf_counter()
    measure("on, not sampled: Tracer.begin -> None", n,
            lambda i: unsampled.begin(record, headers, "chat_completions", t_start))
    parent = {b"traceparent": b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}
    measure("on, client traceparent unsampled: begin -> None", n,
            lambda i: unsampled.begin(record, parent, "chat_completions", t_start))

    router, snapshot, view = router_of(3, "overlay")
    decision = router.route(snapshot, "inference_model", "m")
    sampled = Tracer(1.0, exporter)
    endpoint = _Endpoint()
    forward = [(b"content-type", b"application/json"), (b"host", b"gw"), (b"x-request-id", b"abc-1"),
               (b"content-length", b"120")]
    result = AttemptResult(status=200, started=True, first_byte_s=0.05, duration_s=0.2)
    evidence = route_evidence(decision, view, None, None)  # type: ignore[arg-type]

    def traced(i: int) -> None:
        served = RequestRecord(request_id=b"abc-1", tenant="team-a", capability="m", method=b"POST",
                               target=b"/v1/chat/completions", status=200, attempts=1, route=decision,
                               evidence=evidence)
        trace = served.trace = sampled.begin(served, None, "chat_completions", t_start)
        trace.attempt_started(served, endpoint, forward)  # type: ignore[union-attr]
        trace.end(served, result)  # type: ignore[union-attr]
        if len(exporter._queue) >= 1024:  # as the exporter drains it (a batch of 512 spans a second or more)
            exporter._queue.clear()

    on = measure("on, sampled: begin + attempt span + end + queue", n, traced)
    measure("  (of which the RequestRecord the loop builds)", n, lambda i: RequestRecord(
        request_id=b"abc-1", tenant="team-a", capability="m", method=b"POST", target=b"/v1/chat/completions",
        status=200, attempts=1, route=decision, evidence=evidence))
    exporter._queue.clear()
    for i in range(256):
        traced(i + 1)
    batch = list(exporter._queue)
    encoder = OtlpEncoder("gridgate")
    per_batch = measure(f"exporter thread: encode {len(batch)} spans (per batch)", max(1, n // 200),
                        lambda i: encoder.encode(batch))
    print(f"{'  per span':<52} {per_batch / len(batch):7.3f} µs/span")
    print(f"{'  per sampled request (2 spans), all in':<52} {on + 2 * per_batch / len(batch):7.3f} µs/request")
    for rate in (0.01, 1.0):
        print(f"average at sample {rate:<5} (request path)                  "
              f"{rate * on + (1 - rate) * 0.05:7.3f} µs/request (not sampled ~0.05)")

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for i in range(10_000):
            traced(i + 1)
            route_evidence(decision, view, None, None)  # type: ignore[arg-type]
        profile.disable()
        stats = pstats.Stats(profile)
        print("-- cProfile: calls per sampled request (10 000 requests, traced + evidence)")
        rows = sorted(((calls / 10_000, f"{func[0].rsplit('/', 1)[-1]}:{func[1]}({func[2]})")
                       for func, (calls, _, _, _, _) in stats.stats.items()), reverse=True)  # type: ignore[attr-defined]
        for calls, name in rows:
            if calls >= 0.5:
                print(f"  {calls:5.1f}  {name}")
    exporter.close(0.1)


if __name__ == "__main__":
    main()
