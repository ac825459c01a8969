"""Opcodes a process executes, per function: a deterministic stand-in for CPU time (loadtest/bench_opcodes.py).

Wall-clock benchmarks on a shared machine spread by a few percent from run to run, more than most single
changes on the request path are worth. The number of CPython opcodes a request executes does not move with
the machine: it changes only when the code does, and for gridgate's request path it predicts the
wall-clock ratio of two configs only roughly (README.md, "Benchmarks"). It does not see C work
(h11's regexes, msgspec, syscalls), so it ranks Python-level changes, never replaces the wall-clock bench.

``start_counting`` is what ``loadtest/opcount_site/sitecustomize.py`` runs in every process the gateway
forks (its workers). It traces the process; once ``warm_requests`` requests have ended (the warm-up:
sessions bound, blocks held, caches filled) it counts the next ``requests`` and writes
``<out>.<pid>.loaded``; the measuring side then stops the load, and after ``idle_s`` more seconds of no
load (counted from when the requests in flight have ended) it writes ``<out>.<pid>.json``: ``{"loaded": {"ops",
"calls", "periodic_ops", "seconds"}, "idle": {"ops", "seconds"}}`` (``PERIODIC_FUNCTIONS``: below).
The idle window measures what runs whatever the load (timers, heartbeats), which ``per_request``
subtracts: under tracing a worker serves a hundred requests a second, so a second's timers would
otherwise weigh twenty times what they weigh at full speed. Counting by requests, not seconds, makes the
window the same however fast the machine runs.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

# The function whose calls count the requests: one call per request that ends (workers/outcomes.py).
REQUEST_FUNCTION = "workers/outcomes.py:close"
# Work the request path starts at most once per interval, whatever the rate (the providers' view is
# refreshed every 0.1 s): traced, a worker serves about a hundred requests a second, so its share per
# request would weigh twenty times what it weighs at full speed. Its whole call tree is counted apart
# (``periodic_ops``), not per request.
PERIODIC_FUNCTIONS = frozenset({"workers/providers.py:refresh"})


def function_key(frame: FrameType) -> str:
    """``<directory>/<file>:<function>`` of a frame."""
    code = frame.f_code
    return "/".join(code.co_filename.rsplit("/", 2)[-2:]) + ":" + code.co_name


def start_counting(out: str, warm_requests: int, requests: int, idle_s: float,
                   request_function: str = REQUEST_FUNCTION,
                   periodic_functions: frozenset[str] = PERIODIC_FUNCTIONS) -> None:
    """Trace this process (its calling thread) from now; see the module's docstring. A request is a call
    of ``request_function`` (``function_key`` form)."""
    ops: collections.Counter[str] = collections.Counter()
    periodic: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    on = [True]
    inside_periodic = [0]  # depth of periodic_functions frames on the stack (they are plain functions)

    def tracer(frame: FrameType, _event: str, _arg: Any) -> Any:
        if not on[0]:
            return None
        frame.f_trace_opcodes = True
        key = function_key(frame)
        calls[key] += 1
        if key in periodic_functions:
            inside_periodic[0] += 1

            def periodic_root(_frame: FrameType, event: str, _arg: Any) -> Any:
                if event == "opcode":
                    periodic[key] += 1
                elif event == "return":
                    inside_periodic[0] -= 1
                return periodic_root
            return periodic_root

        def local(_frame: FrameType, event: str, _arg: Any) -> Any:
            if event == "opcode":
                (periodic if inside_periodic[0] else ops)[key] += 1
            return local
        return local

    def until(count: int) -> None:
        while calls[request_function] < count:
            time.sleep(0.05)

    def windows() -> None:
        until(warm_requests)
        ops.clear()
        periodic.clear()
        calls.clear()
        started = time.monotonic()
        until(requests)
        loaded = {"ops": dict(ops), "calls": dict(calls), "periodic_ops": dict(periodic),
                  "seconds": time.monotonic() - started}
        with open(f"{out}.{os.getpid()}.loaded", "w") as file:
            json.dump({}, file)  # the sign to stop the load
        ended = -1
        while calls[request_function] != ended:  # the requests in flight when the load stopped end first
            ended = calls[request_function]
            time.sleep(0.5)
        ops.clear()
        started = time.monotonic()
        time.sleep(idle_s)
        idle = {"ops": dict(ops), "seconds": time.monotonic() - started}
        on[0] = False
        with open(f"{out}.{os.getpid()}.json", "w") as file:
            json.dump({"loaded": loaded, "idle": idle}, file)

    threading.Thread(target=windows, daemon=True, name="opcount").start()
    sys.settrace(tracer)


def per_request(snapshot: Mapping[str, Mapping[str, Any]],
                request_function: str = REQUEST_FUNCTION) -> tuple[int, dict[str, float]]:
    """(requests, opcodes per request of each function) of one worker's snapshot: the loaded window's
    counts less what the idle window ran in as many seconds."""
    loaded, idle = snapshot["loaded"], snapshot["idle"]
    requests = loaded["calls"].get(request_function, 0)
    if requests == 0:
        raise ValueError(f"no request ended in the window ({request_function} never called)")
    scale = loaded["seconds"] / idle["seconds"] if idle["seconds"] > 0 else 0.0
    names = set(loaded["ops"]) | set(idle["ops"])
    return requests, {name: (loaded["ops"].get(name, 0) - idle["ops"].get(name, 0) * scale) / requests
                      for name in names}


def difference(base: Mapping[str, float], other: Mapping[str, float], top: int) -> list[tuple[str, float, float, float]]:
    """The ``top`` functions whose opcodes per request grew most from ``base`` to ``other`` (name, base,
    other, other - base), largest growth first."""
    rows = [(name, base.get(name, 0.0), other.get(name, 0.0), other.get(name, 0.0) - base.get(name, 0.0))
            for name in set(base) | set(other)]
    rows.sort(key=lambda row: (-row[3], row[0]))
    return rows[:top]
