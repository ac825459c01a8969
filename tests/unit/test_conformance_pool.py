"""A nonconformant provider in the pure routing parts: out of selection, counted under its reason, last in
the fallback; and the verdict per provider from endpoint reports."""

from __future__ import annotations

import json

from gateway.conformance.probe import FAIL, PASS, SKIPPED, Result, Target
from gateway.conformance.runner import TargetReport
from gateway.conformance.verdicts import provider_verdicts
from gateway.overlay.snapshot import snapshot_from_bytes
from gateway.routing import ProviderView, RouteDecision, Router
from gateway.routing.evidence import route_evidence
from shm.conformance import ConformanceFlags


def snapshot(clusters: list[str]):
    candidates = [{"kind": "inference_model", "name": "m", "site": f"site-{c}", "cluster": c, "selection_group": 0}
                  for c in clusters]
    return snapshot_from_bytes(json.dumps({"local_site": "l", "selection_policy": {"mode": "deterministic"},
                                           "candidates": candidates}).encode())


def test_a_nonconformant_provider_is_left_out_under_its_reason() -> None:
    view = ProviderView(3)
    view.nonconformant[0] = True
    view.down[1] = True
    view.recompute(0.0)
    router = Router(provider_index={"first": 0, "second": 1, "third": 2}, providers=view)
    decision = router.route(snapshot(["first", "second", "third"]), "inference_model", "m")
    assert type(decision) is RouteDecision and decision.cluster == "third"
    assert route_evidence(decision, view, None, None).excluded == {"nonconformant": 1, "unhealthy": 1}


def test_nonconformant_is_the_last_resort_when_nothing_is_usable() -> None:
    view = ProviderView(2)
    view.nonconformant[0] = True
    view.down[1] = True
    view.recompute(0.0)
    router = Router(provider_index={"failed": 0, "down": 1}, providers=view)
    decision = router.route(snapshot(["failed", "down"]), "inference_model", "m")
    assert type(decision) is RouteDecision and decision.cluster == "down"


def test_flags_are_words_per_provider() -> None:
    buffer = memoryview(bytearray(ConformanceFlags.required_bytes(4)))
    flags = ConformanceFlags(buffer, 4)
    flags.mark(2, True)
    flags.mark(9, True)  # past the table: ignored
    assert [flags.nonconformant(p) for p in range(5)] == [False, False, True, False, False]
    flags.clear()
    assert not flags.nonconformant(2)


def report(cluster: str, address: str, *results: Result) -> TargetReport:
    return TargetReport(Target(cluster, address, "m"), list(results))


def test_one_failing_endpoint_makes_the_provider_nonconformant() -> None:
    ok = Result("chat", PASS, "ok", True, tokens=5)
    failed = Result("chat_stream", FAIL, "no [DONE]", True, tokens=7)
    informational = Result("latency", FAIL, "slow", False)
    skipped = Result("tools", SKIPPED, "not claimed", True)
    verdicts = provider_verdicts([
        report("a", "h:1", ok, skipped), report("a", "h:2", ok, failed),
        report("b", "h:3", ok, informational),
    ], checked_at=1.0)
    assert not verdicts["a"].conformant and verdicts["a"].failed_checks == {"chat_stream"}
    assert verdicts["a"].failures == ("chat_stream (h:2, m): no [DONE]",)
    assert verdicts["a"].tokens == 17
    assert verdicts["b"].conformant  # an informational check never decides
