"""loadtest/opcount.py: the opcode counts bench_opcodes reads from a traced worker, and their arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.opcount import difference, per_request

ROOT = Path(__file__).resolve().parents[2]


def snapshot(loaded_ops: dict[str, int], requests: int, loaded_s: float, idle_ops: dict[str, int],
             idle_s: float) -> dict[str, dict]:
    return {"loaded": {"ops": loaded_ops, "calls": {"workers/outcomes.py:close": requests}, "seconds": loaded_s},
            "idle": {"ops": idle_ops, "seconds": idle_s}}


def test_per_request_divides_by_the_requests_after_taking_off_the_timers_share() -> None:
    # 10 s loaded, 1,000 requests; the timers ran 50 opcodes a second when idle (2 s: 100), so 500 of the
    # loaded window's tick opcodes are theirs.
    counted = snapshot({"handle": 20_000, "tick": 700}, 1_000, 10.0, {"tick": 100}, 2.0)
    requests, functions = per_request(counted)
    assert requests == 1_000
    assert functions == pytest.approx({"handle": 20.0, "tick": 0.2})


def test_a_window_without_requests_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="outcomes.py:close"):
        per_request(snapshot({"tick": 5}, 0, 1.0, {}, 1.0))


def test_difference_lists_what_grew_most_first() -> None:
    rows = difference({"a": 10.0, "b": 5.0, "gone": 3.0}, {"a": 12.0, "b": 50.0, "new": 7.0}, 3)
    assert rows == [("b", 5.0, 50.0, 45.0), ("new", 0.0, 7.0, 7.0), ("a", 10.0, 12.0, 2.0)]


CHILD = """
import json, sys, time
from loadtest.opcount import start_counting

def one_request(n):
    total = 0
    for i in range(n):
        total += i
    if n == 10:
        periodic()
    return total


def periodic():
    return sum(helper(i) for i in range(3))


def helper(i):
    return i * 2

out = sys.argv[1]
start_counting(out, warm_requests=2, requests=3, idle_s=0.3, request_function="<string>:one_request",
               periodic_functions=frozenset({"<string>:periodic"}))
for _ in range(40):
    one_request(10)
    time.sleep(0.05)
time.sleep(2.0)  # no more requests: the idle window runs
"""


def test_a_traced_process_counts_the_opcodes_of_each_request_after_the_warm_up(tmp_path: Path) -> None:
    out = tmp_path / "counts"
    subprocess.run([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, check=True, timeout=60)
    (found,) = tmp_path.glob("counts.*.json")
    counted = json.loads(found.read_text())
    requests, functions = per_request(counted, "<string>:one_request")
    assert requests >= 3  # the window closes at the first poll that finds three
    # A loop of ten iterations: the same opcodes every call, whichever calls the window took.
    per_call = functions["<string>:one_request"]
    assert per_call == counted["loaded"]["ops"]["<string>:one_request"] / requests
    assert 40 < per_call < 200 and per_call == int(per_call)
    assert counted["idle"]["ops"].get("<string>:one_request", 0) == 0
    # The periodic function's whole call tree (its generator and helper) is counted apart, not per request.
    assert not {"<string>:periodic", "<string>:helper", "<string>:<genexpr>"} & set(functions)
    periodic = counted["loaded"]["periodic_ops"]
    assert periodic["<string>:periodic"] > 0 and periodic["<string>:helper"] > 0
