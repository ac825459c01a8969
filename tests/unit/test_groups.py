"""Selection-group rules and the snapshot index (docs/overlay.md#selection-groups)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.overlay.contract import OverlayRejected
from gateway.overlay.digest import semantic_revision
from gateway.overlay.snapshot import MCP_SESSION_CAPABILITY, snapshot_from_object


def cand(
    name: str,
    cluster: str,
    group: int | None = None,
    admission: str | None = None,
    kind: str = "inference_model",
) -> dict[str, Any]:
    raw: dict[str, Any] = {"kind": kind, "name": name, "site": f"site-{cluster}", "cluster": cluster}
    if group is not None:
        raw["selection_group"] = group
    if admission is not None:
        raw["admission_state"] = admission
    return raw


def overlay(*candidates: dict[str, Any], mode: str | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {"local_site": "here", "candidates": list(candidates)}
    if mode is not None:
        document["selection_policy"] = {"mode": mode}
    return document


def rejected(document: dict[str, Any]) -> OverlayRejected:
    with pytest.raises(OverlayRejected) as info:
        snapshot_from_object(document)
    assert info.value.reason == "invalid_field"
    return info.value


def test_group_numbering_starts_at_zero() -> None:
    error = rejected(overlay(cand("m", "a", 1), cand("m", "b", 2)))
    assert "candidates[0].selection_group" in str(error)
    assert "inference_model/m" in str(error) and "start at 0" in str(error)


def test_group_members_have_uniform_admission() -> None:
    error = rejected(overlay(cand("m", "a", 0, "new_and_existing"), cand("m", "b", 0, "existing_only")))
    assert "candidates[1].admission_state" in str(error)
    assert "inference_model/m" in str(error) and "mixes admission states" in str(error)


def test_group_numbers_must_be_contiguous_per_capability() -> None:
    error = rejected(overlay(cand("m", "a", 0), cand("m", "b", 2)))
    assert "candidates[1].selection_group" in str(error) and "contiguous" in str(error)


def test_group_numbers_must_not_decrease_in_file_order() -> None:
    error = rejected(overlay(cand("m", "a", 0), cand("m", "b", 1), cand("m", "c", 0)))
    assert "candidates[2].selection_group" in str(error) and "non-decreasing" in str(error)


def test_grouped_and_ungrouped_must_not_mix_within_a_capability() -> None:
    error = rejected(overlay(cand("m", "a", 0), cand("m", "b")))
    assert "candidates[1].selection_group" in str(error) and "mixes grouped and ungrouped" in str(error)


def test_grouping_is_decided_per_capability() -> None:
    snapshot = snapshot_from_object(overlay(cand("m", "a", 0), cand("n", "b")))
    assert snapshot.capabilities[("inference_model", "m")].grouped
    assert not snapshot.capabilities[("inference_model", "n")].grouped


def test_interleaved_capabilities_keep_independent_group_indexes() -> None:
    snapshot = snapshot_from_object(
        overlay(
            cand("a", "a0", 0),
            cand("b", "b0", 0),
            cand("a", "a1", 1, "new_and_existing"),
            cand("b", "b1", 0),
            cand("b", "b2", 1, "none"),
            cand("a", "a2", 1),
            cand("a", "a3", 2, "existing_only"),
        )
    )
    a = snapshot.capabilities[("inference_model", "a")]
    b = snapshot.capabilities[("inference_model", "b")]
    assert [(g.number, [c.cluster for c in g.members]) for g in a.groups] == [
        (0, ["a0"]),
        (1, ["a1", "a2"]),
        (2, ["a3"]),
    ]
    assert [(g.number, g.admission, [c.cluster for c in g.members]) for g in b.groups] == [
        (0, "new_and_existing", ["b0", "b1"]),
        (1, "none", ["b2"]),
    ]


def test_interleaved_capability_errors_name_the_capability() -> None:
    error = rejected(overlay(cand("a", "a0", 0), cand("b", "b0", 1)))
    assert "inference_model/b" in str(error)


def test_same_name_different_kind_are_different_capabilities() -> None:
    snapshot = snapshot_from_object(overlay(cand("x", "a", 0), cand("x", "b", 0, kind="mcp_tool")))
    assert [c.cluster for c in snapshot.capabilities[("inference_model", "x")].serving] == ["a"]
    assert [c.cluster for c in snapshot.capabilities[("mcp_tool", "x")].serving] == ["b"]
    error = rejected(overlay(cand("x", "a", 0), cand("x", "b", 1, kind="mcp_tool")))
    assert "mcp_tool/x" in str(error) and "start at 0" in str(error)


def test_serving_group_is_first_new_and_existing_group() -> None:
    snapshot = snapshot_from_object(
        overlay(
            cand("m", "a", 0, "none"),
            cand("m", "b", 1, "existing_only"),
            cand("m", "c", 2),
            cand("m", "d", 2),
        )
    )
    cap = snapshot.capabilities[("inference_model", "m")]
    assert cap.serving_group == 2
    assert [c.cluster for c in cap.serving] == ["c", "d"]
    assert set(cap.reusable) == {c.stable_id_hash for c in snapshot.candidates if c.cluster in "bcd"}


def test_ungrouped_serving_is_first_new_and_existing_candidate() -> None:
    snapshot = snapshot_from_object(
        overlay(cand("m", "a", admission="existing_only"), cand("m", "b"), cand("m", "c"))
    )
    cap = snapshot.capabilities[("inference_model", "m")]
    assert cap.serving_group is None
    assert [c.cluster for c in cap.serving] == ["b"]


def test_nothing_admissible_leaves_serving_empty() -> None:
    snapshot = snapshot_from_object(overlay(cand("m", "a", 0, "none"), cand("m", "b", 1, "existing_only")))
    assert snapshot.capabilities[("inference_model", "m")].serving == ()


def test_snapshot_exposes_revision_mode_capabilities_clusters_and_stable_index() -> None:
    document = overlay(
        cand("m", "a", 0), cand("t", "b", kind="mcp_tool"), cand("m", "b", 0), cand("n", "a"), mode="random"
    )
    snapshot = snapshot_from_object(document)
    assert snapshot.revision == semantic_revision(document)
    assert snapshot.mode == "random"
    assert snapshot.is_envelope is False
    assert snapshot.capability_keys == (("inference_model", "m"), ("mcp_tool", "t"), ("inference_model", "n"))
    assert snapshot.model_names == ("m", "n")
    assert snapshot.clusters == ("a", "b")
    for candidate in snapshot.candidates:
        assert snapshot.by_stable_hash[candidate.stable_id_hash] is candidate


def test_mcp_session_route_exists_only_with_mcp_tools() -> None:
    without = snapshot_from_object(overlay(cand("m", "a")))
    assert MCP_SESSION_CAPABILITY not in without.capabilities
    with_tools = snapshot_from_object(
        overlay(
            cand("m", "a"),
            cand("t1", "x", kind="mcp_tool", admission="none"),
            cand("t2", "y", kind="mcp_tool"),
        )
    )
    session = with_tools.capabilities[MCP_SESSION_CAPABILITY]
    assert [c.cluster for c in session.serving] == ["y"]
    assert MCP_SESSION_CAPABILITY not in with_tools.capability_keys


def test_envelope_group_errors_name_the_overlay_path() -> None:
    from tests.unit.test_overlay_contract import envelope

    document = overlay(cand("m", "a", 1))
    document["network"] = "net"
    document["local_site"] = "site-a"
    with pytest.raises(OverlayRejected) as info:
        snapshot_from_object(envelope(document))
    assert "overlay.candidates[0].selection_group" in str(info.value)
