"""Overlay file loading, change detection and last-known-good retention (docs/overlay.md#reload)."""

from __future__ import annotations

import copy
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest

from gateway.overlay.contract import MAX_OVERLAY_BYTES, OverlayRejected
from gateway.overlay.digest import semantic_revision
from gateway.overlay.watch import OverlayWatcher, SnapshotHolder, load_overlay_file
from gateway.routing import RouteDecision, Router

SCOPE = {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "here"}


def document(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "network": "net",
        "local_site": "here",
        "generated_at": "2026-01-01T00:00:00Z",
        "selection_policy": {"mode": "roundRobin"},
        "candidates": [
            {
                "kind": "inference_model",
                "name": "m",
                "site": "s",
                "cluster": c,
                "selection_group": 0,
                "stable_id": c,
            }
            for c in ("a", "b", "c")
        ],
    }
    doc.update(changes)
    return doc


def envelope(doc: dict[str, Any]) -> dict[str, Any]:
    revision = semantic_revision(doc)
    return {
        "schema_version": "1.0.0",
        "revision": {"kind": "content_addressed", "algorithm": "sha256", "value": revision},
        "content_digest": {"algorithm": "sha256", "value": revision},
        "scope": dict(SCOPE),
        "provenance": {
            "producer": "grid-operator",
            "producer_version": "1",
            "source_name": "net",
            "source_uid": "u",
            "source_generation": 1,
            "rendered_at": "2026-01-01T00:00:00Z",
        },
        "overlay": doc,
    }


def write(path: pathlib.Path, content: Any) -> None:
    """Atomic replace, as a publisher does (temp file + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content if isinstance(content, bytes) else json.dumps(content, indent=1).encode())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- load_overlay_file


def test_load_overlay_file_reads_a_valid_overlay(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, envelope(document()))
    snapshot = load_overlay_file(path, SCOPE)
    assert snapshot.is_envelope and snapshot.revision == semantic_revision(document())


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty"),
        (b" \n\t", "empty"),
        (b'{"local_site": ', "malformed_structure"),
        (b" " * (MAX_OVERLAY_BYTES + 1), "too_large"),
    ],
)
def test_load_overlay_file_rejections(tmp_path: pathlib.Path, content: bytes, reason: str) -> None:
    path = tmp_path / "overlay.json"
    path.write_bytes(content)
    with pytest.raises(OverlayRejected) as info:
        load_overlay_file(path)
    assert info.value.reason == reason


def test_unreadable_paths_are_rejected(tmp_path: pathlib.Path) -> None:
    for path in (tmp_path / "missing.json", tmp_path):
        with pytest.raises(OverlayRejected) as info:
            load_overlay_file(path)
        assert info.value.reason == "unreadable"


def test_file_at_the_size_bound_is_read(tmp_path: pathlib.Path) -> None:
    payload = json.dumps(document()).encode()
    path = tmp_path / "overlay.json"
    path.write_bytes(payload + b" " * (MAX_OVERLAY_BYTES - len(payload)))
    assert load_overlay_file(path).revision == semantic_revision(document())


def test_startup_with_an_invalid_overlay_raises(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, document(candidates=[]))
    with pytest.raises(OverlayRejected):
        SnapshotHolder.open(path)


# --------------------------------------------------------------------------- last-known-good


def _mutate_candidate(field: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    def mutate(doc: dict[str, Any]) -> Any:
        doc["candidates"][1][field] = value
        return envelope(doc)

    return mutate


def _mutate_envelope(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], Any]:
    def mutate(doc: dict[str, Any]) -> Any:
        root = envelope(doc)
        change(root)
        return root

    return mutate


def _digest(value: str) -> Callable[[dict[str, Any]], None]:
    def change(root: dict[str, Any]) -> None:
        root["content_digest"]["value"] = value

    return change


BAD_RELOADS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("empty file", lambda doc: b"", "empty"),
    ("malformed JSON", lambda doc: b'{"schema_version": "1.0.0", ', "malformed_structure"),
    ("oversized file", lambda doc: b" " * (MAX_OVERLAY_BYTES + 10), "too_large"),
    ("blank local_site", lambda doc: envelope(dict(doc, local_site=" ")), "invalid_field"),
    ("empty candidates", lambda doc: envelope(dict(doc, candidates=[])), "invalid_field"),
    ("unknown kind", _mutate_candidate("kind", "embedding"), "invalid_field"),
    ("unknown admission", _mutate_candidate("admission_state", "draining"), "invalid_field"),
    ("bad stable_id", _mutate_candidate("stable_id", "white space"), "invalid_field"),
    (
        "bad credential fields",
        _mutate_candidate("credential", {"strategy": "bearer_token", "secretRef": {"name": "n"}, "extra": 1}),
        "invalid_field",
    ),
    ("group rule broken", _mutate_candidate("selection_group", 2), "invalid_field"),
    ("legacy while a scope is expected", lambda doc: doc, "scope_mismatch"),
    (
        "unsupported schema version",
        _mutate_envelope(lambda r: r.update(schema_version="2.0.0")),
        "unsupported_schema_version",
    ),
    ("missing schema version", _mutate_envelope(lambda r: r.pop("schema_version")), "missing_schema_version"),
    ("malformed envelope", _mutate_envelope(lambda r: r.update(revision="abc")), "malformed_structure"),
    ("digest mismatch", _mutate_envelope(_digest("0" * 64)), "digest_mismatch"),
    (
        "revision digest mismatch",
        _mutate_envelope(lambda r: r["revision"].update(value="1" * 64)),
        "revision_digest_mismatch",
    ),
    ("scope mismatch", _mutate_envelope(lambda r: r["scope"].update(gateway="other-gw")), "scope_mismatch"),
]


@pytest.mark.parametrize(("case", "make", "reason"), BAD_RELOADS, ids=[case for case, _, _ in BAD_RELOADS])
def test_invalid_reload_keeps_last_known_good(
    tmp_path: pathlib.Path, case: str, make: Callable[[dict[str, Any]], Any], reason: str
) -> None:
    path = tmp_path / "overlay.json"
    write(path, envelope(document()))
    holder = SnapshotHolder.open(path, SCOPE)
    serving = holder.snapshot
    # a different, changed overlay would be accepted, so the rejection is what keeps the old one
    changed_doc = document(generated_at="2027-01-01T00:00:00Z")
    changed_doc["candidates"][0]["score"] = 0.5
    write(path, make(copy.deepcopy(changed_doc)))
    changed, error = holder.reload()
    assert changed is False
    assert error is not None and error.reason == reason, (case, error)
    assert holder.snapshot is serving
    assert holder.last_error is error


def test_read_failure_keeps_last_known_good(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, document())
    holder = SnapshotHolder.open(path)
    serving = holder.snapshot
    path.unlink()
    changed, error = holder.reload()
    assert (changed, holder.snapshot) == (False, serving)
    assert error is not None and error.reason == "unreadable"


def test_valid_changed_overlay_replaces_and_recovers(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, document())
    holder = SnapshotHolder.open(path)
    write(path, b"")
    assert holder.reload()[1] is not None
    write(path, document(selection_policy={"mode": "random"}))
    changed, error = holder.reload()
    assert (changed, error) == (True, None)
    assert holder.snapshot.mode == "random" and holder.last_error is None


def test_semantic_equivalent_rewrite_keeps_serving_snapshot_and_picker_state(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, document())
    holder = SnapshotHolder.open(path)
    router = Router()
    first = router.route(holder.snapshot, "inference_model", "m")
    assert isinstance(first, RouteDecision) and first.cluster == "a"
    serving = holder.snapshot
    write(path, envelope(document(generated_at="2030-01-01T00:00:00Z")))  # legacy -> envelope, same revision
    assert holder.reload() == (False, None)
    assert holder.snapshot is serving
    second = router.route(holder.snapshot, "inference_model", "m")
    assert isinstance(second, RouteDecision) and second.cluster == "b"


# --------------------------------------------------------------------------- OverlayWatcher


def test_watcher_reports_a_change_once_after_the_debounce(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, b"{}")
    watcher = OverlayWatcher(path, debounce_s=0.5)
    assert watcher.poll(0.0) is False
    write(path, b'{"changed": true}')
    assert watcher.poll(10.0) is False  # first sighting starts the debounce
    assert watcher.poll(10.4) is False
    assert watcher.poll(10.5) is True
    assert watcher.poll(11.0) is False


def test_watcher_restarts_the_debounce_while_the_file_keeps_changing(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, b"{}")
    watcher = OverlayWatcher(path, debounce_s=0.5)
    write(path, b"[1]")
    assert watcher.poll(1.0) is False
    write(path, b"[1, 2]")
    assert watcher.poll(1.4) is False
    assert watcher.poll(1.8) is False
    assert watcher.poll(1.9) is True


def test_watcher_with_zero_debounce_reports_on_first_sighting(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, b"{}")
    watcher = OverlayWatcher(path, debounce_s=0.0)
    write(path, b"[]")
    assert watcher.poll(0.0) is True


def test_watcher_sees_atomic_rename_with_same_size(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, b'{"v": 1}')
    watcher = OverlayWatcher(path, debounce_s=0.0)
    write(path, b'{"v": 2}')  # same size; a rename brings a new inode
    assert watcher.poll(0.0) is True


def test_watcher_sees_symlink_swap(tmp_path: pathlib.Path) -> None:
    (tmp_path / "v1.json").write_bytes(b'{"v": 1}')
    (tmp_path / "v2.json").write_bytes(b'{"v": 2}')
    path = tmp_path / "overlay.json"
    os.symlink("v1.json", path)
    watcher = OverlayWatcher(path, debounce_s=0.0)
    os.symlink("v2.json", tmp_path / "next")
    os.replace(tmp_path / "next", path)
    assert watcher.poll(0.0) is True


def test_watcher_sees_kubernetes_style_directory_swap(tmp_path: pathlib.Path) -> None:
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "overlay.json").write_bytes(b'{"v": "%s"}' % version.encode())
    os.symlink("v1", tmp_path / "..data")
    path = tmp_path / "overlay.json"
    os.symlink("..data/overlay.json", path)  # the path itself never changes
    watcher = OverlayWatcher(path, debounce_s=0.0)
    assert watcher.poll(0.0) is False
    os.symlink("v2", tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert watcher.poll(0.0) is True


def test_watcher_reports_deletion_and_reappearance(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, b"{}")
    watcher = OverlayWatcher(path, debounce_s=0.0)
    path.unlink()
    assert watcher.poll(0.0) is True
    assert watcher.poll(1.0) is False
    write(path, b"{}")
    assert watcher.poll(2.0) is True


def test_mark_seen_absorbs_a_change_already_handled(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "overlay.json"
    write(path, b"{}")
    watcher = OverlayWatcher(path, debounce_s=0.0)
    write(path, b"[]")
    watcher.mark_seen()  # e.g. SIGHUP already re-read it
    assert watcher.poll(0.0) is False
