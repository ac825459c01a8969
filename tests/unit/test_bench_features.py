"""bench_features' arithmetic: medians over rounds, per-round and per-window ratios to the core run, variant
selection, round order, the ports of a variant beside the core."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.bench_features import (
    CORE,
    VARIANT_NAMES,
    partner_addresses,
    round_order,
    select_variants,
    variant_configs,
)
from loadtest.feature_report import summarize_paired, summarize_rounds
from loadtest.topology import BENCH_CONFIG, Topology


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


def pairs(*cpu_us: tuple[float, float]) -> list[tuple[dict[str, float], dict[str, float]]]:
    return [(core, own) for core, own in zip(rounds(*(c for c, _ in cpu_us)), rounds(*(o for _, o in cpu_us)),
                                             strict=True)]


def test_a_paired_ratio_is_taken_within_its_window_so_the_machines_speed_cancels() -> None:
    # Each window runs at another machine speed; within a window the feature costs 25 % more than the core.
    summary = summarize_paired({"feature": pairs((100, 125), (160, 200), (120, 150)),
                                "cheap": pairs((110, 110), (150, 150), (130, 130))}, "core")
    feature = summary["feature"]
    assert feature["vs_core_per_round"] == pytest.approx([0.8, 0.8, 0.8])
    assert (feature["vs_core_median"], feature["vs_core_min"], feature["vs_core_max"]) == pytest.approx((0.8, 0.8, 0.8))
    assert feature["cpu_us_median"] == 150
    assert summary["cheap"]["vs_core_median"] == pytest.approx(1.0)


def test_each_variant_is_compared_with_the_core_of_its_own_windows_only() -> None:
    # The core beside "slow" measured 100 each time; beside "fast" 200: a mix-up would give 2.0 or 0.25.
    summary = summarize_paired({"slow": pairs((100, 200), (100, 200)), "fast": pairs((200, 100), (200, 100))}, "core")
    assert summary["slow"]["vs_core_median"] == pytest.approx(0.5)
    assert summary["fast"]["vs_core_median"] == pytest.approx(2.0)
    core = summary["core"]  # its own row: every window it ran in, each ratio 1
    assert core["vs_core_per_round"] == [1.0] * 4 and core["vs_core_median"] == 1.0
    assert core["cpu_us_median"] == 150


def test_paired_windows_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        summarize_paired({"feature": [(rounds(100)[0], rounds(125)[0])], "other": []}, "core")


def test_odd_rounds_keep_the_order_and_even_rounds_reverse_it() -> None:
    assert [round_order(r, [0, 1, 2]) for r in (1, 2, 3, 4)] == [[0, 1, 2], [2, 1, 0], [0, 1, 2], [2, 1, 0]]
    assert [round_order(r, (CORE, 3))[0] for r in (1, 2, 3, 4)] == [CORE, 3, CORE, 3]  # who starts first


def topology(listen: int = 18080, admin: int = 19901, endpoints: tuple[int, ...] = (19001, 19002)) -> Topology:
    return Topology("bench.yaml", ("127.0.0.1", listen), ("127.0.0.1", admin),
                    [(f"c{port}", "127.0.0.1", port) for port in endpoints])


def test_a_paired_variant_listens_on_the_cores_ports_shifted() -> None:
    assert partner_addresses(topology()) == (("127.0.0.1", 18180), ("127.0.0.1", 19911))
    assert partner_addresses(topology(), (1, 2)) == (("127.0.0.1", 18081), ("127.0.0.1", 19903))


@pytest.mark.parametrize(("base", "offsets", "clash"), [
    (topology(endpoints=(18180,)), (100, 10), "18180"),           # on a provider endpoint (a mock holds it)
    (topology(listen=19801), (100, 10), "19901"),                 # on the core's own admin port
    (topology(listen=19901, admin=18080), (0, 1), "19901"),       # on the core's own listen port
    (topology(listen=19811, admin=19901), (100, 10), "19911"),    # listen and admin on the same port
    (topology(listen=65500), (100, 10), "65600"),                 # out of range
])
def test_a_paired_variant_never_takes_a_port_the_core_topology_uses(base: Topology, offsets: tuple[int, int],
                                                                   clash: str) -> None:
    with pytest.raises(ValueError, match=clash):
        partner_addresses(base, offsets)


def test_paired_configs_put_the_core_on_bench_ports_and_the_variants_beside_it(tmp_path: Path) -> None:
    bench = Topology.from_config(BENCH_CONFIG)
    listen, admin = partner_addresses(bench)
    configs = variant_configs([CORE, 1, 3], "paired", str(tmp_path))
    core = Topology.from_config(configs[CORE])
    assert (core.listen, core.admin) == (bench.listen, bench.admin)
    for index in (1, 3):
        variant = Topology.from_config(configs[index])
        assert (variant.listen, variant.admin, variant.endpoints) == (listen, admin, bench.endpoints)
    (tmp_path / "sequential").mkdir()
    sequential = Topology.from_config(variant_configs([CORE, 1], "sequential", str(tmp_path / "sequential"))[1])
    assert (sequential.listen, sequential.admin) == (bench.listen, bench.admin)
