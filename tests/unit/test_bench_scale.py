"""loadtest/bench_scale.py's pure parts: worker counts, the core plan, metric deltas, efficiency."""

from __future__ import annotations

import pytest

from loadtest.bench_scale import (
    default_workers,
    metric_sum,
    parse_metrics,
    parse_workers,
    plan_cores,
    scaling_rows,
    window_contention,
)

BEFORE = """\
# TYPE gridgate_requests counter
gridgate_requests_total{cluster="bench-a",code="2xx"} 100.0
gridgate_requests_total{cluster="bench-b",code="2xx"} 50.0
# TYPE gridgate_affinity counter
gridgate_affinity_total{outcome="new"} 1000.0
gridgate_affinity_total{outcome="reused"} 0.0
# TYPE gridgate_quota_decisions counter
gridgate_quota_decisions_total{reason="admitted"} 150.0
gridgate_quota_decisions_total{reason="denied"} 0.0
# TYPE gridgate_quota_leases counter
gridgate_quota_leases_total{event="granted"} 2.0
gridgate_quota_leases_total{event="admitted"} 140.0
"""

AFTER = """\
# TYPE gridgate_requests counter
gridgate_requests_total{cluster="bench-a",code="2xx"} 10100.0
gridgate_requests_total{cluster="bench-b",code="2xx"} 10050.0
# TYPE gridgate_affinity counter
gridgate_affinity_total{outcome="new"} 1010.0
gridgate_affinity_total{outcome="reused"} 19990.0
# TYPE gridgate_quota_decisions counter
gridgate_quota_decisions_total{reason="admitted"} 20148.0
gridgate_quota_decisions_total{reason="denied"} 2.0
# TYPE gridgate_quota_leases counter
gridgate_quota_leases_total{event="granted"} 10.0
gridgate_quota_leases_total{event="admitted"} 20130.0
"""


def test_default_workers_doubles_up_to_the_cores_capped_at_16() -> None:
    assert default_workers(1) == [1]
    assert default_workers(2) == [1, 2]
    assert default_workers(6) == [1, 2, 4, 6]
    assert default_workers(16) == [1, 2, 4, 8, 16]
    assert default_workers(64) == [1, 2, 4, 8, 16]


def test_parse_workers() -> None:
    assert parse_workers("4,1, 2,2") == [1, 2, 4]
    for bad in ("", "0,1", "a"):
        with pytest.raises(ValueError):
            parse_workers(bad)


def test_plan_cores_own_cores_or_all_shared() -> None:
    assert plan_cores([0, 1], 1) == {"gateway": None, "load": None, "upstream": None, "shared": True}
    assert plan_cores(range(16), 8) == {"gateway": [0, 1, 2, 3, 4, 5, 6, 7], "load": [8, 9, 10, 11],
                                        "upstream": [12, 13, 14, 15], "shared": False}
    assert plan_cores([3, 2, 1], 1) == {"gateway": [1], "load": [2], "upstream": [3], "shared": False}
    assert plan_cores(range(16), 16)["shared"] and not plan_cores(range(16), 14)["shared"]


def test_plan_cores_keeps_the_largest_counts_upstream_free_of_every_load() -> None:
    # The mocks stay on the largest own-cores count's upstream cores through every window.
    plans = [plan_cores(range(16), workers) for workers in (1, 2, 4, 8)]
    mocks = set(plans[-1]["upstream"])
    for plan in plans:
        assert mocks <= set(plan["upstream"]) and not mocks & set(plan["load"]) and not mocks & set(plan["gateway"])


def test_parse_metrics_and_sum_by_labels() -> None:
    samples = parse_metrics(BEFORE)
    assert samples['gridgate_requests_total{cluster="bench-a",code="2xx"}'] == 100.0
    assert metric_sum(samples, "gridgate_requests_total") == 150.0
    assert metric_sum(samples, "gridgate_requests_total", cluster="bench-b") == 50.0
    assert metric_sum(samples, "gridgate_affinity_total", outcome="new") == 1000.0
    assert metric_sum(samples, "gridgate_missing_total") == 0.0


def test_window_contention_rates_from_deltas() -> None:
    figures = window_contention(parse_metrics(BEFORE), parse_metrics(AFTER), 10.0, 19_990)
    assert figures["counted_per_s"] == 2000.0
    assert figures["counted_vs_wrk"] == pytest.approx(20_000 / 19_990)
    assert figures["affinity_new_per_s"] == 1.0
    assert figures["affinity_reused_per_s"] == 1999.0
    assert figures["quota_decided_per_s"] == 2000.0
    # 20,000 decided, 19,990 of them from blocks: 10 decided in Valkey, plus 8 blocks granted.
    assert figures["valkey_admission_calls_per_s"] == pytest.approx(1.8)
    assert figures["valkey_calls_per_1k_requests"] == pytest.approx(0.9)


def test_window_contention_without_traffic() -> None:
    figures = window_contention({}, {}, 0.0, 0)
    assert figures["counted_vs_wrk"] == 0.0 and figures["valkey_calls_per_1k_requests"] == 0.0


def test_scaling_rows_efficiency_against_one_worker() -> None:
    rows = scaling_rows({2: 9000.0, 1: 6000.0, 4: 18000.0})
    assert [row["workers"] for row in rows] == [1, 2, 4]
    assert [row["per_worker"] for row in rows] == [6000.0, 4500.0, 4500.0]
    assert [row["efficiency"] for row in rows] == [1.0, 0.75, 0.75]
    assert scaling_rows({2: 9000.0})[0]["efficiency"] is None


def test_scaling_rows_cpu_efficiency_and_cores_busy() -> None:
    rows = scaling_rows({1: 6000.0, 2: 9000.0}, {1: 150.0, 2: 160.0})
    assert rows[0]["worker_cores"] == pytest.approx(0.9) and rows[0]["cpu_efficiency"] == 1.0
    assert rows[1]["worker_cores"] == pytest.approx(1.44) and rows[1]["cpu_efficiency"] == pytest.approx(0.9375)
    assert scaling_rows({2: 9000.0}, {2: 160.0})[0]["cpu_efficiency"] is None
