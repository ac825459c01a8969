"""The 401/403 codes of a managed key the gateway knows but refuses, and their messages: one wording for
the head gate (the host's key table, ``gateway.keys.answers``) and the admit (the tenant's deny set in
Valkey, ``gateway.quota.verdict``), whichever sees the key's status first. Pure."""

from __future__ import annotations

KEY_BLOCKED = "key_blocked"
KEY_REVOKED = "key_revoked"
KEY_EXPIRED = "key_expired"
MODEL_NOT_ALLOWED = "model_not_allowed"


def status_refusal(kid: str, status: str) -> tuple[str, str] | None:
    """``(code, message)`` for a key whose status is ``revoked`` or ``blocked``; None for any other status."""
    if status == "revoked":
        return KEY_REVOKED, f"API key {kid} was revoked"
    if status == "blocked":
        return KEY_BLOCKED, f"API key {kid} is blocked"
    return None
