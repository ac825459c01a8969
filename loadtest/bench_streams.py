"""Many concurrent slow SSE streams through one gateway worker, and the first-token overhead under them.

    .venv/bin/python -m loadtest.bench_streams [--streams 10000] [--probe-at 1000] [--probes 400]
        [--tokens-per-s 0.2] [--stream-s 90] [--ramp-per-s 500] [--gateway-core 0 --load-core 1]

Also run by `loadtest.bench_core` as its scenario (e). One gateway worker pinned to the gateway core;
the mock providers, a helper process that holds the streams open, and the probing client on the
load core. Two phases:

1. `--probe-at` streams held open (each a chat completion paced at `--tokens-per-s`), then
   first-token probes, alternately through the gateway and straight to a mock (the mock holds its
   share of the streams either way). A probe opens a connection, sends a streamed completion, and
   stops the clock at the first content token. **Gateway first-token overhead** = the gateway's
   percentile minus the direct percentile (p50 - p50, p99 - p99): what the gateway adds to the time
   to first token, with the client, loopback and mock costs on both sides of the subtraction. The
   `x-gridgate-overhead-ms` header of the gateway probes (request in -> upstream request written)
   is reported beside it: the rest of the difference is the relay of the first chunk and the accept.
2. `--streams` streams held open at once: errors by kind, worker RSS when all are open (and its
   peak, sampled every second), upstream requests in flight then, and the worker's CPU time.

"Slow" is 0.2 tokens/s per stream by default: 10,000 streams are then 2,000 relayed events a second,
which one worker relays with room to spare, so the scenario measures holding connections (memory,
descriptors, timers, accepting at 500 new streams a second), not relay throughput (that is (a) of
bench_core). The host's load average is recorded beside the figures: on a shared machine the
first-token percentiles move with it.

The file-descriptor limit is raised inside this process only (children inherit it): the worker
needs two sockets per stream. The product's defaults are not touched; loadtest/README.md lists the
sysctls that matter for this many connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import uvloop

from loadtest.bare_pipe import start_bare_pipe_process
from loadtest.mock_provider import MockProviderHandle, terminate
from loadtest.report import (
    invocation,
    markdown_table,
    process_cpu_s,
    summarize,
    write_report,
)
from loadtest.topology import (
    BENCH_CONFIG,
    CHAT_PATH,
    GatewayProcess,
    Topology,
    add_core_arguments,
    free_port,
    move_to_free_ports,
    pin_self,
    raise_fd_limit,
    split_cores,
    start_mocks,
    stop_all,
    upstream_in_flight,
    write_derived_config,
)

FIRST_CONTENT = re.compile(rb'"content":"[^"]')  # a non-empty content delta: the first token
OVERHEAD_HEADER = re.compile(rb"\r\nx-gridgate-overhead-ms: ([\d.]+)", re.I)
RAMP_BATCH = 20  # connects per tick: bursts well under a 100-connection listen backlog


def wanted_fd_limit(streams: int) -> int:
    """The worker holds a client and an upstream socket per stream, plus its own files."""
    return 2 * streams + 4096


def stream_request(host: str, tokens: int, tokens_per_s: float, close: bool = True) -> bytes:
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "Tell me a slow story."}]}).encode()
    head = (f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Mock-Tokens: {tokens}\r\nX-Mock-Tokens-Per-S: {tokens_per_s}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + body


# --------------------------------------------------------------------------------------------------
# The stream holder (a helper process, so holding streams does not delay the probes' client)


@dataclass
class StreamOutcome:
    ok: int = 0
    started: int = 0  # streams whose response head arrived
    errors: Counter[str] = field(default_factory=Counter)
    durations_s: list[float] = field(default_factory=list)


async def one_stream(address: tuple[str, int], request: bytes, tokens: int, timeout: float,
                     outcome: StreamOutcome) -> None:
    began = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout)
    except (TimeoutError, OSError) as exc:
        outcome.errors["connect: " + type(exc).__name__] += 1
        return
    chunks: list[bytes] = []
    try:
        writer.write(request)
        first = await asyncio.wait_for(reader.read(65536), timeout)
        if first:
            outcome.started += 1
            chunks.append(first)
            while chunk := await asyncio.wait_for(reader.read(65536), timeout):
                chunks.append(chunk)
    except (TimeoutError, OSError) as exc:
        outcome.errors["read: " + type(exc).__name__] += 1
        return
    finally:
        writer.close()
    data = b"".join(chunks)
    if not data.startswith(b"HTTP/1.1 200"):
        outcome.errors["status " + data[9:12].decode(errors="replace")] += 1
    elif b"data: [DONE]" not in data or data.count(b'"content":"') < tokens:
        outcome.errors["incomplete stream"] += 1
    else:
        outcome.ok += 1
        outcome.durations_s.append(time.monotonic() - began)


async def hold_streams(address: tuple[str, int], count: int, tokens: int, tokens_per_s: float, ramp_per_s: float,
                       report: Connection) -> None:
    """Open `count` streams (ramped), say 'open' once every one has its head, then 'done' with the outcome."""
    request = stream_request(address[0], tokens, tokens_per_s)
    outcome = StreamOutcome()
    timeout = tokens / tokens_per_s + 60
    began = time.monotonic()
    tasks = []
    for index in range(count):
        tasks.append(asyncio.ensure_future(one_stream(address, request, tokens, timeout, outcome)))
        if index % RAMP_BATCH == RAMP_BATCH - 1:
            await asyncio.sleep(RAMP_BATCH / ramp_per_s)
    while outcome.started + sum(outcome.errors.values()) < count and not all(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    report.send({"event": "open", "after_s": round(time.monotonic() - began, 2), "started": outcome.started})
    await asyncio.gather(*tasks)
    report.send({"event": "done", "streams": count, "ok": outcome.ok, "errors": dict(outcome.errors),
                 "wall_s": round(time.monotonic() - began, 2), "duration_s": summarize(outcome.durations_s)})


def holder_main(address: tuple[str, int], count: int, tokens: int, tokens_per_s: float, ramp_per_s: float,
                report: Connection) -> None:
    uvloop.run(hold_streams(address, count, tokens, tokens_per_s, ramp_per_s, report))


class StreamHolder:
    """`count` slow streams held open by a forked helper process."""

    def __init__(self, address: tuple[str, int], count: int, tokens: int, tokens_per_s: float,
                 ramp_per_s: float) -> None:
        context = multiprocessing.get_context("fork")
        self.receiver, sender = context.Pipe(duplex=False)
        self.process = context.Process(target=holder_main, daemon=True,
                                       args=(address, count, tokens, tokens_per_s, ramp_per_s, sender))
        self.process.start()
        sender.close()

    def wait(self, event: str, timeout: float) -> dict[str, Any] | None:
        """The holder's message `event` (earlier ones, late, are skipped); None if it did not come in time."""
        deadline = time.monotonic() + timeout
        while self.receiver.poll(max(0.0, deadline - time.monotonic())):
            message = self.receiver.recv()
            if message["event"] == event:
                return message
        return None

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(5)


# --------------------------------------------------------------------------------------------------
# First-token probes


STAMP = re.compile(rb'"mock_sent_ns":"(\d{19})"')
RESPONSE_END = b"0\r\n\r\n"


def probe_request(host: str, ttft_ms: float) -> bytes:
    """A one-token stream on a kept-alive connection whose token the mock stamps as it writes it."""
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "One token, please."}]}).encode()
    return (f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Mock-Tokens: 1\r\nX-Mock-Stamp: 1\r\n"
            f"X-Mock-TTFT-Ms: {ttft_ms}\r\n\r\n").encode() + body


@dataclass
class ProbeTimes:
    relay_ms: list[float] = field(default_factory=list)  # the mock writing the token -> the client reading it
    request_ms: list[float] = field(default_factory=list)  # the client writing the request -> reading the token


async def first_token(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes,
                      times: ProbeTimes) -> bool:
    """One probe on a kept-alive connection: both clocks, then the rest; False when the server closes."""
    sent_ns = time.monotonic_ns()
    writer.write(request)
    received = b""
    while (stamp := STAMP.search(received)) is None:
        chunk = await reader.read(65536)
        if not chunk:
            raise ConnectionError("closed before the first token")
        received += chunk
    arrived_ns = time.monotonic_ns()
    times.relay_ms.append((arrived_ns - int(stamp.group(1))) / 1e6)
    times.request_ms.append((arrived_ns - sent_ns) / 1e6)
    while not received.endswith(RESPONSE_END):
        chunk = await reader.read(65536)
        if not chunk:
            raise ConnectionError("closed before the end of the stream")
        received += chunk
    return b"\r\nconnection: close\r\n" not in received[:received.find(b"\r\n\r\n")].lower()


def overhead(gateway: dict[str, Any], direct: dict[str, Any]) -> dict[str, float]:
    return {p: round(gateway[p] - direct[p], 3) for p in ("p50", "p99", "p999")}


async def probe(gateway: tuple[str, int], direct: tuple[str, int], pipe: tuple[str, int], count: int,
                gap_s: float, ttft_ms: float = 2.0) -> dict[str, Any]:
    """Alternate gateway, pipe and direct probes on one kept-alive connection each; percentiles, differences.

    The mock stamps the token with CLOCK_MONOTONIC as it writes it (one clock for every process of the
    host), so `relay` is the time from the provider's byte leaving to the client holding it: loopback and
    the client's wake-up on the direct path, plus the gateway's read, relay and write on the other. The
    pipe (loadtest/bare_pipe.py, on the gateway's core) is the same hop with no code in it.
    """
    addresses = {"gateway": gateway, "pipe": pipe, "direct": direct}
    times = {path: ProbeTimes() for path in addresses}
    errors: Counter[str] = Counter()
    request = probe_request(gateway[0], ttft_ms)
    connections = {path: await asyncio.open_connection(*address) for path, address in addresses.items()}
    try:
        for _ in range(count):
            for path, (reader, writer) in list(connections.items()):
                try:
                    if await first_token(reader, writer, request, times[path]):
                        await asyncio.sleep(gap_s)
                        continue
                except OSError as exc:
                    errors[f"{path}: {type(exc).__name__}"] += 1
                writer.close()
                connections[path] = await asyncio.open_connection(*addresses[path])
    finally:
        for _, writer in connections.values():
            writer.close()
    summary = {f"{path}_{clock}_ms": summarize(getattr(times[path], f"{clock}_ms"))
               for path in times for clock in ("relay", "request")}
    return {**summary, "errors": dict(errors), "ttft_ms": ttft_ms,
            "first_token_overhead_ms": overhead(summary["gateway_relay_ms"], summary["direct_relay_ms"]),
            "pipe_overhead_ms": overhead(summary["pipe_relay_ms"], summary["direct_relay_ms"]),
            "request_overhead_ms": overhead(summary["gateway_request_ms"], summary["direct_request_ms"])}


# --------------------------------------------------------------------------------------------------
# The run


class RssSampler(threading.Thread):
    """The worker's RSS once a second; its peak."""

    def __init__(self, gateway: GatewayProcess) -> None:
        super().__init__(daemon=True)
        self.gateway = gateway
        self.peak_kib = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            for kib in self.gateway.rss()["workers_kib"].values():
                self.peak_kib = max(self.peak_kib, kib)

    def stop(self) -> int:
        self.halt.set()
        self.join()
        return self.peak_kib


def stream_config(streams: int, work_dir: str) -> str:
    """bench.yaml with room for `streams` connections on one worker, split over the providers."""

    def widen(config: dict[str, Any]) -> None:
        move_to_free_ports(config)
        config["limits"] = {**config.get("limits", {}), "max_connections_per_worker": streams + 2000}
        for cluster in config["clusters"]:
            cluster["max_connections"] = streams  # per endpoint per worker: never the limit here

    return write_derived_config(BENCH_CONFIG, work_dir, "streams", widen)


def hold_phase(gateway: GatewayProcess, mocks: list[MockProviderHandle], count: int, args: argparse.Namespace,
               seconds: float, during: Any) -> dict[str, Any]:
    """Hold `count` streams of about `seconds`; call `during()` once all are open; the outcome."""
    tokens = max(2, round(seconds * args.tokens_per_s))
    holder = StreamHolder(gateway.topology.listen, count, tokens, args.tokens_per_s, args.ramp_per_s)
    try:
        open_timeout = count / args.ramp_per_s + 60
        # Not all open in time is a finding, not a reason to stop: measure what is open.
        opened = holder.wait("open", open_timeout) or {"after_s": f"not all within {open_timeout:.0f}",
                                                       "started": None}
        at_open = {"after_s": opened["after_s"], "started": opened["started"], "load_average": os.getloadavg(),
                   "upstream_in_flight": upstream_in_flight(mocks),
                   "worker_rss_mib": [round(kib / 1024, 1) for kib in gateway.rss()["workers_kib"].values()]}
        extra = during()
        done = holder.wait("done", tokens / args.tokens_per_s + 120)
        if done is None:
            raise RuntimeError("the stream holder did not finish in time")
    finally:
        holder.stop()
    done.pop("event")
    return {**done, "tokens_per_stream": tokens, "tokens_per_s": args.tokens_per_s, "at_open": at_open, **extra}


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def streams_that_fit(wanted: int, fd_limit: int, worker_fds: int) -> int:
    """Streams one worker can hold: two sockets each, beside the files it holds already (and a margin)."""
    return min(wanted, (fd_limit - worker_fds - 64) // 2)


def run_streams(args: argparse.Namespace, gateway_cpus: set[int] | None, load_cpus: set[int] | None) -> dict[str, Any]:
    held = max(args.streams, args.probe_at)
    limits = raise_fd_limit(wanted_fd_limit(held))
    pin_self(load_cpus)
    work_dir = tempfile.mkdtemp(prefix="gridgate-streams-")
    topology = Topology.from_config(stream_config(held, work_dir))
    mocks = start_mocks(topology, load_cpus, tokens=16, models="demo-model", backlog=4096)
    results: dict[str, Any] = {"fd_limit": list(limits), "streams": args.streams, "probe_at": args.probe_at}
    gateway = GatewayProcess(topology, 1, gateway_cpus)
    try:
        gateway.wait_ready()
        time.sleep(1.0)
        results["worker_rss_idle_mib"] = [round(kib / 1024, 1) for kib in gateway.rss()["workers_kib"].values()]
        worker = gateway.worker_pids()[0]
        fit = streams_that_fit(args.streams, limits[0], open_fds(worker))
        if fit < args.streams:
            # An unprivileged process cannot raise its hard limit (CAP_SYS_RESOURCE): say so, measure what fits.
            print(f"bench_streams: RLIMIT_NOFILE hard limit {limits[1]} leaves room for {fit} streams in one "
                  f"worker (two sockets each), not {args.streams}; measuring {fit}", file=sys.stderr)
            results["streams_capped_by_fd_limit"] = {"wanted": args.streams, "measured": fit}
            results["streams"] = fit
        direct = (mocks[0].host, mocks[0].port)
        pipe_port = free_port()
        pipe_process = start_bare_pipe_process(pipe_port, mocks[0].port, gateway_cpus)
        pipe = ("127.0.0.1", pipe_port)
        try:
            uvloop.run(probe(topology.listen, direct, pipe, 20, 0.0))  # warm-up: upstream pool, caches
        except BaseException:
            terminate(pipe_process, 5.0)
            raise
        print(f"bench_streams: {args.probe_at} streams held, {args.probes} first-token probes per path",
              file=sys.stderr)
        probe_s = args.probes * 3 * (args.probe_gap_ms / 1000 + 0.003) + 10
        try:
            results["at_probe_load"] = hold_phase(
                gateway, mocks, args.probe_at, args, args.probe_at / args.ramp_per_s + probe_s,
                lambda: {"probes": uvloop.run(probe(topology.listen, direct, pipe, args.probes,
                                                    args.probe_gap_ms / 1000))})
        finally:
            terminate(pipe_process, 5.0)
        if not args.streams:
            return results
        print(f"bench_streams: {results['streams']} streams held at once", file=sys.stderr)
        cpu_before = process_cpu_s(worker)
        sampler = RssSampler(gateway)
        sampler.start()
        try:
            results["at_full_load"] = hold_phase(gateway, mocks, results["streams"], args, args.stream_s, dict)
        finally:
            results["at_full_load_peak_rss_mib"] = round(sampler.stop() / 1024, 1)
        results["at_full_load"]["worker_cpu_s"] = round(process_cpu_s(worker) - cpu_before, 1)
    finally:
        results["gateway_exit_code"] = gateway.stop()
        stop_all(mocks)
    return results


def render_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    probe_phase = results["at_probe_load"]
    probes = probe_phase["probes"]
    gw, di, over = probes["gateway_relay_ms"], probes["direct_relay_ms"], probes["first_token_overhead_ms"]
    pipe, pipe_over = probes["pipe_relay_ms"], probes["pipe_overhead_ms"]
    req_gw, req_di, req_over = probes["gateway_request_ms"], probes["direct_request_ms"], probes["request_overhead_ms"]
    rows = [
        (f"first-token overhead at {results['probe_at']:,} streams (p50 / p99 / p999)",
         f"{over['p50']:.3f} / {over['p99']:.3f} / {over['p999']:.3f} ms",
         f"mock's write of the token -> client's read: through the gateway {gw['p50']:.3f} / {gw['p99']:.3f} / "
         f"{gw['p999']:.3f} ms minus direct {di['p50']:.3f} / {di['p99']:.3f} / {di['p999']:.3f} ms "
         f"(n={gw['n']}/{di['n']}); upstream in flight {probe_phase['at_open']['upstream_in_flight']}, "
         f"load average {probe_phase['at_open']['load_average'][0]:.1f}, probe errors "
         f"{sum(probes['errors'].values())}, stream errors {sum(probe_phase['errors'].values())}"),
        (f"request -> first token overhead at {results['probe_at']:,} streams (p50 / p99 / p999)",
         f"{req_over['p50']:.3f} / {req_over['p99']:.3f} / {req_over['p999']:.3f} ms",
         f"kept-alive connection, the mock's TTFT {probes['ttft_ms']} ms: gateway {req_gw['p50']:.3f} / "
         f"{req_gw['p99']:.3f} ms minus direct {req_di['p50']:.3f} / {req_di['p99']:.3f} ms"),
        ("the same hop through a bare byte pipe (p50 / p99 / p999)",
         f"{pipe_over['p50']:.3f} / {pipe_over['p99']:.3f} / {pipe_over['p999']:.3f} ms",
         f"loadtest/bare_pipe.py on the gateway's core, no HTTP: {pipe['p50']:.3f} / {pipe['p99']:.3f} / "
         f"{pipe['p999']:.3f} ms minus direct; gridgate's own code is the first row minus this one"),
    ]
    if "at_full_load" not in results:
        return rows
    full = results["at_full_load"]
    rows += [
        (f"{results['streams']:,} concurrent slow streams, 1 worker", f"{sum(full['errors'].values())} errors",
         f"ok {full['ok']:,}; {full['tokens_per_stream']} tokens at {full['tokens_per_s']} tok/s; all open after "
         f"{full['at_open']['after_s']} s; upstream in flight then {full['at_open']['upstream_in_flight']:,}; "
         f"errors {full['errors'] or 'none'}"),
        ("worker RSS idle / all streams open / peak",
         f"{', '.join(map(str, results['worker_rss_idle_mib']))} / "
         f"{', '.join(map(str, full['at_open']['worker_rss_mib']))} / {results['at_full_load_peak_rss_mib']} MiB",
         f"worker CPU {full['worker_cpu_s']} s over {full['wall_s']} s; RLIMIT_NOFILE {results['fd_limit'][0]}"),
    ]
    if capped := results.get("streams_capped_by_fd_limit"):
        rows.append(("streams capped by RLIMIT_NOFILE", f"{capped['measured']:,} of {capped['wanted']:,}",
                     f"hard limit {results['fd_limit'][1]}: one worker needs two sockets per stream"))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, default=10000, help="streams held at once in phase 2 (0: no phase 2)")
    parser.add_argument("--probe-at", type=int, default=1000, help="streams held while probing first tokens")
    parser.add_argument("--probes", type=int, default=3000, help="first-token probes per path (p999 wants >= 1000)")
    parser.add_argument("--probe-gap-ms", type=float, default=5.0)
    parser.add_argument("--tokens-per-s", type=float, default=0.2, help="token pace of each held stream")
    parser.add_argument("--stream-s", type=float, default=90.0, help="length of each phase-2 stream")
    parser.add_argument("--ramp-per-s", type=float, default=500.0, help="new streams per second")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_streams", description=__doc__.split("\n")[0])
    add_arguments(parser)
    add_core_arguments(parser)
    args = parser.parse_args(argv)
    try:
        results = run_streams(args, *split_cores(args.gateway_core, args.load_core))
    except RuntimeError as exc:
        print(f"bench_streams: {exc}", file=sys.stderr)
        return 1
    table = markdown_table(("measure", "result", "detail"), render_rows(results))
    write_report("bench-streams", results, "gridgate streams benchmark",
                 invocation("loadtest.bench_streams"), table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
