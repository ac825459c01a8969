"""What the data plane answers about a managed key (docs/keys.md), as pure functions of a ``KeyEntry``.

The head gate (workers) calls ``refusal`` right after a successful lookup; ``GET /v1/gridgate/key``
answers ``key_report`` (a key's model check: workers/model_access.py). None of them does I/O, reads a
clock or ever shows the key or its digest.
"""

from __future__ import annotations

from typing import Any

from gateway.identity.key_status import KEY_EXPIRED, status_refusal
from gateway.keys.record import format_time
from gateway.keys.view import KeyEntry


def refusal(entry: KeyEntry, now: float) -> tuple[str, str] | None:
    """``(code, message)`` of the 401 for a key that may not be used at ``now`` (Unix seconds), or None.

    Revoked wins over blocked (final), blocked over expired (an admin's act says more than a date).
    """
    if (status := status_refusal(entry.kid, entry.status)) is not None:
        return status
    if entry.expires_at is not None and now >= entry.expires_at:
        return KEY_EXPIRED, f"API key {entry.kid} expired at {format_time(entry.expires_at)}"
    return None


def key_report(entry: KeyEntry, *, remaining: dict[str, Any] | None = None,
               spend: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body of ``GET /v1/gridgate/key``: the caller's own record, its limits, and what the quota
    reports (``remaining``: budgets left per limit; ``spend``: this period's spend), never a secret."""
    return {
        "object": "gridgate.key",
        "kid": entry.kid,
        "tenant": entry.tenant,
        "alias": entry.alias,
        "status": entry.status,
        "models": entry.models,
        "expires_at": format_time(entry.expires_at),
        "allowed_origins": entry.allowed_origins,
        "limits": entry.limits.body(),
        "remaining": remaining,
        "spend": spend,
    }
