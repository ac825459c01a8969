"""Provider selection beyond the overlay's modes: usability, failover walk, eligibility filters,
pickers (weighted, stable_hash, least_loaded) and the pinned route (CONTRACT §11, §12). Pure."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from gateway.config import ModelFacts, ModelMatch
from gateway.http.errors import ErrorReply
from gateway.overlay.snapshot import Snapshot, snapshot_from_object
from gateway.routing import ProviderView, RouteDecision, Router
from gateway.routing.eligibility import TOO_SMALL, TOOLS, VISION, FactsTable, Needs

MODEL = "inference_model"


def snap(*clusters: str, groups: list[int] | None = None, mode: str = "roundRobin", name: str = "m") -> Snapshot:
    candidates: list[dict[str, Any]] = [
        {"kind": MODEL, "name": name, "site": "s", "cluster": c, "selection_group": groups[i] if groups else 0}
        for i, c in enumerate(clusters)
    ]
    return snapshot_from_object({"local_site": "here", "candidates": candidates, "selection_policy": {"mode": mode}})


def router_for(*clusters: str, **options: Any) -> Router:
    index = {name: i for i, name in enumerate(clusters)}
    return Router(provider_index=index, providers=ProviderView(len(clusters)), rng=random.Random(7), **options)


def route(router: Router, snapshot: Snapshot, **kw: Any) -> RouteDecision:
    decision = router.route(snapshot, MODEL, "m", **kw)
    assert isinstance(decision, RouteDecision), decision
    return decision


def facts(*entries: dict[str, Any]) -> FactsTable:
    return FactsTable([ModelFacts(match=ModelMatch(**e.pop("match")), **e) for e in entries])


# --------------------------------------------------------------------------- usability and failover


def test_cooled_and_down_providers_are_skipped_while_another_is_usable() -> None:
    snapshot = snap("a", "b", "c")
    router = router_for("a", "b", "c")
    view = router.providers
    view.cool(0, until=100.0, at=1.0)
    view.down[1] = True
    view.recompute(now=2.0)
    assert {route(router, snapshot).cluster for _ in range(6)} == {"c"}


def test_all_cooled_uses_the_least_recently_cooled_before_a_down_one() -> None:
    snapshot = snap("a", "b", "c")
    router = router_for("a", "b", "c")
    view = router.providers
    view.cool(0, until=100.0, at=5.0)
    view.cool(1, until=100.0, at=3.0)  # cooled longest ago
    view.down[2] = True
    view.recompute(now=6.0)
    assert route(router, snapshot).cluster == "b"


def test_cooling_ends_at_its_deadline() -> None:
    snapshot = snap("a", "b")
    router = router_for("a", "b")
    router.providers.cool(0, until=10.0, at=1.0)
    router.providers.recompute(now=9.9)
    assert {route(router, snapshot).cluster for _ in range(4)} == {"b"}
    router.providers.recompute(now=10.0)
    assert {route(router, snapshot).cluster for _ in range(4)} == {"a", "b"}


def test_failover_walks_the_group_first_then_the_next_groups() -> None:
    snapshot = snap("a", "b", "c", groups=[0, 0, 1], mode="deterministic")
    router = router_for("a", "b", "c")
    first = route(router, snapshot)
    assert first.cluster == "a"
    second = router.failover(first, [0])
    assert second is not None and second.cluster == "b"
    third = router.failover(first, [0, 1])
    assert third is not None and (third.cluster, third.selection_group) == ("c", 1)
    assert router.failover(first, [0, 1, 2]) is None


def test_unconfigured_clusters_are_never_selected_and_reported() -> None:
    snapshot = snap("a", "elsewhere")
    router = Router(provider_index={"a": 0}, providers=ProviderView(1))
    assert router.prepare(snapshot) == ["elsewhere"]
    assert {route(router, snapshot).cluster for _ in range(6)} == {"a"}


# --------------------------------------------------------------------------- eligibility


def test_context_window_keeps_only_the_providers_it_fits() -> None:
    snapshot = snap("small", "big")
    table = facts({"match": {"capability": "m", "cluster": "small"}, "context_window": 2000},
                  {"match": {"capability": "*", "cluster": "big"}, "context_window": 100_000})
    router = router_for("small", "big", facts=table)
    decisions = [route(router, snapshot, needs=Needs(tokens=50_000)) for _ in range(4)]
    assert {d.cluster for d in decisions} == {"big"}
    assert {(d.filtered, d.filtered_reasons) for d in decisions} == {(1, TOO_SMALL)}
    assert decisions[0].evidence[-1] == (b"x-gridgate-filtered", b"1")
    assert route(router, snapshot, needs=Needs(tokens=500)).filtered == 0
    too_big = router.route(snapshot, MODEL, "m", needs=Needs(tokens=500_000))
    assert isinstance(too_big, ErrorReply) and (too_big.status, too_big.code) == (400, "context_length_exceeded")
    assert (too_big.filtered, too_big.filtered_reasons) == (2, TOO_SMALL)  # the access line says what they removed
    assert "100000" in too_big.message


def test_missing_features_and_regions_are_named_in_a_422() -> None:
    snapshot = snap("a", "b")
    table = facts({"match": {"capability": "m", "cluster": "a"}, "features": ["vision"], "region": "us"},
                  {"match": {"capability": "m", "cluster": "b"}, "features": ["tools"], "region": "us"})
    router = router_for("a", "b", facts=table)
    assert {route(router, snapshot, needs=Needs(features=TOOLS)).cluster for _ in range(4)} == {"b"}
    reply = router.route(snapshot, MODEL, "m", needs=Needs(features=TOOLS | VISION, regions=frozenset({"eu"})))
    assert isinstance(reply, ErrorReply) and (reply.status, reply.code) == (422, "no_eligible_provider")
    assert "without tools, vision" in reply.message and "outside the allowed regions (eu)" in reply.message


def test_a_candidate_without_facts_is_unrestricted_but_has_no_region() -> None:
    snapshot = snap("a", "b")
    table = facts({"match": {"capability": "m", "cluster": "a"}, "region": "eu"})
    router = router_for("a", "b", facts=table)
    assert {route(router, snapshot, needs=Needs(tokens=10**9, features=TOOLS)).cluster for _ in range(4)} == {"a", "b"}
    assert {route(router, snapshot, needs=Needs(regions=frozenset({"eu"}))).cluster for _ in range(4)} == {"a"}


def test_failover_keeps_the_filters() -> None:
    snapshot = snap("a", "b", "c", mode="deterministic")
    table = facts({"match": {"capability": "m", "cluster": "b"}, "features": []})
    router = router_for("a", "b", "c", facts=table)
    needs = Needs(features=TOOLS)
    first = route(router, snapshot, needs=needs)
    following = router.failover(first, [0], needs)
    assert following is not None and following.cluster == "c"  # b lacks tools


# --------------------------------------------------------------------------- pickers


def test_weighted_is_exact_over_each_cycle() -> None:
    snapshot = snap("heavy", "light")
    table = facts({"match": {"capability": "m", "cluster": "heavy"}, "traffic_weight": 3})
    router = router_for("heavy", "light", picker="weighted", facts=table)
    picks = [route(router, snapshot).cluster for _ in range(40)]
    assert Counter(picks) == {"heavy": 30, "light": 10}
    assert all(Counter(picks[i:i + 4]) == {"heavy": 3, "light": 1} for i in range(0, 40, 4))
    assert route(router, snapshot).mode == "weighted"


def test_stable_hash_keeps_each_key_and_spreads_keys() -> None:
    snapshot = snap("a", "b", "c")
    router = router_for("a", "b", "c", picker="stable_hash")
    other = router_for("a", "b", "c", picker="stable_hash", worker_index=1)  # another worker agrees
    owners = {}
    for n in range(30):
        key = b"session-%d" % n
        picks = {route(r, snapshot, key=key).cluster for r in (router, other) for _ in range(3)}
        assert len(picks) == 1
        owners[key] = picks.pop()
    assert set(owners.values()) == {"a", "b", "c"}
    # Removing one provider moves only its keys.
    router.providers.down[0] = True
    router.providers.recompute(0.0)
    for key, owner in owners.items():
        moved = route(router, snapshot, key=key).cluster
        assert moved == owner or owner == "a"


def test_least_loaded_prefers_the_faster_and_counts_the_load() -> None:
    snapshot = snap("fast", "slow")
    inflight = {0: 0, 1: 0}
    view = ProviderView(2, inflight=lambda p: inflight[p])
    router = Router(provider_index={"fast": 0, "slow": 1}, providers=view, picker="least_loaded",
                    rng=random.Random(1))
    view.measured(0, 0.1, 1.0)
    view.measured(1, 0.5, 1.0)
    assert Counter(route(router, snapshot).cluster for _ in range(50)) == {"fast": 50}
    inflight[0] = 9  # (9 + 1) x 0.1 > (0 + 1) x 0.5: the load counts too
    assert Counter(route(router, snapshot).cluster for _ in range(50)) == {"slow": 50}


def loaded_shares(view: ProviderView, picks: int, seed: int = 5) -> Counter[str]:
    """Route ``picks`` requests that all stay in flight (a busy group): who got how many."""
    clusters = ("a", "b", "new")
    inflight = dict.fromkeys(range(3), 0)
    view.inflight = lambda p: inflight[p]
    router = Router(provider_index={c: i for i, c in enumerate(clusters)}, providers=view, picker="least_loaded",
                    rng=random.Random(seed))
    shares: Counter[str] = Counter()
    for _ in range(picks):
        decision = route(router, snap(*clusters))
        inflight[decision.provider] += 1
        shares[decision.cluster] += 1
    return shares


def test_an_unmeasured_provider_joining_a_busy_group_gets_its_fair_share_not_all_new_requests() -> None:
    view = ProviderView(3)
    view.measured(0, 0.2, 1.0)
    view.measured(1, 0.2, 1.0)
    shares = loaded_shares(view, 300)
    # Expected at the group's median (0.2 s), the newcomer balances in flight with the others: a third.
    # (Costed 0 until its first answer, it took every pick it was drawn for: two thirds.)
    assert 85 <= shares["new"] <= 115, shares


def test_an_explicit_latency_prior_is_what_an_unmeasured_provider_is_expected_to_take() -> None:
    view = ProviderView(3, latency_prior=0.6)  # three times the measured members' 0.2 s
    view.measured(0, 0.2, 1.0)
    view.measured(1, 0.2, 1.0)
    shares = loaded_shares(view, 300)
    assert 20 <= shares["new"] <= 60, shares  # in flight x 3 balances: about a seventh


def test_a_measurement_fades_toward_the_prior_as_it_ages() -> None:
    view = ProviderView(3)
    view.measured(0, 0.2, 1.0)
    view.measured(1, 0.2, 1.0)
    view.measured(2, 2.0, 1.0)  # "new" was slow when last measured ...
    assert loaded_shares(view, 300)["new"] <= 20
    view.measured(2, 2.0, 2.0 ** -10)  # ... ten half-lives ago: now it is expected at the median again
    assert 85 <= loaded_shares(view, 300)["new"] <= 115


# --------------------------------------------------------------------------- pinned route


@pytest.mark.parametrize("pin", ["b", "b-sid"])
def test_pinned_route_by_cluster_or_stable_id(pin: str) -> None:
    snapshot = snapshot_from_object({"local_site": "here", "selection_policy": {"mode": "roundRobin"}, "candidates": [
        {"kind": MODEL, "name": "m", "site": "s", "cluster": "a", "selection_group": 0},
        {"kind": MODEL, "name": "m", "site": "s", "cluster": "b", "selection_group": 1, "stable_id": "b-sid",
         "admission_state": "existing_only"},
    ]})
    router = router_for("a", "b")
    decision = router.pinned(snapshot, MODEL, "m", pin)
    assert isinstance(decision, RouteDecision)
    assert (decision.cluster, decision.mode, dict(decision.evidence)[b"x-gridgate-selection-mode"]) == (
        "b", "pinned", b"pinned")
    missing = router.pinned(snapshot, MODEL, "m", "nowhere")
    assert isinstance(missing, ErrorReply) and missing.status == 404
