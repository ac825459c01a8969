"""Why an overlay is refused: the stable reason codes (``gridgate overlay validate`` prints them), the
exception that carries one, and the parse of overlay bytes into JSON (docs/overlay.md). Pure."""

from __future__ import annotations

import json
from typing import Any

MAX_TEXT_BYTES = 256

# Rejection reasons (stable strings: `gridgate overlay validate` prints them).
MALFORMED_STRUCTURE = "malformed_structure"
UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
MISSING_SCHEMA_VERSION = "missing_schema_version"
SCOPE_MISMATCH = "scope_mismatch"
DIGEST_MISMATCH = "digest_mismatch"
REVISION_DIGEST_MISMATCH = "revision_digest_mismatch"
INVALID_FIELD = "invalid_field"
# File-level reasons (raised by gateway.overlay.watch, listed here so there is one catalogue).
UNREADABLE = "unreadable"
EMPTY = "empty"
TOO_LARGE = "too_large"


class OverlayRejected(Exception):
    """The overlay is not acceptable. ``reason`` is a stable code, ``detail`` names the field."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


def field_error(path: str, message: str) -> OverlayRejected:
    return OverlayRejected(INVALID_FIELD, f"{path}: {message}")


def is_text(value: Any) -> bool:
    """1..256 UTF-8 bytes and not blank."""
    if type(value) is not str or not value.strip():
        return False
    try:
        return len(value.encode("utf-8")) <= MAX_TEXT_BYTES
    except UnicodeEncodeError:
        return False


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise OverlayRejected(MALFORMED_STRUCTURE, f"invalid JSON: duplicate key {key!r}")
            seen.add(key)
    return obj


def _reject_constant(name: str) -> Any:
    raise OverlayRejected(MALFORMED_STRUCTURE, f"invalid JSON: {name} is not a JSON number")


def parse_json(data: bytes) -> Any:
    """Parse overlay bytes; floats stay exact Python floats for the digest.

    Duplicate keys and NaN/Infinity are rejected: they have no canonical form.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OverlayRejected(MALFORMED_STRUCTURE, f"invalid JSON: not UTF-8 ({exc.reason})") from None
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise OverlayRejected(MALFORMED_STRUCTURE, f"invalid JSON: {exc}") from None
    except RecursionError:
        raise OverlayRejected(MALFORMED_STRUCTURE, "invalid JSON: nested too deeply") from None
