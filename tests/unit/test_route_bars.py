"""A request whose route is allowed only on some clusters never reaches the others (docs/security.md):
``Router.route`` and ``Router.failover`` skip its barred providers, in every picker, group, fallback and
affinity path. Pure."""

from __future__ import annotations

import mmap
import random
from typing import Any

import pytest

from gateway.http.errors import ErrorReply
from gateway.overlay.snapshot import Snapshot, snapshot_from_object
from gateway.routing import ProviderView, RouteDecision, Router
from shm.affinity import AffinityTable

MODEL = "inference_model"
CLUSTERS = ("a", "b", "c")
INDEX = {name: i for i, name in enumerate(CLUSTERS)}


def snap(groups: tuple[int, ...] = (0, 0, 0), mode: str = "roundRobin") -> Snapshot:
    candidates: list[dict[str, Any]] = [
        {"kind": MODEL, "name": "m", "site": "s", "cluster": c, "selection_group": g, "stable_id": c}
        for c, g in zip(CLUSTERS, groups, strict=True)
    ]
    return snapshot_from_object({"local_site": "here", "candidates": candidates, "selection_policy": {"mode": mode}})


def router(picker: str = "overlay", affinity: AffinityTable | None = None) -> Router:
    return Router(provider_index=INDEX, providers=ProviderView(len(CLUSTERS)), rng=random.Random(3), picker=picker,
                  affinity=affinity)


def route(r: Router, snapshot: Snapshot, barred: frozenset[int], session: bytes | None = None,
          key: bytes = b"") -> RouteDecision:
    decision = r.route(snapshot, MODEL, "m", session, 1.0, None, key, barred)
    assert isinstance(decision, RouteDecision), decision
    return decision


@pytest.mark.parametrize("picker", ["overlay", "weighted", "stable_hash", "least_loaded"])
@pytest.mark.parametrize("mode", ["roundRobin", "random", "deterministic"])
def test_barred_providers_are_never_picked(picker: str, mode: str) -> None:
    r = router(picker)
    snapshot = snap(mode=mode)
    only_b = frozenset({INDEX["a"], INDEX["c"]})
    picks = {route(r, snapshot, only_b, key=b"k%d" % n).cluster for n in range(30)}
    assert picks == {"b"}
    assert {route(r, snapshot, frozenset(), key=b"k%d" % n).cluster for n in range(30)} != {"b"}


def test_a_barred_group_falls_through_to_the_next_group() -> None:
    r = router()
    snapshot = snap(groups=(0, 0, 1), mode="deterministic")
    assert route(r, snapshot, frozenset({INDEX["a"], INDEX["b"]})).cluster == "c"


def test_when_every_allowed_provider_is_cooled_the_fallback_still_keeps_the_bar() -> None:
    r = router()
    view = r.providers
    view.cool(INDEX["b"], until=100.0, at=5.0)
    view.cool(INDEX["a"], until=100.0, at=1.0)  # the least recently cooled: the fallback's favourite
    view.recompute(now=6.0)
    assert route(r, snap(), frozenset({INDEX["a"], INDEX["c"]})).cluster == "b"


def test_nothing_allowed_is_the_unavailable_reply() -> None:
    decision = router().route(snap(), MODEL, "m", None, 1.0, None, b"", frozenset(INDEX.values()))
    assert isinstance(decision, ErrorReply) and decision.status == 503


def test_failover_never_moves_to_a_barred_provider() -> None:
    r = router()
    snapshot = snap(mode="deterministic")
    barred = frozenset({INDEX["b"]})
    first = route(r, snapshot, barred)
    assert first.cluster == "a"
    second = r.failover(first, [INDEX["a"]], None, b"", barred)
    assert second is not None and second.cluster == "c"
    assert r.failover(first, [INDEX["a"], INDEX["c"]], None, b"", barred) is None
    assert r.failover(first, [INDEX["a"]]).cluster == "b"  # type: ignore[union-attr]  # without the bar


def test_a_session_bound_to_a_barred_provider_is_served_elsewhere_and_keeps_its_binding() -> None:
    table = AffinityTable(memoryview(mmap.mmap(-1, AffinityTable.required_bytes(64))), 64)
    r = router(affinity=table)
    snapshot = snap(mode="deterministic")
    assert route(r, snapshot, frozenset(), b"s1").cluster == "a"  # bound to a
    moved = route(r, snapshot, frozenset({INDEX["a"]}), b"s1")
    assert (moved.cluster, moved.affinity) == ("b", "failover")
    kept = route(r, snapshot, frozenset(), b"s1")  # the session's other requests stay where they were
    assert (kept.cluster, kept.affinity) == ("a", "reused")
    fresh = route(r, snapshot, frozenset({INDEX["a"]}), b"s2")  # a new session is bound where it was served
    assert (fresh.cluster, fresh.affinity) == ("b", "new")
    assert route(r, snapshot, frozenset(), b"s2").affinity == "reused"
