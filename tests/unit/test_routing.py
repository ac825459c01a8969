"""Selection (docs/overlay.md#selection-groups) and session affinity (docs/overlay.md#session-affinity)
through the Router."""

from __future__ import annotations

import mmap
import random
from collections import Counter
from typing import Any

import pytest

from gateway.http.errors import ErrorReply
from gateway.overlay.snapshot import MCP_SESSION_CAPABILITY, Snapshot, snapshot_from_object
from gateway.routing import RouteDecision, Router
from shm.affinity import AffinityTable
from tests.unit.test_affinity import count_live

MODEL = "inference_model"


def cand(
    cluster: str, group: int | None = None, admission: str | None = None, name: str = "m", **extra: Any
) -> dict[str, Any]:
    raw: dict[str, Any] = {"kind": MODEL, "name": name, "site": "site", "cluster": cluster, **extra}
    if group is not None:
        raw["selection_group"] = group
    if admission is not None:
        raw["admission_state"] = admission
    return raw


def snap(*candidates: dict[str, Any], mode: str | None = "roundRobin", **document: Any) -> Snapshot:
    overlay: dict[str, Any] = {"local_site": "here", "candidates": list(candidates), **document}
    if mode is not None:
        overlay["selection_policy"] = {"mode": mode}
    return snapshot_from_object(overlay)


def clusters(router: Router, snapshot: Snapshot, n: int, name: str = "m", **kw: Any) -> list[str]:
    out = []
    for _ in range(n):
        decision = router.route(snapshot, MODEL, name, **kw)
        assert isinstance(decision, RouteDecision), decision
        out.append(decision.cluster)
    return out


def affinity_table(capacity: int = 256) -> AffinityTable:
    return AffinityTable(memoryview(mmap.mmap(-1, AffinityTable.required_bytes(capacity))), capacity)


# --------------------------------------------------------------------------- selection


def test_round_robin_distributes_only_inside_best_group() -> None:
    snapshot = snap(cand("a", 0), cand("b", 0), cand("c", 0), cand("d", 1))
    picks = clusters(Router(), snapshot, 300)
    assert picks[:6] == ["a", "b", "c", "a", "b", "c"]
    assert Counter(picks) == {"a": 100, "b": 100, "c": 100}


def test_unavailable_best_group_falls_through() -> None:
    snapshot = snap(
        cand("a", 0, "none"), cand("b", 1, "existing_only"), cand("c", 2), cand("d", 2), cand("e", 3)
    )
    router = Router()
    assert clusters(router, snapshot, 4) == ["c", "d", "c", "d"]
    decision = router.route(snapshot, MODEL, "m")
    assert isinstance(decision, RouteDecision) and decision.selection_group == 2


def test_ungrouped_overlay_preserves_first_candidate_selection() -> None:
    snapshot = snap(cand("a", admission="existing_only"), cand("b"), cand("c"), mode="roundRobin")
    router = Router()
    assert clusters(router, snapshot, 5) == ["b"] * 5
    decision = router.route(snapshot, MODEL, "m")
    assert isinstance(decision, RouteDecision) and decision.selection_group is None


def test_deterministic_always_selects_first_candidate_in_best_group() -> None:
    snapshot = snap(cand("a", 0, "none"), cand("b", 1), cand("c", 1), mode="deterministic")
    assert clusters(Router(worker_index=5), snapshot, 10) == ["b"] * 10


def test_no_selection_policy_is_deterministic() -> None:
    snapshot = snap(cand("a", 0), cand("b", 0), mode=None)
    assert clusters(Router(), snapshot, 4) == ["a"] * 4
    decision = Router().route(snapshot, MODEL, "m")
    assert isinstance(decision, RouteDecision) and decision.mode == "deterministic"


def test_random_stays_inside_the_best_group() -> None:
    snapshot = snap(
        cand("x", 0, "none"), cand("a", 1), cand("b", 1), cand("c", 1), cand("z", 2), mode="random"
    )
    picks = clusters(Router(rng=random.Random(1234)), snapshot, 600)
    counts = Counter(picks)
    assert set(counts) == {"a", "b", "c"}
    assert all(150 <= n <= 250 for n in counts.values()), counts


def test_round_robin_counter_wraps_without_leaving_group() -> None:
    snapshot = snap(cand("a", 0), cand("b", 0), cand("c", 1))
    picks = clusters(Router(), snapshot, 1001)
    assert picks == ["a", "b"] * 500 + ["a"]


def test_counters_are_isolated_per_capability() -> None:
    snapshot = snap(
        cand("a1", 0, name="a"),
        cand("b1", 0, name="b"),
        cand("a2", 0, name="a"),
        cand("b2", 0, name="b"),
        cand("b3", 0, name="b"),
    )
    router = Router()
    sequence = [(name, router.route(snapshot, MODEL, name).cluster) for name in "aabbbab"]  # type: ignore[union-attr]
    assert sequence == [
        ("a", "a1"),
        ("a", "a2"),
        ("b", "b1"),
        ("b", "b2"),
        ("b", "b3"),
        ("a", "a1"),
        ("b", "b1"),
    ]


def test_duplicate_candidates_are_separate_slots() -> None:
    snapshot = snap(cand("a", 0), cand("a", 0), cand("b", 0))
    assert Counter(clusters(Router(), snapshot, 300)) == {"a": 200, "b": 100}


def test_semantic_equivalent_rewrite_does_not_replace_picker_state() -> None:
    first = snap(cand("a", 0), cand("b", 0), cand("c", 0), generated_at="2026-01-01T00:00:00Z")
    rewrite = snap(cand("a", 0), cand("b", 0), cand("c", 0), generated_at="2099-01-01T00:00:00Z")
    assert first is not rewrite and first.revision == rewrite.revision
    router = Router()
    assert clusters(router, first, 1) == ["a"]
    assert clusters(router, rewrite, 2) == ["b", "c"]


def test_new_snapshot_has_independent_picker_state() -> None:
    first = snap(cand("a", 0), cand("b", 0), cand("c", 0))
    changed = snap(cand("a", 0, score=0.9), cand("b", 0), cand("c", 0))
    assert first.revision != changed.revision
    router = Router()
    assert clusters(router, first, 2) == ["a", "b"]
    assert clusters(router, changed, 2) == ["a", "b"]
    assert router.revision == changed.revision


def test_prepare_builds_plans_up_front_and_keeps_state_for_same_revision() -> None:
    snapshot = snap(cand("a", 0), cand("b", 0))
    router = Router()
    router.prepare(snapshot)
    assert router.revision == snapshot.revision
    assert clusters(router, snapshot, 1) == ["a"]
    router.prepare(snap(cand("a", 0), cand("b", 0), generated_at="later"))
    assert clusters(router, snapshot, 1) == ["b"]


def test_workers_start_at_different_offsets_and_spread_evenly() -> None:
    snapshot = snap(cand("a", 0), cand("b", 0), cand("c", 0))
    firsts = [clusters(Router(worker_index=w), snapshot, 1)[0] for w in range(3)]
    assert firsts == ["a", "b", "c"]
    total = Counter()
    for w in range(4):
        total.update(clusters(Router(worker_index=w), snapshot, 30))
    assert total == {"a": 40, "b": 40, "c": 40}


def test_unknown_capability_is_model_not_found() -> None:
    snapshot = snap(cand("a", 0))
    result = Router().route(snapshot, MODEL, "missing")
    assert isinstance(result, ErrorReply)
    assert (result.status, result.code) == (404, "model_not_found")
    assert "missing" in result.message
    mismatch = Router().route(snapshot, "mcp_tool", "m")
    assert isinstance(mismatch, ErrorReply) and mismatch.status == 404


def test_known_capability_without_admissible_candidate_is_503() -> None:
    snapshot = snap(cand("a", 0, "none"), cand("b", 1, "existing_only"))
    result = Router().route(snapshot, MODEL, "m")
    assert isinstance(result, ErrorReply)
    assert (result.status, result.code) == (503, "no_admissible")


def test_decision_carries_route_evidence() -> None:
    snapshot = snap(cand("a", 0, stable_id="sid-a"), cand("b", 0))
    decision = Router().route(snapshot, MODEL, "m")
    assert isinstance(decision, RouteDecision)
    candidate = decision.candidate
    assert (candidate.cluster, candidate.stable_id, candidate.kind, candidate.name, candidate.site) == (
        "a",
        "sid-a",
        MODEL,
        "m",
        "site",
    )
    assert (decision.selection_group, decision.mode, decision.affinity) == (0, "roundRobin", "none")
    assert decision.revision == snapshot.revision
    assert dict(decision.evidence) == {
        b"x-gridgate-provider": b"a",
        b"x-gridgate-stable-id": b"sid-a",
        b"x-gridgate-selection-group": b"0",
        b"x-gridgate-selection-mode": b"roundRobin",
        b"x-gridgate-overlay-revision": snapshot.revision.encode(),
        b"x-gridgate-affinity": b"none",
    }
    with pytest.raises(AttributeError):
        decision.cluster = "b"  # type: ignore[misc]


def test_default_stable_id_header_is_percent_encoded_when_not_visible_ascii() -> None:
    snapshot = snap(cand("a", name="modèle x"))
    decision = Router().route(snapshot, MODEL, "modèle x")
    assert isinstance(decision, RouteDecision)
    assert dict(decision.evidence)[b"x-gridgate-stable-id"] == b"inference_model/mod%C3%A8le%20x/site/a"


def test_mcp_session_methods_route_to_first_admissible_tool() -> None:
    snapshot = snap(
        cand("m", name="model"),
        {"kind": "mcp_tool", "name": "search", "site": "s", "cluster": "tools-a", "admission_state": "none"},
        {"kind": "mcp_tool", "name": "fetch", "site": "s", "cluster": "tools-b"},
        {"kind": "mcp_tool", "name": "search", "site": "s", "cluster": "tools-c"},
    )
    decision = Router().route(snapshot, *MCP_SESSION_CAPABILITY)
    assert isinstance(decision, RouteDecision) and decision.cluster == "tools-b"
    tool = Router().route(snapshot, "mcp_tool", "search")
    assert isinstance(tool, RouteDecision) and tool.cluster == "tools-c"
    no_tools = Router().route(snap(cand("m")), *MCP_SESSION_CAPABILITY)
    assert isinstance(no_tools, ErrorReply) and no_tools.status == 404


# --------------------------------------------------------------------------- affinity


def sticky(table: AffinityTable, ttl: float = 100.0, worker_index: int = 0) -> Router:
    return Router(worker_index=worker_index, affinity=table, affinity_ttl_s=ttl)


def route(
    router: Router, snapshot: Snapshot, key: bytes | None, now: float, name: str = "m"
) -> RouteDecision:
    decision = router.route(snapshot, MODEL, name, key, now)
    assert isinstance(decision, RouteDecision), decision
    return decision


def test_new_session_is_bound_then_reused_across_workers() -> None:
    table = affinity_table()
    snapshot = snap(cand("a", 0), cand("b", 0), cand("c", 0))
    first = route(sticky(table), snapshot, b"s1", 0.0)
    assert (first.cluster, first.affinity) == ("a", "new")
    # another worker (another Router over the same shared table) keeps the session
    for now in (1.0, 2.0, 3.0):
        again = route(sticky(table, worker_index=1), snapshot, b"s1", now)
        assert (again.cluster, again.affinity) == ("a", "reused")


def test_no_key_means_affinity_none_and_no_binding() -> None:
    table = affinity_table()
    snapshot = snap(cand("a", 0), cand("b", 0))
    decision = route(sticky(table), snapshot, None, 0.0)
    assert decision.affinity == "none"
    assert count_live(table, 0.0) == 0


def test_existing_session_can_use_existing_only() -> None:
    table = affinity_table()
    router = sticky(table)
    before = snap(cand("a", 0, stable_id="A"), cand("b", 1, stable_id="B"))
    assert route(router, before, b"s1", 0.0).cluster == "a"
    drained = snap(cand("a", 0, "existing_only", stable_id="A"), cand("b", 1, stable_id="B"))
    reused = route(router, drained, b"s1", 1.0)
    assert (reused.cluster, reused.affinity, reused.selection_group) == ("a", "reused", 0)
    newcomer = route(router, drained, b"s2", 1.0)
    assert (newcomer.cluster, newcomer.affinity) == ("b", "new")


def test_failover_skips_existing_only_candidate() -> None:
    table = affinity_table()
    router = sticky(table)
    before = snap(cand("a", 0, stable_id="A"), cand("x", 1, stable_id="X"), cand("y", 2, stable_id="Y"))
    assert route(router, before, b"s1", 0.0).cluster == "a"
    after = snap(
        cand("a", 0, "none", stable_id="A"),
        cand("x", 1, "existing_only", stable_id="X"),
        cand("y", 2, stable_id="Y"),
    )
    failover = route(router, after, b"s1", 1.0)
    assert (failover.cluster, failover.affinity) == ("y", "failover")
    assert (route(router, after, b"s1", 2.0).cluster, route(router, after, b"s1", 2.0).affinity) == (
        "y",
        "reused",
    )


def test_expired_binding_treated_as_new() -> None:
    table = affinity_table()
    router = sticky(table, ttl=10.0)
    snapshot = snap(cand("a", 0), cand("b", 0))
    assert route(router, snapshot, b"s1", 0.0).cluster == "a"
    assert route(router, snapshot, b"s1", 9.9).affinity == "reused"
    expired = route(router, snapshot, b"s1", 10.0)
    assert (expired.cluster, expired.affinity) == ("b", "new")


def test_reuse_does_not_extend_the_binding() -> None:
    table = affinity_table()
    router = sticky(table, ttl=10.0)
    snapshot = snap(cand("a", 0), cand("b", 0))
    route(router, snapshot, b"s1", 0.0)
    for now in (3.0, 6.0, 9.0):
        assert route(router, snapshot, b"s1", now).affinity == "reused"
    assert route(router, snapshot, b"s1", 10.5).affinity == "new"


def test_binding_survives_reload_with_same_stable_id() -> None:
    table = affinity_table()
    router = sticky(table)
    before = snap(cand("a", 0, stable_id="A"), cand("b", 0, stable_id="B"))
    route(router, before, b"s1", 0.0)  # a
    assert route(router, before, b"s2", 0.0).cluster == "b"
    # reordered, re-scored and with a new member: a different revision, same stable ids
    after = snap(
        cand("c", 0, stable_id="C"), cand("b", 0, stable_id="B", score=0.2), cand("a", 0, stable_id="A")
    )
    assert after.revision != before.revision
    assert (route(router, after, b"s1", 1.0).cluster, route(router, after, b"s2", 1.0).cluster) == ("a", "b")


def test_missing_candidate_after_reload_fails_over() -> None:
    table = affinity_table()
    router = sticky(table)
    before = snap(cand("a", 0, stable_id="A"), cand("b", 0, stable_id="B"))
    route(router, before, b"s1", 0.0)
    after = snap(cand("b", 0, stable_id="B"), cand("c", 0, stable_id="C"))
    decision = route(router, after, b"s1", 1.0)
    assert (decision.cluster, decision.affinity) == ("b", "failover")
    assert route(router, after, b"s1", 2.0).affinity == "reused"


def test_binding_to_another_capability_fails_over() -> None:
    table = affinity_table()
    router = sticky(table)
    snapshot = snap(cand("a", 0, name="m"), cand("b", 0, name="n"))
    assert route(router, snapshot, b"s1", 0.0, name="m").affinity == "new"
    switched = route(router, snapshot, b"s1", 1.0, name="n")
    assert (switched.cluster, switched.affinity) == ("b", "failover")


def test_nothing_admissible_with_a_session_is_503_and_binds_nothing() -> None:
    table = affinity_table()
    snapshot = snap(cand("a", 0, "existing_only"))
    result = sticky(table).route(snapshot, MODEL, "m", b"s1", 0.0)
    assert isinstance(result, ErrorReply) and result.status == 503
    assert count_live(table, 0.0) == 0


def test_mcp_session_route_keeps_a_tool_binding() -> None:
    table = affinity_table()
    router = sticky(table)
    snapshot = snap(
        {"kind": "mcp_tool", "name": "search", "site": "s", "cluster": "tools-a"},
        {"kind": "mcp_tool", "name": "fetch", "site": "s", "cluster": "tools-b"},
    )
    called = router.route(snapshot, "mcp_tool", "fetch", b"s1", 0.0)
    assert isinstance(called, RouteDecision) and called.cluster == "tools-b"
    listed = router.route(snapshot, *MCP_SESSION_CAPABILITY, b"s1", 1.0)
    assert isinstance(listed, RouteDecision) and (listed.cluster, listed.affinity) == ("tools-b", "reused")
