"""The control plane publishes a provider that failed a required conformance check as excluded
(admission none, ``excluded_reason: nonconformant``); the data plane accepts the field and counts the
candidate under that reason."""

from __future__ import annotations

import dataclasses
import random

import pytest
import yaml

from gateway.config import ConfigError
from gateway.control.decide import NONCONFORMANT, decide
from gateway.control.spec import parse_spec
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.snapshot import snapshot_from_object
from gateway.routing.plan import CapabilityPlan
from tests.harness import candidate, envelope
from tests.unit.test_control_decide import BASE, make_spec, ok, provider, snapshot_of


def test_a_nonconformant_provider_is_published_excluded_with_its_reason() -> None:
    spec = make_spec(strategy="noMetrics", providers=[provider("a", "east"), provider("b", "east")])
    decision = decide(spec, {"a": ok(), "b": dataclasses.replace(ok(), nonconformant=("chat_stream",))})
    by_cluster = {c["cluster"]: c for c in decision.document["candidates"]}
    assert by_cluster["b"]["admission_state"] == "none" and by_cluster["b"]["excluded_reason"] == NONCONFORMANT
    assert by_cluster["b"]["score"] is None and by_cluster["b"]["fresh"] is False
    assert by_cluster["a"]["admission_state"] == "new_and_existing" and "excluded_reason" not in by_cluster["a"]
    assert "failed chat_stream" in decision.published["b"].reason
    snapshot = snapshot_of(spec, decision)  # the data plane's validator accepts the additive field
    excluded = {c.cluster: c.excluded_reason for c in snapshot.candidates}
    assert excluded == {"a": None, "b": NONCONFORMANT}
    plan = CapabilityPlan(snapshot.capability("inference_model", "m"), snapshot, 0, random.Random(0), {"a": 0, "b": 1})
    assert plan.overlay_excluded == {NONCONFORMANT: 1} and [o.candidate.cluster for o in plan.options] == ["a"]


def test_the_reason_must_be_a_word() -> None:
    bad = candidate("m", "a", admission="none", excluded_reason="not a word!")
    with pytest.raises(OverlayRejected, match=r"candidates\[0\].excluded_reason"):
        snapshot_from_object(envelope([bad]))
    admitted = snapshot_from_object(envelope([candidate("m", "a", excluded_reason="nonconformant")]))
    assert admitted.candidates[0].excluded_reason is None  # only an excluded candidate has a reason


def test_spec_conformance_section(tmp_path) -> None:
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump({"clusters": [{"name": "a", "endpoints": ["127.0.0.1:1"]}],
                                                      "routing": {"overlay_file": "o.json"}}))
    spec = parse_spec(yaml.safe_dump({**BASE, "conformance": {"gateway_config": "gw.yaml", "recheck": "10m"}}),
                      base_dir=str(tmp_path))
    assert spec.conformance is not None and spec.conformance.gateway_config == str(tmp_path / "gw.yaml")
    assert (float(spec.conformance.recheck), spec.conformance.surfaces, spec.conformance.max_tokens) == (
        600.0, ["chat"], 16)
    with pytest.raises(ConfigError) as info:
        parse_spec(yaml.safe_dump({**BASE, "conformance": {"gateway_config": "gw.yaml", "recheck": "0s"}}))
    assert any(p.startswith("conformance.recheck") for p in info.value.problems)
    with pytest.raises(ConfigError) as info:  # the provider's cluster is not in that gateway config
        parse_spec(yaml.safe_dump({**BASE, "providers": [provider("b", "east")],
                                   "conformance": {"gateway_config": "gw.yaml"}}), base_dir=str(tmp_path))
    assert info.value.problems == [f"conformance.gateway_config: {tmp_path / 'gw.yaml'} has no cluster 'b' "
                                   "(providers[0])"]
    with pytest.raises(ConfigError) as info:
        parse_spec(yaml.safe_dump({**BASE, "conformance": {"gateway_config": "missing.yaml"}}), base_dir=str(tmp_path))
    assert info.value.problems[0].startswith("conformance.gateway_config: ")
