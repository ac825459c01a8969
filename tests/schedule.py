"""The suite's order: the test files that take longest first, so that under ``pytest -n N --dist loadfile
--no-loadscope-reorder`` (the Makefile's line) no long file starts last and makes the tail of the run
alone while the other workers sit idle (longest processing time first: the wall time comes close to the
sum of the files' times over N).

The files' times are measured, in seconds, in tests/durations.json; a file missing there (a new one) counts
as ``UNKNOWN_S``. Refresh the table after a full run that wrote a JUnit XML report:

    python -m pytest -q -n 2 --dist loadfile --junitxml=/tmp/run.xml tests
    python -m tests.schedule /tmp/run.xml

The order changes when tests run, never what they do: each file's tests keep their order and stay together
(``--dist loadfile`` hands a file to one worker; its module-scoped fixtures are set up once)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_S = 3.0  # a new file: about a gateway test's file; remeasure to place it exactly


class _Item(Protocol):
    nodeid: str


def file_of(nodeid: str) -> str:
    """``tests/unit/test_x.py::test_y[a]`` -> ``tests/unit/test_x.py``."""
    return nodeid.split("::", 1)[0]


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def longest_files_first(items: Sequence[_Item], durations: dict[str, float]) -> list[_Item]:
    """``items`` with the files in decreasing measured time, each file's items in their own order (the sort is
    stable; files of equal time keep their collection order)."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(file_of(item.nodeid), len(first_seen))

    def rank(item: _Item) -> tuple[float, int]:
        name = file_of(item.nodeid)
        return -durations.get(name, UNKNOWN_S), first_seen[name]

    return sorted(items, key=rank)


def durations_of_report(report: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of each test) from a JUnit XML report."""
    totals: Counter[str] = Counter()
    for case in ElementTree.parse(report).iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
        if module is not None:
            totals["/".join(parts[: module + 1]) + ".py"] += float(case.get("time") or 0)
    return {name: round(seconds, 1) for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.schedule REPORT.xml  (writes tests/durations.json)", file=sys.stderr)
        return 2
    durations = durations_of_report(Path(argv[0]))
    DURATIONS.write_text(json.dumps(durations, indent=0) + "\n")
    print(f"{len(durations)} files, {sum(durations.values()):.0f} s in all, written to {DURATIONS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
