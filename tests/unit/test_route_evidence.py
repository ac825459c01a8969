"""Route evidence (gateway/routing/evidence.py): what a decision considered and left out, and why, from
the router's own state; and least_loaded's two compared scores."""

from __future__ import annotations

import json

from gateway.config import ModelFacts, ModelMatch
from gateway.overlay.snapshot import snapshot_from_bytes
from gateway.routing import ProviderView, RouteDecision, Router
from gateway.routing.eligibility import FactsTable, Needs
from gateway.routing.evidence import PickerInput, route_evidence


def snapshot(clusters: list[str], mode: str = "deterministic"):
    candidates = [{"kind": "inference_model", "name": "m", "site": f"site-{c}", "cluster": c, "selection_group": 0}
                  for c in clusters]
    return snapshot_from_bytes(json.dumps({"local_site": "l", "selection_policy": {"mode": mode},
                                           "candidates": candidates}).encode())


def test_each_left_out_candidate_is_counted_under_its_first_reason() -> None:
    clusters = ["ok", "cooled", "down", "small", "barred", "ghost", "down-and-cooled"]
    configured = {name: index for index, name in enumerate(c for c in clusters if c != "ghost")}
    view = ProviderView(len(configured))
    view.down[configured["down"]] = view.down[configured["down-and-cooled"]] = True
    view.cooled_until[configured["cooled"]] = view.cooled_until[configured["down-and-cooled"]] = 100.0
    view.recompute(0.0)
    facts = FactsTable([ModelFacts(match=ModelMatch(capability="m", cluster="small"), context_window=100)])
    router = Router(provider_index=configured, providers=view, facts=facts)
    needs = Needs(tokens=1000)
    barred = frozenset({configured["barred"]})
    decision = router.route(snapshot(clusters), "inference_model", "m", needs=needs, barred=barred)
    assert type(decision) is RouteDecision and decision.cluster == "ok"
    evidence = route_evidence(decision, view, needs, barred)
    assert (evidence.site, evidence.admission_state, evidence.candidates) == ("site-ok", "new_and_existing", 7)
    assert evidence.excluded == {"cooled": 1, "unhealthy": 2, "filtered": 1, "not_allowed": 1, "not_configured": 1}
    assert evidence.picker_inputs is None


def test_nothing_left_out_is_an_empty_count() -> None:
    router = Router(provider_index={"a": 0, "b": 1}, providers=ProviderView(2))
    decision = router.route(snapshot(["a", "b"]), "inference_model", "m")
    evidence = route_evidence(decision, router.providers, None, None)  # type: ignore[arg-type]
    assert (evidence.candidates, evidence.excluded) == (2, {})


def test_least_loaded_reports_the_two_scores_it_compared() -> None:
    view = ProviderView(2, inflight=lambda provider: 3 if provider == 0 else 0)
    view.measured(0, 0.2, 1.0)
    view.measured(1, 0.1, 1.0)
    router = Router(provider_index={"busy": 0, "idle": 1}, providers=view, picker="least_loaded")
    decision = router.route(snapshot(["busy", "idle"]), "inference_model", "m")
    assert type(decision) is RouteDecision and decision.cluster == "idle"
    evidence = route_evidence(decision, view, None, None)
    # (in flight + 1) x latency: busy (3 + 1) x 0.2 = 0.8, idle (0 + 1) x 0.1 = 0.1
    assert sorted(evidence.picker_inputs, key=lambda p: p.provider) == [  # type: ignore[arg-type]
        PickerInput("busy", 0.8), PickerInput("idle", 0.1)]


def test_a_decision_the_picker_did_not_make_has_no_picker_inputs() -> None:
    view = ProviderView(2)
    router = Router(provider_index={"a": 0, "b": 1}, providers=view, picker="least_loaded")
    plan_snapshot = snapshot(["a", "b"])
    router.route(plan_snapshot, "inference_model", "m")  # the group's latest comparison: a and b
    pinned = router.pinned(plan_snapshot, "inference_model", "m", "b")
    assert type(pinned) is RouteDecision
    assert route_evidence(pinned, view, None, None).picker_inputs is None  # a pin is not least_loaded's pick
