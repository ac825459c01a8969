"""Immutable routing snapshot: the validated overlay indexed for the request path.

Built once per accepted overlay. Per capability ``(kind, name)`` it holds the ordered
selection groups (docs/overlay.md#selection-groups, enforced here) and precomputes what a request needs,
so routing is a dict lookup plus one picker step and never scans the candidate list.
"""

from __future__ import annotations

from typing import Any

import xxhash

from gateway.overlay.contract import (
    ADMISSION_NONE,
    NEW_AND_EXISTING,
    Candidate,
    OverlayRejected,
    ValidatedOverlay,
    field_error,
    parse_json,
    validate_overlay,
)

# Routes JSON-RPC MCP methods that name no tool (initialize, tools/list, ...): blank
# names are invalid in an overlay, so this key can never collide with a real capability.
MCP_SESSION_CAPABILITY = ("mcp_tool", "")


def capability_hash(kind: str, name: str) -> int:
    """64-bit capability id stored with affinity bindings."""
    return xxhash.xxh3_64_intdigest(f"{kind}\x00{name}".encode())


class Group:
    """One selection group: its number, shared admission state and member slots in file order."""

    __slots__ = ("number", "admission", "members")

    def __init__(self, number: int, admission: str, members: tuple[Candidate, ...]) -> None:
        self.number = number
        self.admission = admission
        self.members = members

    def __repr__(self) -> str:
        return f"Group({self.number}, {self.admission}, {[c.stable_id for c in self.members]})"


class Capability:
    """Everything routing needs for one ``(kind, name)``, precomputed at load.

    ``serving`` is what normal selection chooses from: the members of the first group
    whose admission is ``new_and_existing`` (or, ungrouped, the first such candidate),
    empty when nothing admits new sessions. ``reusable`` maps a stable-id hash to the
    candidate an existing session may keep (admission other than ``none``).
    """

    __slots__ = (
        "index",
        "kind",
        "name",
        "hash",
        "grouped",
        "groups",
        "members",
        "serving",
        "serving_group",
        "reusable",
        "accepts_any_binding",
    )

    def __init__(
        self,
        index: int,
        kind: str,
        name: str,
        members: tuple[Candidate, ...],
        groups: tuple[Group, ...],
        *,
        accepts_any_binding: bool = False,
    ) -> None:
        self.index = index
        self.kind = kind
        self.name = name
        self.hash = capability_hash(kind, name)
        self.members = members
        self.groups = groups
        self.grouped = bool(groups)
        self.serving: tuple[Candidate, ...] = ()
        self.serving_group: int | None = None
        if groups:
            for group in groups:
                if group.admission == NEW_AND_EXISTING:
                    self.serving, self.serving_group = group.members, group.number
                    break
        else:
            first = next((c for c in members if c.admission == NEW_AND_EXISTING), None)
            self.serving = (first,) if first is not None else ()
        self.reusable: dict[int, Candidate] = {}
        for cand in members:
            if cand.admission != ADMISSION_NONE:
                self.reusable.setdefault(cand.stable_id_hash, cand)
        # The MCP session route keeps any live mcp_tool binding of the session.
        self.accepts_any_binding = accepts_any_binding

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.name)

    def __repr__(self) -> str:
        return f"Capability({self.kind}/{self.name}, groups={self.groups!r})"


class Snapshot:
    """An accepted overlay, indexed. Treat as immutable; share it freely."""

    __slots__ = (
        "revision",
        "mode",
        "is_envelope",
        "local_site",
        "network",
        "generated_at",
        "scope",
        "provenance",
        "candidates",
        "capabilities",
        "capability_keys",
        "model_names",
        "clusters",
        "by_stable_hash",
    )

    def __init__(self, overlay: ValidatedOverlay, capabilities: dict[tuple[str, str], Capability]) -> None:
        self.revision = overlay.revision
        self.mode = overlay.mode
        self.is_envelope = overlay.is_envelope
        self.local_site = overlay.local_site
        self.network = overlay.network
        self.generated_at = overlay.generated_at
        self.scope = overlay.scope
        self.provenance = overlay.provenance
        self.candidates = overlay.candidates
        self.capabilities = capabilities
        # Real capabilities in order of first appearance (the MCP session route is not one).
        self.capability_keys = tuple(key for key in capabilities if key != MCP_SESSION_CAPABILITY)
        self.model_names = tuple(name for kind, name in self.capability_keys if kind == "inference_model")
        self.clusters = tuple(dict.fromkeys(c.cluster for c in overlay.candidates))
        self.by_stable_hash: dict[int, Candidate] = {}
        for cand in overlay.candidates:
            self.by_stable_hash.setdefault(cand.stable_id_hash, cand)

    def capability(self, kind: str, name: str) -> Capability | None:
        return self.capabilities.get((kind, name))

    def __repr__(self) -> str:
        return f"Snapshot({self.revision[:12]}, mode={self.mode}, capabilities={len(self.capability_keys)})"


def _groups_of(kind: str, name: str, members: tuple[Candidate, ...], prefix: str) -> tuple[Group, ...]:
    """Check the group rules (docs/overlay.md#selection-groups) for one capability; returns its groups,
    () when ungrouped."""
    label = f"{kind}/{name}"
    numbers = [c.selection_group for c in members]
    if all(n is None for n in numbers):
        return ()
    if None in numbers:
        odd = members[numbers.index(None)]
        raise field_error(
            f"{prefix}candidates[{odd.position}].selection_group",
            f"capability {label} mixes grouped and ungrouped candidates",
        )
    groups: list[Group] = []
    start = 0  # index in `members` where the current group began
    for i, cand in enumerate(members):
        number = numbers[i]
        path = f"{prefix}candidates[{cand.position}].selection_group"
        if i == 0:
            if number != 0:
                raise field_error(path, f"capability {label}: selection groups must start at 0, got {number}")
            continue
        previous = numbers[i - 1]
        if number < previous:
            raise field_error(
                path,
                f"capability {label}: selection groups must be non-decreasing in file order ({number} after {previous})",
            )
        if number > previous + 1:
            raise field_error(
                path, f"capability {label}: selection groups must be contiguous ({number} after {previous})"
            )
        if number != previous:
            groups.append(Group(previous, members[start].admission, members[start:i]))
            start = i
        elif cand.admission != members[start].admission:
            raise field_error(
                f"{prefix}candidates[{cand.position}].admission_state",
                f"capability {label}: selection group {number} mixes admission states "
                f"{members[start].admission} and {cand.admission}",
            )
    groups.append(Group(numbers[-1], members[start].admission, members[start:]))
    return tuple(groups)


def build_snapshot(overlay: ValidatedOverlay) -> Snapshot:
    """Index a validated overlay; raises :class:`OverlayRejected` on selection-group errors."""
    prefix = "overlay." if overlay.is_envelope else ""
    members: dict[tuple[str, str], list[Candidate]] = {}
    for cand in overlay.candidates:
        members.setdefault((cand.kind, cand.name), []).append(cand)
    capabilities: dict[tuple[str, str], Capability] = {}
    for index, ((kind, name), cands) in enumerate(members.items()):
        cap_members = tuple(cands)
        capabilities[(kind, name)] = Capability(
            index, kind, name, cap_members, _groups_of(kind, name, cap_members, prefix)
        )
    tools = tuple(c for c in overlay.candidates if c.kind == "mcp_tool")
    if tools:
        kind, name = MCP_SESSION_CAPABILITY
        capabilities[MCP_SESSION_CAPABILITY] = Capability(
            len(capabilities), kind, name, tools, (), accepts_any_binding=True
        )
    return Snapshot(overlay, capabilities)


def snapshot_from_object(root: Any, expected_scope: Any = None) -> Snapshot:
    """Validate and index an already-parsed overlay (e.g. inline candidates from the config)."""
    return build_snapshot(validate_overlay(root, expected_scope))


def snapshot_from_bytes(data: bytes, expected_scope: Any = None) -> Snapshot:
    """Parse, validate and index overlay bytes. Raises :class:`OverlayRejected`."""
    return snapshot_from_object(parse_json(data), expected_scope)


__all__ = [
    "MCP_SESSION_CAPABILITY",
    "Capability",
    "Group",
    "OverlayRejected",
    "Snapshot",
    "build_snapshot",
    "capability_hash",
    "snapshot_from_bytes",
    "snapshot_from_object",
]
