"""Overlay contract: parse and validate a routing overlay (docs/overlay.md#formats).

Pure: takes bytes or an already-parsed JSON value, returns data or raises
:class:`OverlayRejected`. No file access, no clock.

Validation order (the first failing step decides the reason):

1. the document is a JSON object, else ``malformed_structure``;
2. envelope detection: a top-level object with any of ``schema_version``,
   ``revision``, ``content_digest``, ``scope``, ``provenance`` is an envelope and
   never falls back to legacy;
3. legacy while an expected scope is configured: ``scope_mismatch``;
4. envelope ``schema_version``: absent -> ``missing_schema_version``, not
   ``"1.0.0"`` -> ``unsupported_schema_version``;
5. envelope shape (``revision``, ``content_digest``, ``scope``, ``provenance``,
   ``overlay``): ``malformed_structure`` naming the field;
6. the overlay document and every candidate: ``invalid_field`` naming the field;
7. recomputed semantic digest != ``content_digest.value``: ``digest_mismatch``;
8. ``revision.value`` != ``content_digest.value``: ``revision_digest_mismatch``;
9. scope consistency (overlay vs scope, provenance.source_name vs scope.network)
   and the configured expected scope: ``scope_mismatch``.

Selection-group rules (docs/overlay.md#selection-groups) are checked afterwards, when the snapshot
indexes the groups (see :mod:`gateway.overlay.snapshot`).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import xxhash

from gateway.overlay.digest import semantic_revision
from gateway.overlay.envelope import (  # noqa: F401 - re-exported: the contract's one catalogue
    ENVELOPE_MARKERS,
    SCOPE_FIELDS,
    SUPPORTED_SCHEMA_VERSION,
    configured_scope,
    digest_object,
    envelope_scope,
)
from gateway.overlay.envelope import provenance as provenance_of
from gateway.overlay.reasons import (  # noqa: F401 - re-exported: the contract's one catalogue
    DIGEST_MISMATCH,
    EMPTY,
    INVALID_FIELD,
    MALFORMED_STRUCTURE,
    MAX_TEXT_BYTES,
    MISSING_SCHEMA_VERSION,
    REVISION_DIGEST_MISMATCH,
    SCOPE_MISMATCH,
    TOO_LARGE,
    UNREADABLE,
    UNSUPPORTED_SCHEMA_VERSION,
    OverlayRejected,
    field_error,
    is_text,
    parse_json,
)

MAX_OVERLAY_BYTES = 2 * 1024 * 1024
MAX_CANDIDATES = 1024

KINDS = ("inference_model", "mcp_tool")
NEW_AND_EXISTING = "new_and_existing"
EXISTING_ONLY = "existing_only"
ADMISSION_NONE = "none"
ADMISSIONS = (NEW_AND_EXISTING, EXISTING_ONLY, ADMISSION_NONE)
# Grid's topology notes call the third admission state "excluded": read as none. The digest is over
# the document as published, so the word stays whatever the producer wrote.
ADMISSION_ALIASES = {"excluded": ADMISSION_NONE}
MODES = ("deterministic", "roundRobin", "random")
CREDENTIAL_STRATEGIES = ("apikey", "bearer_token")

_HTTP_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,256}")
_MAX_INDEX_INT = 2**31 - 1


class Credential(msgspec.Struct, frozen=True):
    """A reference to a provider secret; the gateway never sees the secret itself here."""

    strategy: str
    secret_name: str
    secret_namespace: str
    secret_key: str
    header: str | None = None


class Candidate(msgspec.Struct, frozen=True):
    """One validated candidate slot, in file order (``position`` is its index in the array)."""

    position: int
    kind: str
    name: str
    site: str
    cluster: str
    stable_id: str
    stable_id_hash: int
    admission: str
    selection_group: int | None
    selection_tier: int | None
    rank: int | None
    fresh: bool
    credential: Credential | None
    # Additive (overlay-v1 accepts unknown fields): why a producer excluded it (admission none), e.g.
    # gridgate control's ``nonconformant``; route evidence counts it under this reason.
    excluded_reason: str | None = None


class ValidatedOverlay(msgspec.Struct, frozen=True):
    """Output of :func:`validate_overlay`: everything the snapshot builder needs."""

    revision: str
    is_envelope: bool
    mode: str
    local_site: str
    network: str | None
    generated_at: str | None
    candidates: tuple[Candidate, ...]
    scope: dict[str, str] | None = None
    provenance: dict[str, Any] | None = None


def stable_id_hash(stable_id: str) -> int:
    """64-bit hash identifying a candidate in the shared affinity table."""
    return xxhash.xxh3_64_intdigest(stable_id.encode("utf-8", "surrogatepass"))


# --------------------------------------------------------------------------- field checks


def _text(value: Any, path: str) -> str:
    if not is_text(value):
        raise field_error(path, f"must be 1..{MAX_TEXT_BYTES} bytes, not blank")
    return value


def _is_visible_ascii(value: str, max_len: int = MAX_TEXT_BYTES) -> bool:
    return 0 < len(value) <= max_len and value.isascii() and all(33 <= ord(c) <= 126 for c in value)


def _index_int(value: Any, path: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INDEX_INT:
        raise field_error(path, "must be an integer >= 0")
    return value


def _credential(value: Any, path: str) -> Credential:
    if not isinstance(value, dict):
        raise field_error(path, "must be an object {strategy, secretRef}")
    for key in value:
        if key not in ("strategy", "secretRef", "header"):
            raise field_error(f"{path}.{key}", "unknown field")
    strategy = value.get("strategy")
    if strategy not in CREDENTIAL_STRATEGIES:
        raise field_error(f"{path}.strategy", f"must be one of {', '.join(CREDENTIAL_STRATEGIES)}")
    ref = value.get("secretRef")
    if not isinstance(ref, dict):
        raise field_error(f"{path}.secretRef", "must be an object {name, namespace, key}")
    for key in ref:
        if key not in ("name", "namespace", "key"):
            raise field_error(f"{path}.secretRef.{key}", "unknown field")
    name = _text(ref.get("name"), f"{path}.secretRef.name")
    namespace = _text(ref.get("namespace"), f"{path}.secretRef.namespace")
    secret_key = _text(ref.get("key"), f"{path}.secretRef.key")
    header = value.get("header")
    if header is not None:
        # A bearer token always travels in Authorization; a custom header only makes sense for apikey.
        if strategy != "apikey":
            raise field_error(f"{path}.header", "only allowed with strategy apikey")
        if type(header) is not str or not _HTTP_TOKEN.fullmatch(header):
            raise field_error(f"{path}.header", "must be an HTTP header name (1..256 token characters)")
    return Credential(strategy, name, namespace, secret_key, header)


def _candidate(raw: Any, position: int) -> Candidate:
    path = f"candidates[{position}]"
    if not isinstance(raw, dict):
        raise field_error(path, "must be an object")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise field_error(f"{path}.kind", f"must be one of {', '.join(KINDS)}")
    name = _text(raw.get("name"), f"{path}.name")
    site = _text(raw.get("site"), f"{path}.site")
    cluster = _text(raw.get("cluster"), f"{path}.cluster")

    fresh = raw.get("fresh")
    if fresh is None:
        fresh = True
    elif type(fresh) is not bool:
        raise field_error(f"{path}.fresh", "must be a boolean")

    admission = raw.get("admission_state")
    if admission is None:
        admission = NEW_AND_EXISTING
    elif type(admission) is str and admission in ADMISSION_ALIASES:
        admission = ADMISSION_ALIASES[admission]
    elif admission not in ADMISSIONS:
        raise field_error(f"{path}.admission_state",
                          f"must be one of {', '.join((*ADMISSIONS, *ADMISSION_ALIASES))}")

    stable_id = raw.get("stable_id")
    if stable_id is None:
        stable_id = f"{kind}/{name}/{site}/{cluster}"
    elif type(stable_id) is not str or not _is_visible_ascii(stable_id):
        raise field_error(f"{path}.stable_id", f"must be 1..{MAX_TEXT_BYTES} visible ASCII characters")

    group = raw.get("selection_group")
    if group is not None:
        group = _index_int(group, f"{path}.selection_group")
    tier = raw.get("selection_tier")
    if tier is not None:
        tier = _index_int(tier, f"{path}.selection_tier")
    rank = raw.get("rank")
    if rank is not None:
        rank = _index_int(rank, f"{path}.rank")
    credential = raw.get("credential")
    if credential is not None:
        credential = _credential(credential, f"{path}.credential")
    excluded_reason = raw.get("excluded_reason")
    if excluded_reason is not None and not (type(excluded_reason) is str and excluded_reason.isidentifier()
                                            and len(excluded_reason) <= 64):
        raise field_error(f"{path}.excluded_reason", "must be a reason word (letters, digits, _; up to 64)")

    return Candidate(
        position=position,
        kind=kind,
        name=name,
        site=site,
        cluster=cluster,
        stable_id=stable_id,
        stable_id_hash=stable_id_hash(stable_id),
        admission=admission,
        selection_group=group,
        selection_tier=tier,
        rank=rank,
        fresh=fresh,
        credential=credential,
        excluded_reason=excluded_reason if admission == ADMISSION_NONE else None,
    )


def _check_duplicates(candidates: tuple[Candidate, ...]) -> None:
    """A candidate listed twice is a weight (two slots), never a second definition.

    Repeats of one (kind, name, site, cluster) must agree on stable_id, selection_group
    and admission_state; one stable_id must not name two different candidates, or
    affinity bindings would be ambiguous.
    """
    by_identity: dict[tuple[str, str, str, str], Candidate] = {}
    by_stable_id: dict[str, Candidate] = {}
    by_hash: dict[int, str] = {}
    for cand in candidates:
        identity = (cand.kind, cand.name, cand.site, cand.cluster)
        first = by_identity.setdefault(identity, cand)
        if first is not cand and (
            first.stable_id != cand.stable_id
            or first.selection_group != cand.selection_group
            or first.admission != cand.admission
        ):
            raise field_error(
                f"candidates[{cand.position}]",
                f"duplicate candidate {'/'.join(identity)} (first at candidates[{first.position}]) "
                "must repeat the same stable_id, selection_group and admission_state",
            )
        owner = by_stable_id.setdefault(cand.stable_id, cand)
        if (owner.kind, owner.name, owner.site, owner.cluster) != identity:
            raise field_error(
                f"candidates[{cand.position}].stable_id",
                f"{cand.stable_id!r} already names candidates[{owner.position}]",
            )
        if by_hash.setdefault(cand.stable_id_hash, cand.stable_id) != cand.stable_id:
            raise field_error(f"candidates[{cand.position}].stable_id", "64-bit hash collides; rename it")


def _selection_mode(document: dict[str, Any]) -> str:
    if "selection_policy" not in document or document["selection_policy"] is None:
        return "deterministic"
    policy = document["selection_policy"]
    if not isinstance(policy, dict):
        raise field_error("selection_policy", "must be an object {mode}")
    for key in policy:
        if key not in ("mode", "picker"):
            raise field_error(f"selection_policy.{key}", "unknown key (only mode, or its alias picker)")
    if "mode" in policy and "picker" in policy:
        raise field_error("selection_policy", "give mode or its alias picker, not both")
    key = "picker" if "picker" in policy else "mode"
    mode = policy.get(key)
    if mode not in MODES:
        raise field_error(f"selection_policy.{key}", f"must be one of {', '.join(MODES)}")
    return mode


def _validate_document(
    document: Any, prefix: str
) -> tuple[str, str | None, str | None, tuple[Candidate, ...]]:
    """Check the overlay document; returns (mode, network, generated_at, candidates)."""
    if not isinstance(document, dict):
        raise OverlayRejected(MALFORMED_STRUCTURE, f"{prefix or 'overlay'}: must be an object")

    def at(field: str) -> str:
        return f"{prefix}{field}"

    if "local_site" not in document:
        raise field_error(at("local_site"), "required")
    _text(document["local_site"], at("local_site"))
    network = document.get("network")
    if network is not None:
        _text(network, at("network"))
    generated_at = document.get("generated_at")
    if generated_at is not None and type(generated_at) is not str:
        raise field_error(at("generated_at"), "must be a string")
    mode = _selection_mode(document)
    raw_candidates = document.get("candidates")
    if not isinstance(raw_candidates, list) or not 1 <= len(raw_candidates) <= MAX_CANDIDATES:
        raise field_error(at("candidates"), f"must be an array of 1..{MAX_CANDIDATES} candidates")
    try:
        candidates = tuple(_candidate(raw, i) for i, raw in enumerate(raw_candidates))
        _check_duplicates(candidates)
    except OverlayRejected as exc:
        if prefix:
            exc.detail = prefix + exc.detail
        raise
    return mode, network, generated_at, candidates


def _revision_of(document: dict[str, Any], prefix: str) -> str:
    try:
        return semantic_revision(document)
    except ValueError as exc:  # rfc8785.CanonicalizationError is a ValueError
        raise field_error(f"{prefix}candidates", f"cannot be canonicalized (RFC 8785): {exc}") from None


def validate_overlay(root: Any, expected_scope: Any = None) -> ValidatedOverlay:
    """Validate a parsed overlay (legacy document or envelope v1); see the module docstring."""
    if not isinstance(root, dict):
        raise OverlayRejected(MALFORMED_STRUCTURE, "overlay file must hold a JSON object")
    expected = configured_scope(expected_scope)
    if not any(marker in root for marker in ENVELOPE_MARKERS):
        if expected:
            raise OverlayRejected(
                SCOPE_MISMATCH,
                "legacy overlay (no envelope) is not accepted while expected_overlay_scope is set",
            )
        mode, network, generated_at, candidates = _validate_document(root, "")
        return ValidatedOverlay(
            revision=_revision_of(root, ""),
            is_envelope=False,
            mode=mode,
            local_site=root["local_site"],
            network=network,
            generated_at=generated_at,
            candidates=candidates,
        )

    if "schema_version" not in root:
        raise OverlayRejected(MISSING_SCHEMA_VERSION, "envelope has no schema_version")
    if root["schema_version"] != SUPPORTED_SCHEMA_VERSION:
        raise OverlayRejected(
            UNSUPPORTED_SCHEMA_VERSION,
            f"schema_version {root['schema_version']!r} (supported: {SUPPORTED_SCHEMA_VERSION})",
        )
    revision_value = digest_object(root.get("revision"), "revision")
    if root["revision"].get("kind") != "content_addressed":
        raise OverlayRejected(MALFORMED_STRUCTURE, "revision.kind: must be content_addressed")
    digest_value = digest_object(root.get("content_digest"), "content_digest")
    scope = envelope_scope(root.get("scope"))
    provenance = provenance_of(root.get("provenance"))
    document = root.get("overlay")
    if not isinstance(document, dict):
        raise OverlayRejected(MALFORMED_STRUCTURE, "overlay: must be an object")

    mode, network, generated_at, candidates = _validate_document(document, "overlay.")
    revision = _revision_of(document, "overlay.")
    if digest_value != revision:
        raise OverlayRejected(DIGEST_MISMATCH, f"content_digest {digest_value} != recomputed {revision}")
    if revision_value != digest_value:
        raise OverlayRejected(
            REVISION_DIGEST_MISMATCH, f"revision {revision_value} != content_digest {digest_value}"
        )

    if network != scope["network"]:
        raise OverlayRejected(
            SCOPE_MISMATCH, f"overlay.network {network!r} != scope.network {scope['network']!r}"
        )
    if document["local_site"] != scope["local_site"]:
        raise OverlayRejected(
            SCOPE_MISMATCH,
            f"overlay.local_site {document['local_site']!r} != scope.local_site {scope['local_site']!r}",
        )
    if provenance["source_name"] != scope["network"]:
        raise OverlayRejected(
            SCOPE_MISMATCH,
            f"provenance.source_name {provenance['source_name']!r} != scope.network {scope['network']!r}",
        )
    for field, want in expected.items():
        if scope[field] != want:
            raise OverlayRejected(SCOPE_MISMATCH, f"scope.{field} {scope[field]!r} != expected {want!r}")

    return ValidatedOverlay(
        revision=revision,
        is_envelope=True,
        mode=mode,
        local_site=document["local_site"],
        network=network,
        generated_at=generated_at,
        candidates=candidates,
        scope=scope,
        provenance=provenance,
    )
