"""The share each picker promises a model's providers (what `providers verify --load` measures against)."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.config.routing import Routing
from gateway.conformance.promise import judge, promise, tolerance
from gateway.overlay.snapshot import snapshot_from_object
from tests.harness import candidate, envelope


def _snapshot(candidates: list[dict[str, Any]], mode: str | None = "roundRobin"):
    return snapshot_from_object(envelope(candidates, mode))


def _routing(**fields: Any) -> Routing:
    return msgspec.convert({"overlay_file": "o.json", **fields}, Routing)


def test_round_robin_and_random_count_slots() -> None:
    slots = [candidate("m", "a"), candidate("m", "a"), candidate("m", "b"), candidate("m", "c")]
    for mode in ("roundRobin", "random"):
        made = promise(_snapshot(slots, mode), _routing(), "m", {"a", "b", "c"})
        assert made.picker == mode and made.shares == {"a": 0.5, "b": 0.25, "c": 0.25}
    assert promise(_snapshot(slots), _routing(), "m", {"a", "b"}).shares == {"a": 2 / 3, "b": 1 / 3}


def test_deterministic_promises_the_first_usable() -> None:
    snapshot = _snapshot([candidate("m", "a"), candidate("m", "b")], "deterministic")
    assert promise(snapshot, _routing(), "m", {"a", "b"}).shares == {"a": 1.0}
    assert promise(snapshot, _routing(), "m", {"b"}).shares == {"b": 1.0}


def test_weighted_follows_traffic_weight_and_least_loaded_is_even() -> None:
    snapshot = _snapshot([candidate("m", n) for n in "abc"])
    models = [{"match": {"capability": "m", "cluster": "a"}, "traffic_weight": 3}]
    assert promise(snapshot, _routing(picker="weighted", models=models), "m", {"a", "b", "c"}).shares == {
        "a": 0.6, "b": 0.2, "c": 0.2}
    assert promise(snapshot, _routing(picker="least_loaded"), "m", {"a", "b"}).shares == {"a": 0.5, "b": 0.5}


def test_only_the_first_admitting_group_with_a_usable_member_serves() -> None:
    snapshot = _snapshot([candidate("m", "a", group=0), candidate("m", "b", group=0), candidate("m", "c", group=1)])
    assert promise(snapshot, _routing(), "m", {"a", "b", "c"}).shares == {"a": 0.5, "b": 0.5}
    assert promise(snapshot, _routing(), "m", {"c"}).shares == {"c": 1.0}  # group 0 all down: failover group


def test_hashing_pickers_promise_no_split() -> None:
    snapshot = _snapshot([candidate("m", n) for n in "ab"])
    assert promise(snapshot, _routing(picker="stable_hash"), "m", {"a", "b"}).shares is None
    assert promise(snapshot, _routing(prefix_affinity={"enabled": True}), "m", {"a", "b"}).shares is None


def test_judging_allows_the_tolerance_and_sampling_error() -> None:
    assert judge({"a": 0.53, "b": 0.47}, {"a": 0.5, "b": 0.5}, 10_000, 0.05) == []
    assert judge({"a": 0.7, "b": 0.3}, {"a": 0.5, "b": 0.5}, 10_000, 0.05)[0].startswith("a 70.0% against 50.0%")
    assert judge({"a": 1.0}, {"a": 0.5, "b": 0.5}, 10_000, 0.05)  # a provider that got nothing misses too
    assert tolerance(0.5, 100, 0.0) > tolerance(0.5, 10_000, 0.0)
