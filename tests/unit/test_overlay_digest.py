"""Semantic revision (docs/overlay.md#semantic-revision-digest): RFC 8785 canonical JSON, SHA-256,
floats exact."""

from __future__ import annotations

import hashlib
import json

import pytest

from gateway.overlay.contract import parse_json
from gateway.overlay.digest import canonical_bytes, semantic_revision
from tests.contract_fixtures import OVERLAY_FIXTURES

FIXTURES = OVERLAY_FIXTURES
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]


@pytest.mark.parametrize("fixture", sorted(name for name, entry in MANIFEST.items() if "revision" in entry))
def test_fixture_overlay_documents_hash_to_listed_revision(fixture: str) -> None:
    root = parse_json((FIXTURES / fixture).read_bytes())
    assert semantic_revision(root["overlay"]) == MANIFEST[fixture]["revision"]


def test_canonical_form_is_exact_jcs_of_the_selected_keys() -> None:
    document = {
        "generated_at": "2026-01-01T00:00:00Z",
        "local_site": "s",
        "candidates": [{"name": "m", "kind": "inference_model", "b": [1, 2], "a": "é"}],
        "extra": True,
    }
    expected = '{"candidates":[{"a":"é","b":[1,2],"kind":"inference_model","name":"m"}],"local_site":"s","network":null}'
    assert canonical_bytes(document) == expected.encode()
    assert semantic_revision(document) == hashlib.sha256(expected.encode()).hexdigest()


@pytest.mark.parametrize(
    ("literal", "canonical"),
    [
        ("0.1", "0.1"),
        ("1.0", "1"),
        ("-0.0", "0"),
        ("1e21", "1e+21"),
        ("1E-7", "1e-7"),
        ("123456789012.5", "123456789012.5"),
        ("0.30000000000000004", "0.30000000000000004"),
        ("9007199254740993", "9007199254740992"),  # beyond 2**53: a double, as JCS readers see it
    ],
)
def test_numbers_follow_rfc8785(literal: str, canonical: str) -> None:
    document = parse_json(f'{{"local_site":"s","candidates":[{{"score":{literal}}}]}}'.encode())
    assert (
        canonical_bytes(document)
        == f'{{"candidates":[{{"score":{canonical}}}],"local_site":"s","network":null}}'.encode()
    )


def test_float_scores_change_the_revision_exactly() -> None:
    def revision(score: str) -> str:
        return semantic_revision(
            parse_json(f'{{"local_site":"s","candidates":[{{"score":{score}}}]}}'.encode())
        )

    assert revision("0.5") == revision("0.50") == revision("5e-1")
    assert revision("0.5") != revision("0.5000000000000001")


def test_formatting_and_key_order_do_not_matter() -> None:
    compact = b'{"local_site":"s","network":"n","candidates":[{"kind":"mcp_tool","name":"t"}]}'
    spaced = b'{ "candidates" : [ { "name" : "t", "kind" : "mcp_tool" } ],\n  "network" : "n", "local_site" : "s" }'
    assert semantic_revision(parse_json(compact)) == semantic_revision(parse_json(spaced))


def test_timestamps_and_unknown_document_keys_are_outside_the_digest() -> None:
    base = {"local_site": "s", "candidates": [{"name": "m"}]}
    assert semantic_revision(base) == semantic_revision(
        {**base, "generated_at": "2099-01-01T00:00:00Z", "x": 1}
    )


def test_selection_policy_is_included_only_when_present() -> None:
    base = {"local_site": "s", "candidates": [{"name": "m"}]}
    with_policy = {**base, "selection_policy": {"mode": "roundRobin"}}
    assert semantic_revision(base) != semantic_revision(with_policy)
    assert b'"selection_policy":{"mode":"roundRobin"}' in canonical_bytes(with_policy)
    assert b"selection_policy" not in canonical_bytes(base)


def test_network_is_part_of_the_digest() -> None:
    base = {"local_site": "s", "candidates": [{"name": "m"}]}
    assert semantic_revision(base) != semantic_revision({**base, "network": "n"})
    assert b'"network":null' in canonical_bytes(base)


def test_candidate_order_is_part_of_the_digest() -> None:
    a, b = {"name": "a"}, {"name": "b"}
    assert semantic_revision({"local_site": "s", "candidates": [a, b]}) != semantic_revision(
        {"local_site": "s", "candidates": [b, a]}
    )
