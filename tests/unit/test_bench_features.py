"""bench_features' arithmetic: medians over rounds, per-round ratios to the core run, variant selection."""

from __future__ import annotations

import pytest

from loadtest.bench_features import VARIANT_NAMES, select_variants, summarize_rounds


def rounds(*cpu_us: float) -> list[dict[str, float]]:
    return [{"worker_cpu_us_per_request": cpu, "requests_per_s": 1e6 / cpu} for cpu in cpu_us]


def test_the_ratio_is_taken_within_each_round_so_the_machines_drift_cancels() -> None:
    # The machine slows down 20 % per round; the feature always costs 25 % more CPU than the core that round.
    summary = summarize_rounds({"core": rounds(100, 120, 144), "feature": rounds(125, 150, 180)}, "core")
    feature = summary["feature"]
    assert feature["vs_core_per_round"] == pytest.approx([0.8, 0.8, 0.8])
    assert feature["vs_core_median"] == pytest.approx(0.8)
    assert (feature["vs_core_min"], feature["vs_core_max"]) == pytest.approx((0.8, 0.8))
    assert feature["cpu_us_median"] == 150 and feature["requests_per_s_median"] == pytest.approx(1e6 / 150)
    assert summary["core"]["vs_core_per_round"] == [1.0, 1.0, 1.0]


def test_vs_core_is_the_median_of_the_per_round_ratios_not_the_ratio_of_the_medians() -> None:
    summary = summarize_rounds({"core": rounds(100, 200, 130), "feature": rounds(110, 250, 200)}, "core")
    feature = summary["feature"]
    assert feature["vs_core_per_round"] == pytest.approx([100 / 110, 0.8, 0.65])
    assert feature["vs_core_median"] == pytest.approx(0.8)  # the ratio of the medians would be 130 / 200
    assert (summary["core"]["cpu_us_median"], feature["cpu_us_median"]) == (130, 200)


def test_one_noisy_round_moves_the_range_but_not_the_median() -> None:
    summary = summarize_rounds({"core": rounds(100, 100, 100, 100, 100), "feature": rounds(125, 125, 80, 125, 125)},
                               "core")
    feature = summary["feature"]
    assert feature["vs_core_median"] == pytest.approx(0.8)
    assert (feature["vs_core_min"], feature["vs_core_max"]) == pytest.approx((0.8, 1.25))


def test_variants_with_a_different_number_of_rounds_are_refused() -> None:
    with pytest.raises(ValueError):
        summarize_rounds({"core": rounds(100, 100), "feature": rounds(125)}, "core")


def test_variants_are_chosen_by_index_or_name_substring_and_the_core_always_runs() -> None:
    assert select_variants(None) == list(range(len(VARIANT_NAMES)))
    assert select_variants("1") == [0, 1]
    lease = [i for i, name in enumerate(VARIANT_NAMES) if "lease" in name]
    assert len(lease) == 1 and select_variants("LEASE") == [0, *lease]
    assert select_variants("affinity, 0 ,") == [0, VARIANT_NAMES.index("+ session affinity")]
    assert select_variants("everything") == [0, *(i for i, n in enumerate(VARIANT_NAMES) if n.startswith("everything"))]


@pytest.mark.parametrize("spec", ["99", "telepathy"])
def test_an_unknown_variant_is_named(spec: str) -> None:
    with pytest.raises(ValueError, match=spec):
        select_variants(spec)
