"""The benchmark report: time bins, percentiles, what a worker can hold, and what a report records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import loadtest.report
from gateway.interpreter import interpreter_build
from loadtest.bench import class_env_name
from loadtest.bench_streams import streams_that_fit
from loadtest.report import percentile, time_bins, write_report


def test_time_bins_count_requests_and_failures_per_second_from_the_start() -> None:
    start = 1000.0
    samples = [(1000.2, 10.0, True), (1000.9, 30.0, True), (1001.5, 99.0, False), (1002.1, 20.0, True),
               (999.0, 1.0, True), (1003.0, 1.0, True)]  # before the start / at the end: outside
    bins = time_bins(samples, start, start + 3.0)
    assert [b.start_s for b in bins] == [0.0, 1.0, 2.0]
    assert [(b.count, b.failures) for b in bins] == [(2, 0), (1, 1), (1, 0)]
    assert bins[0].percentile(50) == 10.0 and bins[0].percentile(99) == 30.0


def test_a_bin_of_failures_only_has_no_latency_rather_than_a_fast_one() -> None:
    bins = time_bins([(0.5, 2.0, False)], 0.0, 1.0)
    assert bins[0].failures == 1 and bins[0].percentile(50) is None


def test_bins_of_half_a_second() -> None:
    bins = time_bins([(0.1, 1.0, True), (0.6, 2.0, True), (0.7, 3.0, True)], 0.0, 1.0, width_s=0.5)
    assert [b.count for b in bins] == [1, 2]


def test_nearest_rank_percentile() -> None:
    values = sorted(float(v) for v in range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([], 50) == 0.0


def test_streams_that_fit_leave_room_for_two_sockets_each() -> None:
    assert streams_that_fit(10_000, 65_536, 40) == 10_000
    assert streams_that_fit(10_000, 20_000, 40) == (20_000 - 40 - 64) // 2


def test_locust_class_names_map_to_environment_names() -> None:
    assert class_env_name("InteractiveUser") == "INTERACTIVE"
    assert class_env_name("LongStreamUser") == "LONG_STREAM"
    assert class_env_name("ChatUser") == "CHAT"


def test_a_report_names_the_interpreter_the_gateways_ran_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(loadtest.report, "REPORTS_DIR", str(tmp_path))
    write_report("bench-x", {"rows": [1]}, "A title", "python -m loadtest.bench_x", "| a |\n")
    (json_path,) = tmp_path.glob("bench-x-*.json")
    (md_path,) = tmp_path.glob("bench-x-*.md")
    build = interpreter_build()
    assert json.loads(json_path.read_text()) == {"rows": [1], "interpreter": build.as_dict()}
    kind = "shared libpython" if build.shared_libpython else "static"
    assert f"Python {build.version} ({build.executable}, {kind})" in md_path.read_text()
    assert "| a |" in capsys.readouterr().out
