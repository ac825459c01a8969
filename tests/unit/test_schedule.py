"""The suite's order (tests/schedule.py): the longest files first, each file's tests together and in order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.schedule import UNKNOWN_S, durations_of_report, load_durations, longest_files_first


@dataclass
class Item:
    nodeid: str


def test_the_longest_files_come_first_each_files_tests_together_and_in_their_order() -> None:
    items = [Item(n) for n in ("tests/a.py::one", "tests/b.py::one", "tests/a.py::two[x]", "tests/new.py::t",
                               "tests/c.py::one", "tests/b.py::two")]
    durations = {"tests/a.py": 1.0, "tests/b.py": 70.0, "tests/c.py": UNKNOWN_S + 1}
    ordered = [item.nodeid for item in longest_files_first(items, durations)]
    assert ordered == ["tests/b.py::one", "tests/b.py::two", "tests/c.py::one", "tests/new.py::t",
                       "tests/a.py::one", "tests/a.py::two[x]"]


def test_files_of_equal_time_keep_their_collection_order() -> None:
    items = [Item("tests/z.py::t"), Item("tests/y.py::t"), Item("tests/x.py::t")]
    assert [item.nodeid for item in longest_files_first(items, {})] == ["tests/z.py::t", "tests/y.py::t",
                                                                         "tests/x.py::t"]


def test_a_junit_report_gives_seconds_per_file(tmp_path: Path) -> None:
    report = tmp_path / "run.xml"
    report.write_text('<testsuites><testsuite name="pytest">'
                      '<testcase classname="tests.integration.test_a" name="t1" time="1.25"/>'
                      '<testcase classname="tests.integration.test_a.TestGroup" name="t2" time="2.0"/>'
                      '<testcase classname="tests.unit.test_b" name="t" time="0.5"/>'
                      '</testsuite></testsuites>')
    assert durations_of_report(report) == {"tests/integration/test_a.py": 3.2, "tests/unit/test_b.py": 0.5}


def test_the_committed_table_is_there_and_puts_the_60_s_outage_first() -> None:
    durations = load_durations()  # a stale row (a file renamed) is harmless: nothing collects it
    assert max(durations, key=durations.__getitem__) == "tests/integration/test_jwks_outage.py"
