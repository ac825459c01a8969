"""The control plane's pure core: spec parsing, admission, stabilization, ordering, groups (CONTRACT §8).

Every overlay rendered here is checked the way the data plane will check it: wrapped in an
envelope and indexed by the real validator (``snapshot_from_object``).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError
from gateway.control.decide import Decision, Hold, Observation, assess, decide, describe_changes, stabilize
from gateway.control.publish import render_envelope
from gateway.control.spec import ControlSpec, check_spec, parse_spec
from gateway.overlay.digest import semantic_revision
from gateway.overlay.snapshot import Snapshot, snapshot_from_object

SCOPE = {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "east"}
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def provider(name: str, site: str, models: tuple[str, ...] = ("m",), **extra: Any) -> dict[str, Any]:
    return {"name": name, "site": site, "models": list(models), "health_url": f"http://{name}.test/health",
            "metrics_url": f"http://{name}.test/metrics", **extra}


def make_spec(*, strategy: str = "queueDepth", routing: str = "geographyFirst", mode: str | None = "roundRobin",
              admission: dict[str, Any] | None = None, providers: list[dict[str, Any]] | None = None,
              **scoring: Any) -> ControlSpec:
    raw = {
        "output": "overlay.json",
        "scope": SCOPE,
        "routingPolicy": routing,
        "scoringPolicy": {"strategy": strategy, **scoring},
        "admission": admission or {"mode": "instantaneous"},
        "providers": providers or [provider("a", "east"), provider("b", "east"), provider("c", "west")],
    }
    if mode is not None:
        raw["selectionPolicy"] = {"mode": mode}
    return parse_spec(yaml.safe_dump(raw))


def ok(queue: float = 0, kv: float = 0.0) -> Observation:
    return Observation(healthy=True, queue_depth=queue, kv_cache_utilization=kv)


DOWN = Observation(healthy=False, error="health: HTTP 503")


def snapshot_of(spec: ControlSpec, decision: Decision) -> Snapshot:
    """The data plane's verdict on what would be published."""
    envelope = render_envelope(spec, decision.document, generation=1, now=NOW)
    return snapshot_from_object(envelope, SCOPE)


def rows(decision: Decision, model: str = "m") -> list[tuple[str, str, int]]:
    """(cluster, admission, group) per candidate of one model, in file order."""
    return [(c["cluster"], c["admission_state"], c["selection_group"])
            for c in decision.document["candidates"] if c["name"] == model]


def serving(spec: ControlSpec, decision: Decision, model: str = "m") -> list[str]:
    """The clusters the data plane would spread new sessions over."""
    capability = snapshot_of(spec, decision).capability("inference_model", model)
    assert capability is not None
    return [c.cluster for c in capability.serving]


# --------------------------------------------------------------------------- admission


def test_healthy_provider_under_thresholds_admits_new_sessions() -> None:
    spec = make_spec(queueDepthThreshold=10)
    result = assess(spec, ok(queue=3))
    assert (result.admission, result.fresh) == ("new_and_existing", True)


def test_queue_depth_above_threshold_is_existing_only_at_threshold_is_not() -> None:
    spec = make_spec(queueDepthThreshold=10)
    assert assess(spec, ok(queue=11)).admission == "existing_only"
    assert assess(spec, ok(queue=10)).admission == "new_and_existing"
    assert "queue depth 11 > 10" in assess(spec, ok(queue=11)).reason


def test_kv_cache_above_threshold_is_existing_only() -> None:
    spec = make_spec(strategy="kvCachePressure", kvCacheThreshold=0.8)
    assert assess(spec, ok(kv=0.81)).admission == "existing_only"
    assert assess(spec, ok(kv=0.8)).admission == "new_and_existing"


def test_strategy_metric_has_a_default_threshold_the_other_only_when_set() -> None:
    queue_only = make_spec(strategy="queueDepth")
    assert assess(queue_only, ok(queue=33)).admission == "existing_only"  # default queue threshold 32
    assert assess(queue_only, ok(kv=0.99)).admission == "new_and_existing"  # kv not checked
    both = make_spec(strategy="queueDepth", kvCacheThreshold=0.9)
    assert assess(both, ok(kv=0.99)).admission == "existing_only"


def test_unhealthy_or_unobserved_provider_is_none() -> None:
    spec = make_spec()
    for observation in (DOWN, None):
        result = assess(spec, observation)
        assert (result.admission, result.score, result.fresh) == ("none", None, False)
    decision = decide(spec, {"a": ok(), "b": ok()})  # c was not observed at all
    assert decision.published["c"].admission == "none"


def test_no_metrics_strategy_ignores_metrics() -> None:
    spec = make_spec(strategy="noMetrics", queueDepthThreshold=1)
    result = assess(spec, ok(queue=1000, kv=1.0))
    assert (result.admission, result.score, result.breakdown) == ("new_and_existing", 0.0, ())


def test_missing_gauges_keep_health_admission_but_are_stale_and_ranked_last() -> None:
    spec = make_spec(strategy="kvCachePressure", kvCacheThreshold=0.8)
    decision = decide(spec, {"a": Observation(True, error="metrics: HTTP 404"), "b": ok(kv=0.5), "c": ok()})
    unmeasured = decision.published["a"]
    assert (unmeasured.admission, unmeasured.fresh, unmeasured.score) == ("new_and_existing", False, None)
    # geographyFirst: local fresh b, then local stale a (a group of its own), then remote c.
    assert rows(decision) == [("b", "new_and_existing", 0), ("a", "new_and_existing", 1),
                              ("c", "new_and_existing", 2)]
    assert serving(spec, decision) == ["b"]


# --------------------------------------------------------------------------- scores


def test_queue_depth_strategy_scores_quantized_queue_pressure() -> None:
    spec = make_spec(strategy="queueDepth", queueDepthThreshold=8, scoreBands=4)
    assert [assess(spec, ok(queue=q)).score for q in (0, 1, 2, 5, 8, 50)] == [0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
    assert dict(assess(spec, ok(queue=5)).breakdown) == {"queue_depth_pressure": 0.5}


def test_kv_cache_strategy_scores_kv_pressure_and_breaks_down_every_checked_metric() -> None:
    spec = make_spec(strategy="kvCachePressure", kvCacheThreshold=0.8, queueDepthThreshold=10, scoreBands=4)
    result = assess(spec, ok(queue=5, kv=0.2))
    assert result.score == 0.25
    assert dict(result.breakdown) == {"queue_depth_pressure": 0.5, "kv_cache_pressure": 0.25}


def test_band_edges_do_not_depend_on_binary_rounding() -> None:
    spec = make_spec(strategy="kvCachePressure", kvCacheThreshold=0.9, scoreBands=4)
    assert assess(spec, ok(kv=0.45)).score == 0.5  # 0.45 / 0.9 is 0.4999... in binary


def test_metric_jitter_inside_a_band_keeps_the_revision() -> None:
    spec = make_spec(strategy="kvCachePressure", kvCacheThreshold=0.8, scoreBands=4)
    first = decide(spec, {"a": ok(kv=0.01), "b": ok(kv=0.22), "c": ok(kv=0.41)})
    second = decide(spec, {"a": ok(kv=0.19), "b": ok(kv=0.39), "c": ok(kv=0.59)})
    assert semantic_revision(first.document) == semantic_revision(second.document)
    third = decide(spec, {"a": ok(kv=0.21), "b": ok(kv=0.39), "c": ok(kv=0.59)})
    assert semantic_revision(third.document) != semantic_revision(first.document)


# --------------------------------------------------------------------------- stabilization


def test_instantaneous_admission_changes_at_once() -> None:
    spec = make_spec()
    first = decide(spec, {"a": ok(), "b": ok(), "c": ok()})
    second = decide(spec, {"a": DOWN, "b": ok(), "c": ok()}, first.holds)
    assert second.published["a"].admission == "none"


def test_stabilized_admission_changes_after_n_consecutive_observations() -> None:
    spec = make_spec(admission={"mode": "stabilized", "observations": 3})
    decision = decide(spec, {"a": ok(), "b": ok(), "c": ok()})
    assert decision.published["a"].admission == "new_and_existing"  # the first round publishes at once
    for expected in ("new_and_existing", "new_and_existing", "none"):
        decision = decide(spec, {"a": DOWN, "b": ok(), "c": ok()}, decision.holds)
        assert decision.published["a"].admission == expected
    for expected in ("none", "none", "new_and_existing"):  # recovery is held down the same way
        decision = decide(spec, {"a": ok(), "b": ok(), "c": ok()}, decision.holds)
        assert decision.published["a"].admission == expected


def test_stabilized_streak_restarts_when_an_observation_disagrees() -> None:
    spec = make_spec(admission={"mode": "stabilized", "observations": 2}, queueDepthThreshold=10)
    good = decide(spec, {"a": ok(), "b": ok(), "c": ok()})
    flapping = [DOWN, ok(), DOWN, ok(queue=50), DOWN]
    decision = good
    for observation in flapping:
        decision = decide(spec, {"a": observation, "b": ok(), "c": ok()}, decision.holds)
        assert decision.document == good.document
    decision = decide(spec, {"a": DOWN, "b": ok(), "c": ok()}, decision.holds)
    assert decision.published["a"].admission == "none"


def test_stabilize_keeps_published_state_while_pending() -> None:
    spec = make_spec()
    healthy, down = assess(spec, ok()), assess(spec, DOWN)
    hold = stabilize(down, Hold(healthy), required=3)
    assert (hold.published, hold.pending, hold.streak) == (healthy, down, 1)
    assert stabilize(healthy, hold, required=3) == Hold(healthy)


# --------------------------------------------------------------------------- ordering and groups


def test_geography_first_puts_local_site_first_even_when_remote_scores_better() -> None:
    spec = make_spec(routing="geographyFirst", queueDepthThreshold=8)
    decision = decide(spec, {"a": ok(queue=6), "b": ok(queue=2), "c": ok(queue=0)})
    # The local pair is one group ordered by score; the remote provider is the next tier.
    assert rows(decision) == [("b", "new_and_existing", 0), ("a", "new_and_existing", 0), ("c", "new_and_existing", 1)]
    assert [c["selection_tier"] for c in decision.document["candidates"]] == [0, 0, 1]
    assert serving(spec, decision) == ["b", "a"]


def test_score_first_orders_by_score_across_sites_in_one_group() -> None:
    spec = make_spec(routing="scoreFirst", queueDepthThreshold=8)
    decision = decide(spec, {"a": ok(queue=6), "b": ok(queue=2), "c": ok(queue=0)})
    assert rows(decision) == [("c", "new_and_existing", 0), ("b", "new_and_existing", 0), ("a", "new_and_existing", 0)]
    assert [c["rank"] for c in decision.document["candidates"]] == [0, 1, 2]
    assert [c["score"] for c in decision.document["candidates"]] == [0.0, 0.25, 0.75]
    assert serving(spec, decision) == ["c", "b", "a"]


def test_equivalent_providers_with_different_queue_depths_share_one_group_ordered_by_score() -> None:
    # Issue 11's reproduction: one site, queue depths 1, 9, 20 under threshold 32, scoreFirst, roundRobin.
    spec = make_spec(routing="scoreFirst", mode="roundRobin", queueDepthThreshold=32,
                     providers=[provider("a", "east"), provider("b", "east"), provider("c", "east")])
    decision = decide(spec, {"a": ok(queue=20), "b": ok(queue=1), "c": ok(queue=9)})
    assert rows(decision) == [("b", "new_and_existing", 0), ("c", "new_and_existing", 0), ("a", "new_and_existing", 0)]
    assert [c["score_breakdown"] for c in decision.document["candidates"]] == [
        {"queue_depth_pressure": 0.0}, {"queue_depth_pressure": 0.25}, {"queue_depth_pressure": 0.5}]
    snapshot = snapshot_of(spec, decision)
    assert snapshot.mode == "roundRobin"
    assert serving(spec, decision) == ["b", "c", "a"]  # new sessions rotate over all three


def test_admission_changes_still_split_groups_with_hysteresis() -> None:
    spec = make_spec(routing="scoreFirst", queueDepthThreshold=32, admission={"mode": "stabilized", "observations": 2},
                     providers=[provider("a", "east"), provider("b", "east"), provider("c", "east")])
    decision = decide(spec, {"a": ok(queue=20), "b": ok(queue=1), "c": ok(queue=9)})
    overloaded = {"a": ok(queue=40), "b": ok(queue=1), "c": ok(queue=9)}
    decision = decide(spec, overloaded, decision.holds)
    assert {r[2] for r in rows(decision)} == {0}  # one round above the threshold is held down
    decision = decide(spec, overloaded, decision.holds)
    assert rows(decision) == [("b", "new_and_existing", 0), ("c", "new_and_existing", 0), ("a", "existing_only", 1)]
    assert serving(spec, decision) == ["b", "c"]


def test_equal_admission_and_band_share_a_group_ordered_by_locality_then_name() -> None:
    spec = make_spec(routing="scoreFirst", queueDepthThreshold=8)
    decision = decide(spec, {"c": ok(queue=1), "b": ok(queue=0), "a": ok(queue=1)})
    assert rows(decision) == [("a", "new_and_existing", 0), ("b", "new_and_existing", 0), ("c", "new_and_existing", 0)]
    assert serving(spec, decision) == ["a", "b", "c"]


def test_geography_first_never_groups_local_with_remote() -> None:
    spec = make_spec(routing="geographyFirst")
    decision = decide(spec, {"a": ok(), "b": ok(), "c": ok()})
    assert rows(decision) == [("a", "new_and_existing", 0), ("b", "new_and_existing", 0), ("c", "new_and_existing", 1)]


def test_pressure_and_failure_move_new_sessions_elsewhere_but_keep_existing_ones() -> None:
    spec = make_spec(routing="geographyFirst", queueDepthThreshold=8)
    decision = decide(spec, {"a": ok(queue=9), "b": DOWN, "c": ok()})
    assert rows(decision) == [("a", "existing_only", 0), ("b", "none", 1), ("c", "new_and_existing", 2)]
    capability = snapshot_of(spec, decision).capability("inference_model", "m")
    assert capability is not None
    assert [c.cluster for c in capability.serving] == ["c"]
    assert sorted(c.cluster for c in capability.reusable.values()) == ["a", "c"]  # bound sessions on a finish


def test_capabilities_are_grouped_independently_and_sorted() -> None:
    spec = make_spec(providers=[provider("a", "east", ("m2", "m1")), provider("b", "west", ("m1",))])
    decision = decide(spec, {"a": ok(), "b": ok()})
    names = [(c["name"], c["cluster"], c["selection_group"]) for c in decision.document["candidates"]]
    assert names == [("m1", "a", 0), ("m1", "b", 1), ("m2", "a", 0)]
    snapshot_of(spec, decision)


def test_candidate_fields_and_credential_reference() -> None:
    credential = {"strategy": "bearer_token", "secretRef": {"name": "s", "namespace": "ns", "key": "token"}}
    spec = make_spec(providers=[provider("a", "east", cluster="cluster-a", credential=credential)])
    candidate = decide(spec, {"a": ok(queue=0)}).document["candidates"][0]
    assert candidate == {
        "kind": "inference_model", "name": "m", "site": "east", "cluster": "cluster-a", "fresh": True,
        "admission_state": "new_and_existing", "rank": 0, "selection_group": 0, "selection_tier": 0,
        "stable_id": "inference_model/m/east/cluster-a", "score": 0.0,
        "score_breakdown": {"queue_depth_pressure": 0.0}, "credential": credential,
    }
    snapshot = snapshot_of(spec, decide(spec, {"a": ok()}))
    assert snapshot.candidates[0].credential is not None


def test_selection_policy_is_published() -> None:
    for mode in ("deterministic", "roundRobin", "random"):
        spec = make_spec(mode=mode)
        decision = decide(spec, {"a": ok(), "b": ok(), "c": ok()})
        assert decision.document["selection_policy"] == {"mode": mode}
        assert snapshot_of(spec, decision).mode == mode


def test_omitted_selection_policy_stays_omitted_and_out_of_the_digest() -> None:
    spec = make_spec(mode=None)
    decision = decide(spec, {"a": ok(), "b": ok(), "c": ok()})
    assert "selection_policy" not in decision.document
    explicit = decide(make_spec(mode="deterministic"), {"a": ok(), "b": ok(), "c": ok()})
    assert semantic_revision(decision.document) != semantic_revision(explicit.document)
    snapshot = snapshot_of(spec, decision)
    assert (snapshot.mode, snapshot.revision) == ("deterministic", semantic_revision(decision.document))


def test_same_inputs_give_the_same_document_whatever_the_catalogue_order() -> None:
    providers = [provider(n, site, ("m", "n")) for n, site in (("a", "east"), ("b", "west"), ("c", "east"))]
    observations = {"a": ok(queue=3), "b": DOWN, "c": ok(queue=3)}
    forward = make_spec(providers=providers)
    backward = make_spec(providers=list(reversed(providers)))
    first = decide(forward, observations)
    assert decide(forward, dict(reversed(list(observations.items())))).document == first.document
    assert decide(backward, observations).document == first.document


def test_rendered_groups_always_satisfy_the_data_plane_rules() -> None:
    rng = random.Random(8785)
    sites = ("east", "west", "north")
    for _ in range(200):
        count = rng.randint(1, 7)
        providers = [provider(f"p{i}", rng.choice(sites), tuple(rng.sample(("m1", "m2", "m3"), rng.randint(1, 3))))
                     for i in range(count)]
        spec = make_spec(
            strategy=rng.choice(("noMetrics", "queueDepth", "kvCachePressure")),
            routing=rng.choice(("geographyFirst", "scoreFirst")),
            mode=rng.choice(("deterministic", "roundRobin", "random")),
            admission={"mode": "stabilized", "observations": rng.randint(1, 3)},
            providers=providers, queueDepthThreshold=8, kvCacheThreshold=0.8, scoreBands=rng.randint(1, 5),
        )
        holds = None
        for _ in range(3):
            observations = {
                p["name"]: rng.choice((DOWN, ok(rng.randint(0, 12), rng.random()), Observation(True, error="x")))
                for p in providers if rng.random() > 0.1
            }
            decision = decide(spec, observations, holds)
            holds = decision.holds
            snapshot = snapshot_of(spec, decision)  # raises on any §4.2 violation
            for capability in snapshot.capabilities.values():
                assert capability.grouped
                numbers = [g.number for g in capability.groups]
                assert numbers == list(range(len(numbers)))
                assert [c.rank for c in capability.members] == list(range(len(capability.members)))
            # Groups split on (tier,) admission and freshness only: one group per distinct key, never two.
            geography = spec.routing_policy == "geographyFirst"
            for model in ("m1", "m2", "m3"):
                pairs = {((c["selection_tier"] if geography else 0, c["admission_state"], c["fresh"]),
                          c["selection_group"]) for c in decision.document["candidates"] if c["name"] == model}
                assert len(pairs) == len({key for key, _ in pairs}) == len({group for _, group in pairs})


def test_describe_changes_names_each_changed_provider() -> None:
    spec = make_spec()
    before = decide(spec, {"a": ok(), "b": ok(), "c": ok()}).published
    after = decide(spec, {"a": ok(), "b": DOWN, "c": ok()}).published
    assert describe_changes(before, after) == [
        "b: new_and_existing score=0 -> none score=null stale (health: HTTP 503)"
    ]


# --------------------------------------------------------------------------- spec


def spec_problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_spec(yaml.safe_dump(raw))
    return info.value.problems


BASE = {"output": "overlay.json", "scope": SCOPE, "providers": [provider("a", "east")]}


def test_spec_defaults() -> None:
    spec = parse_spec(yaml.safe_dump(BASE), base_dir="/srv")
    assert spec.output == "/srv/overlay.json"
    assert (spec.interval, spec.probe_timeout) == (5.0, 2.0)
    assert (spec.routing_policy, spec.scoring_policy.strategy, spec.selection_policy, spec.admission.mode) == (
        "geographyFirst", "noMetrics", None, "instantaneous")
    assert spec.providers[0].cluster_name == "a"


def test_spec_rejects_unknown_keys_naming_the_field() -> None:
    assert spec_problems({**BASE, "scoringPolicy": {"strategy": "noMetrics", "treshold": 1}}) == [
        "scoringPolicy.treshold: unknown key"]
    assert spec_problems({**BASE, "providers": [{**provider("a", "east"), "weight": 2}]}) == [
        "providers[0].weight: unknown key"]


def test_spec_rejects_bad_values_naming_the_field() -> None:
    assert spec_problems({**BASE, "interval": "5 seconds"})[0].startswith("interval: invalid duration")
    assert spec_problems({**BASE, "routingPolicy": "nearest"})[0].startswith("routingPolicy: ")
    problems = spec_problems({**BASE, "interval": "1s", "probe_timeout": "2s",
                              "scoringPolicy": {"strategy": "queueDepth"},
                              "providers": [provider("a", "east", metrics_url=None),
                                            provider("a", "east", ("bad model",))]})
    assert problems == [
        "probe_timeout: must not exceed interval (a cycle would overrun the next)",
        "providers[0].metrics_url: required by scoringPolicy.strategy queueDepth",
        "providers[1].name: duplicate provider name 'a' (first at providers[0])",
        "providers[1].models[0]: stable id 'inference_model/bad model/east/a' must be 1..256 visible ASCII "
        "characters (model, site and cluster without spaces)",
    ]


def test_spec_rejects_two_providers_claiming_one_candidate() -> None:
    problems = spec_problems({**BASE, "providers": [provider("a", "east", cluster="x"),
                                                    provider("b", "east", cluster="x")]})
    assert problems == ["providers[1].models[0]: inference_model/m/east/x is already offered by "
                        "providers[0].models[0] (same kind, model, site and cluster)"]


def test_check_spec_returns_problem_lines(tmp_path: Any) -> None:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump({**BASE, "output": "missing/overlay.json", "bogus": 1}))
    assert check_spec(str(path)) == ["bogus: unknown key"]
    path.write_text(yaml.safe_dump({**BASE, "output": "missing/overlay.json"}))
    assert check_spec(str(path)) == [f"output: directory {tmp_path}/missing does not exist"]
    assert check_spec(str(tmp_path / "absent.yaml"))[0].startswith("(file): cannot read")
    path.write_text(yaml.safe_dump(BASE))
    assert check_spec(str(path)) == []


def test_example_spec_in_deploy_is_valid() -> None:
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert check_spec(os.path.join(root, "deploy", "control", "control.yaml")) == []
