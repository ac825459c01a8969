"""Overlay contract validation (docs/overlay.md#formats): fixtures, descriptor rules, envelope, scope."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.overlay.contract import OverlayRejected, parse_json, validate_overlay
from gateway.overlay.digest import semantic_revision
from gateway.overlay.snapshot import snapshot_from_bytes, snapshot_from_object
from gateway.overlay.watch import load_overlay_file
from tests.contract_fixtures import OVERLAY_FIXTURES

FIXTURES = OVERLAY_FIXTURES
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]


def candidate(
    name: str = "model-a", site: str = "site-a", cluster: str = "cluster-a", **fields: Any
) -> dict[str, Any]:
    return {"kind": "inference_model", "name": name, "site": site, "cluster": cluster, **fields}


def legacy(*candidates: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "network": "net",
        "local_site": "site-a",
        "candidates": list(candidates or [candidate()]),
        **fields,
    }


def envelope(document: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    revision = semantic_revision(document)
    root: dict[str, Any] = {
        "schema_version": "1.0.0",
        "revision": {"kind": "content_addressed", "algorithm": "sha256", "value": revision},
        "content_digest": {"algorithm": "sha256", "value": revision},
        "scope": {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "site-a"},
        "provenance": {
            "producer": "grid-operator",
            "producer_version": "0.1.0",
            "source_name": "net",
            "source_uid": "uid",
            "source_generation": 3,
            "rendered_at": "2026-07-29T00:00:00Z",
        },
        "overlay": document,
    }
    root.update(overrides)
    return root


def rejection(root: Any, expected_scope: Any = None) -> OverlayRejected:
    with pytest.raises(OverlayRejected) as info:
        snapshot_from_object(root, expected_scope)
    return info.value


# --------------------------------------------------------------------------- normative fixtures


@pytest.mark.parametrize("fixture", sorted(MANIFEST))
def test_manifest_fixture_gives_listed_outcome(fixture: str) -> None:
    expected = MANIFEST[fixture]
    data = (FIXTURES / fixture).read_bytes()
    if expected["expected"] == "reject":
        with pytest.raises(OverlayRejected) as info:
            snapshot_from_bytes(data)
        assert info.value.reason == expected["reason"]
        return
    snapshot = snapshot_from_bytes(data)
    assert snapshot.is_envelope is (expected["expected"] == "accept")
    if "revision" in expected:
        assert snapshot.revision == expected["revision"]
    if "content_digest" in expected:
        assert snapshot.revision == expected["content_digest"]


def test_legacy_fixture_has_same_revision_as_its_envelope_twin() -> None:
    legacy_snapshot = snapshot_from_bytes((FIXTURES / "legacy-payload.json").read_bytes())
    assert legacy_snapshot.revision == MANIFEST["valid-multi-candidate.json"]["revision"]


def test_selection_policy_fixture_is_accepted_with_its_revision() -> None:
    snapshot = snapshot_from_bytes((FIXTURES / "valid-selection-policy.json").read_bytes())
    assert snapshot.revision == "d3321586b5e414b8bd80c07a9d16ac10dce38d6810e3591a8526a6bdd0639007"
    assert snapshot.mode == "roundRobin"


# --------------------------------------------------------------------------- candidate descriptor rules

BAD_CANDIDATES = [
    ({"name": "   "}, "candidates[0].name: must be 1..256 bytes, not blank"),
    ({"name": ""}, "candidates[0].name: must be 1..256 bytes, not blank"),
    ({"name": "x" * 257}, "candidates[0].name: must be 1..256 bytes, not blank"),
    ({"name": "é" * 129}, "candidates[0].name: must be 1..256 bytes, not blank"),
    ({"name": 7}, "candidates[0].name: must be 1..256 bytes, not blank"),
    ({"site": None}, "candidates[0].site: must be 1..256 bytes, not blank"),
    ({"cluster": "\t"}, "candidates[0].cluster: must be 1..256 bytes, not blank"),
    ({"kind": "embedding"}, "candidates[0].kind: must be one of inference_model, mcp_tool"),
    ({"kind": None}, "candidates[0].kind: must be one of"),
    ({"admission_state": "draining"}, "candidates[0].admission_state: must be one of"),
    ({"fresh": "yes"}, "candidates[0].fresh: must be a boolean"),
    ({"stable_id": ""}, "candidates[0].stable_id: must be 1..256 visible ASCII"),
    ({"stable_id": "has space"}, "candidates[0].stable_id: must be 1..256 visible ASCII"),
    ({"stable_id": "ünï"}, "candidates[0].stable_id: must be 1..256 visible ASCII"),
    ({"stable_id": "s" * 257}, "candidates[0].stable_id: must be 1..256 visible ASCII"),
    ({"stable_id": 12}, "candidates[0].stable_id: must be 1..256 visible ASCII"),
    ({"selection_group": -1}, "candidates[0].selection_group: must be an integer >= 0"),
    ({"selection_group": 0.0}, "candidates[0].selection_group: must be an integer >= 0"),
    ({"selection_group": True}, "candidates[0].selection_group: must be an integer >= 0"),
    ({"selection_group": "0"}, "candidates[0].selection_group: must be an integer >= 0"),
    ({"selection_tier": -2}, "candidates[0].selection_tier: must be an integer >= 0"),
    ({"selection_tier": 1.5}, "candidates[0].selection_tier: must be an integer >= 0"),
    ({"rank": -1}, "candidates[0].rank: must be an integer >= 0"),
    ({"credential": "token"}, "candidates[0].credential: must be an object"),
    (
        {"credential": {"strategy": "oauth2", "secretRef": {"name": "n", "namespace": "ns", "key": "k"}}},
        "candidates[0].credential.strategy: must be one of apikey, bearer_token",
    ),
    ({"credential": {"strategy": "bearer_token"}}, "candidates[0].credential.secretRef: must be an object"),
    (
        {
            "credential": {
                "strategy": "bearer_token",
                "secretRef": {"name": "n", "namespace": "ns", "key": "k"},
                "x": 1,
            }
        },
        "candidates[0].credential.x: unknown field",
    ),
    (
        {
            "credential": {
                "strategy": "bearer_token",
                "secretRef": {"name": "n", "namespace": "ns", "key": "k", "v": 2},
            }
        },
        "candidates[0].credential.secretRef.v: unknown field",
    ),
    (
        {
            "credential": {
                "strategy": "bearer_token",
                "secretRef": {"name": " ", "namespace": "ns", "key": "k"},
            }
        },
        "candidates[0].credential.secretRef.name: must be 1..256 bytes, not blank",
    ),
    (
        {"credential": {"strategy": "bearer_token", "secretRef": {"name": "n", "key": "k"}}},
        "candidates[0].credential.secretRef.namespace",
    ),
    (
        {
            "credential": {
                "strategy": "bearer_token",
                "secretRef": {"name": "n", "namespace": "ns", "key": "k"},
                "header": "x-api-key",
            }
        },
        "candidates[0].credential.header: only allowed with strategy apikey",
    ),
    (
        {
            "credential": {
                "strategy": "apikey",
                "secretRef": {"name": "n", "namespace": "ns", "key": "k"},
                "header": "a b",
            }
        },
        "candidates[0].credential.header: must be an HTTP header name",
    ),
]


@pytest.mark.parametrize(("fields", "detail"), BAD_CANDIDATES)
def test_candidate_descriptor_rules_reject_with_field_named(fields: dict[str, Any], detail: str) -> None:
    error = rejection(legacy(candidate(**fields)))
    assert error.reason == "invalid_field"
    assert detail in str(error)


def test_candidate_that_is_not_an_object_is_rejected() -> None:
    error = rejection(legacy(candidate(), "model-b"))  # type: ignore[arg-type]
    assert "candidates[1]: must be an object" in str(error)


def test_missing_required_candidate_field_is_named() -> None:
    raw = candidate()
    del raw["cluster"]
    assert "candidates[0].cluster" in str(rejection(legacy(raw)))


def test_boundary_sizes_are_accepted() -> None:
    snapshot = snapshot_from_object(legacy(candidate(name="é" * 128, site="s" * 256, stable_id="~" * 256)))
    assert snapshot.candidates[0].name == "é" * 128


def test_optional_fields_default_and_null_means_absent() -> None:
    snapshot = snapshot_from_object(
        legacy(
            candidate(fresh=None, admission_state=None, selection_group=None, stable_id=None, credential=None)
        )
    )
    cand = snapshot.candidates[0]
    assert cand.fresh is True
    assert cand.admission == "new_and_existing"
    assert cand.selection_group is None
    assert cand.stable_id == "inference_model/model-a/site-a/cluster-a"
    assert cand.credential is None


def test_unknown_candidate_fields_are_accepted_and_digested() -> None:
    plain = snapshot_from_object(legacy(candidate()))
    scored = snapshot_from_object(legacy(candidate(score=0.75, score_breakdown={"queue": 0.5})))
    assert plain.revision != scored.revision


def test_credential_references_are_parsed() -> None:
    snapshot = snapshot_from_object(
        legacy(
            candidate(
                credential={
                    "strategy": "bearer_token",
                    "secretRef": {"name": "n", "namespace": "ns", "key": "k"},
                }
            ),
            candidate(
                name="model-b",
                credential={
                    "strategy": "apikey",
                    "secretRef": {"name": "a", "namespace": "ns", "key": "api-key"},
                    "header": "x-api-key",
                },
            ),
        )
    )
    bearer, apikey = (c.credential for c in snapshot.candidates)
    assert bearer is not None and (bearer.strategy, bearer.secret_name, bearer.header) == (
        "bearer_token",
        "n",
        None,
    )
    assert apikey is not None and (apikey.strategy, apikey.secret_key, apikey.header) == (
        "apikey",
        "api-key",
        "x-api-key",
    )


def test_candidate_listed_twice_is_accepted_as_two_slots() -> None:
    snapshot = snapshot_from_object(legacy(candidate(rank=0), candidate(rank=1)))
    assert len(snapshot.candidates) == 2


def test_duplicate_identity_with_conflicting_definition_is_rejected() -> None:
    error = rejection(legacy(candidate(selection_group=0), candidate(selection_group=1)))
    assert "candidates[1]: duplicate candidate inference_model/model-a/site-a/cluster-a" in str(error)
    error = rejection(legacy(candidate(), candidate(admission_state="none")))
    assert "candidates[1]: duplicate candidate" in str(error)


def test_one_stable_id_for_two_candidates_is_rejected() -> None:
    error = rejection(legacy(candidate(stable_id="same"), candidate(cluster="cluster-b", stable_id="same")))
    assert "candidates[1].stable_id" in str(error)


# --------------------------------------------------------------------------- document rules


@pytest.mark.parametrize(
    ("document", "detail"),
    [
        ({"candidates": [candidate()]}, "local_site: required"),
        (legacy(local_site="  "), "local_site: must be 1..256 bytes, not blank"),
        (legacy(network=""), "network: must be 1..256 bytes, not blank"),
        ({"local_site": "s", "candidates": []}, "candidates: must be an array of 1..1024 candidates"),
        ({"local_site": "s", "candidates": {"0": candidate()}}, "candidates: must be an array"),
        ({"local_site": "s"}, "candidates: must be an array"),
        (legacy(selection_policy="roundRobin"), "selection_policy: must be an object"),
        (legacy(selection_policy={"mode": "leastLoaded"}), "selection_policy.mode: must be one of"),
        (legacy(selection_policy={"picker": "weighted"}), "selection_policy.picker: must be one of"),
        (
            legacy(selection_policy={"mode": "random", "weights": [1]}),
            "selection_policy.weights: unknown key",
        ),
        (
            legacy(selection_policy={"mode": "random", "picker": "random"}),
            "selection_policy: give mode or its alias",
        ),
        (legacy(selection_policy={}), "selection_policy.mode: must be one of"),
        (legacy(generated_at=5), "generated_at: must be a string"),
    ],
)
def test_document_rules_reject_with_field_named(document: dict[str, Any], detail: str) -> None:
    error = rejection(document)
    assert error.reason == "invalid_field"
    assert detail in str(error)


def test_candidate_count_bounds() -> None:
    many = [candidate(cluster=f"c{i}") for i in range(1024)]
    assert len(snapshot_from_object(legacy(*many)).candidates) == 1024
    assert "1..1024" in str(rejection(legacy(*many, candidate(cluster="one-too-many"))))


@pytest.mark.parametrize(
    ("policy", "mode"),
    [({"mode": "random"}, "random"), ({"picker": "roundRobin"}, "roundRobin"), (None, "deterministic")],
)
def test_selection_policy_mode_and_picker_alias(policy: Any, mode: str) -> None:
    assert snapshot_from_object(legacy(selection_policy=policy)).mode == mode


def test_no_selection_policy_is_deterministic() -> None:
    assert snapshot_from_object(legacy()).mode == "deterministic"


def test_root_must_be_an_object() -> None:
    assert rejection([legacy()]).reason == "malformed_structure"


@pytest.mark.parametrize(
    "data",
    [b"{", b'{"local_site": "a", "local_site": "b", "candidates": []}', b'{"x": NaN}', b"\xff\xfe", b"[1,]"],
)
def test_unparseable_json_is_malformed_structure(data: bytes) -> None:
    with pytest.raises(OverlayRejected) as info:
        parse_json(data)
    assert info.value.reason == "malformed_structure"


# --------------------------------------------------------------------------- envelope


def test_envelope_round_trip_accepts() -> None:
    snapshot = snapshot_from_object(envelope(legacy()))
    assert snapshot.is_envelope
    assert snapshot.scope == {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "site-a"}
    assert snapshot.provenance is not None and snapshot.provenance["source_generation"] == 3


def test_unknown_envelope_fields_are_accepted() -> None:
    assert snapshot_from_object(envelope(legacy(), future={"x": 1})).is_envelope


def test_any_envelope_marker_makes_an_envelope_without_fallback() -> None:
    document = legacy()
    for marker in ("revision", "content_digest", "scope", "provenance"):
        root = dict(document, **{marker: {}})
        assert rejection(root).reason == "missing_schema_version"


@pytest.mark.parametrize(
    ("overrides", "reason", "detail"),
    [
        ({"schema_version": "2.0.0"}, "unsupported_schema_version", "2.0.0"),
        ({"schema_version": 1}, "unsupported_schema_version", ""),
        (
            {"revision": {"kind": "counter", "algorithm": "sha256", "value": "0" * 64}},
            "malformed_structure",
            "revision.kind",
        ),
        (
            {"revision": {"kind": "content_addressed", "algorithm": "md5", "value": "0" * 64}},
            "malformed_structure",
            "revision",
        ),
        (
            {"revision": {"kind": "content_addressed", "algorithm": "sha256", "value": "A" * 64}},
            "malformed_structure",
            "revision",
        ),
        ({"content_digest": None}, "malformed_structure", "content_digest"),
        (
            {"scope": {"network": "net", "gateway": "gw", "namespace": "ns"}},
            "malformed_structure",
            "scope.local_site",
        ),
        ({"provenance": None}, "malformed_structure", "provenance"),
        ({"overlay": "{}"}, "malformed_structure", "overlay"),
    ],
)
def test_envelope_shape_errors(overrides: dict[str, Any], reason: str, detail: str) -> None:
    error = rejection(envelope(legacy(), **overrides))
    assert error.reason == reason
    assert detail in str(error)


def test_envelope_without_schema_version_is_missing_schema_version() -> None:
    root = envelope(legacy())
    del root["schema_version"]
    assert rejection(root).reason == "missing_schema_version"


def test_envelope_without_overlay_is_malformed() -> None:
    root = envelope(legacy())
    del root["overlay"]
    assert rejection(root).reason == "malformed_structure"


@pytest.mark.parametrize(
    ("field", "value", "detail"),
    [
        ("source_generation", 0, "provenance.source_generation"),
        ("source_generation", "1", "provenance.source_generation"),
        ("rendered_at", "yesterday", "provenance.rendered_at"),
        ("rendered_at", "2026-13-01T00:00:00Z", "provenance.rendered_at"),
        ("producer", "", "provenance.producer"),
    ],
)
def test_envelope_provenance_errors(field: str, value: Any, detail: str) -> None:
    root = envelope(legacy())
    root["provenance"][field] = value
    error = rejection(root)
    assert error.reason == "malformed_structure"
    assert detail in str(error)


@pytest.mark.parametrize("stamp", ["2026-07-29T00:00:00.123456789Z", "2026-07-29t10:00:00+02:00"])
def test_envelope_accepts_rfc3339_variants(stamp: str) -> None:
    root = envelope(legacy())
    root["provenance"]["rendered_at"] = stamp
    assert snapshot_from_object(root).is_envelope


def test_envelope_field_errors_name_the_overlay_path() -> None:
    error = rejection(envelope(legacy(candidate(), candidate(name=" "))))
    assert error.reason == "invalid_field"
    assert "overlay.candidates[1].name: must be 1..256 bytes, not blank" in str(error)


def test_envelope_digest_errors_in_contract_order() -> None:
    document = legacy()
    good = semantic_revision(document)
    other = "f" * 64
    digest_wrong = envelope(document, content_digest={"algorithm": "sha256", "value": other})
    assert rejection(digest_wrong).reason == "digest_mismatch"
    revision_wrong = envelope(
        document, revision={"kind": "content_addressed", "algorithm": "sha256", "value": other}
    )
    assert rejection(revision_wrong).reason == "revision_digest_mismatch"
    tampered = envelope(document)
    tampered["overlay"] = copy.deepcopy(document)
    tampered["overlay"]["candidates"][0]["rank"] = 9
    assert rejection(tampered).reason == "digest_mismatch"
    assert snapshot_from_object(envelope(document)).revision == good


def test_envelope_scope_consistency() -> None:
    root = envelope(legacy(network="other-net"))
    assert rejection(root).reason == "scope_mismatch"
    root = envelope(legacy(local_site="elsewhere"))
    assert rejection(root).reason == "scope_mismatch"
    root = envelope(legacy())
    root["provenance"]["source_name"] = "other-net"
    assert rejection(root).reason == "scope_mismatch"


# --------------------------------------------------------------------------- expected scope


def test_legacy_is_rejected_when_a_scope_is_expected() -> None:
    error = rejection(legacy(), {"network": "net", "gateway": None, "namespace": None, "local_site": None})
    assert error.reason == "scope_mismatch"


def test_all_null_expected_scope_is_not_configured() -> None:
    scope = SimpleNamespace(network=None, gateway=None, namespace=None, local_site=None)
    assert not snapshot_from_object(legacy(), scope).is_envelope


@pytest.mark.parametrize(
    "expected",
    [
        {"network": "net"},
        {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "site-a"},
        SimpleNamespace(network=None, gateway="gw", namespace=None, local_site="site-a"),
    ],
)
def test_configured_scope_fields_that_match_accept(expected: Any) -> None:
    assert snapshot_from_object(envelope(legacy()), expected).is_envelope


@pytest.mark.parametrize("field", ["network", "gateway", "namespace", "local_site"])
def test_configured_scope_field_that_differs_rejects(field: str) -> None:
    error = rejection(envelope(legacy()), {field: "somewhere-else"})
    assert error.reason == "scope_mismatch"
    assert field in error.detail


def test_validate_overlay_reports_revision_and_kind() -> None:
    validated = validate_overlay(envelope(legacy()))
    assert validated.is_envelope and validated.revision == semantic_revision(legacy())


# Written by hand like the contract fixtures: its digest was computed over the document as published,
# with the word "excluded" in it (Grid's topology notes), not over a normalised "none".
EXCLUDED_FIXTURE = Path(__file__).parents[1] / "fixtures" / "overlay-excluded-admission.json"
EXCLUDED_REVISION = "79d1740022435b5e22404ea19b150dd8cdb19b0f19107fb12e23c381ec45fcca"


def test_excluded_admission_fixture_is_accepted_as_none_with_the_published_digest() -> None:
    snapshot = load_overlay_file(EXCLUDED_FIXTURE, {"network": "test-net", "local_site": "site-a"})
    assert snapshot.revision == EXCLUDED_REVISION
    document = json.loads(EXCLUDED_FIXTURE.read_bytes())["overlay"]
    assert document["candidates"][0]["admission_state"] == "excluded"
    normalised = copy.deepcopy(document)
    normalised["candidates"][0]["admission_state"] = "none"
    assert semantic_revision(normalised) != EXCLUDED_REVISION  # the word is part of the digest
    assert [c.admission for c in snapshot.candidates] == ["none", "new_and_existing"]
    capability = snapshot.capability("inference_model", "model-a")
    assert capability is not None
    assert [c.cluster for c in capability.serving] == ["cluster-b"]
    assert sorted(c.cluster for c in capability.reusable.values()) == ["cluster-b"]  # excluded keeps no session


def test_unknown_admission_word_is_rejected_listing_excluded() -> None:
    error = rejection(legacy(candidate(admission_state="drained")))
    assert "none, excluded" in str(error)
    assert rejection(legacy(candidate(admission_state=["excluded"]))).reason == "invalid_field"
