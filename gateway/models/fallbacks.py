"""Sans-IO decisions of a fallback chain (docs/models.md, "Reasons"): why a model could not serve a
request, in the vocabulary of ``models.fallbacks.*.on``, and whether that moves the request on.

The provider failover (gateway/routing/failover.py) walks the providers of one model; when it ends
without an answer, ``failure_reason`` names what every provider failed for (None when they did not all
fail for one listed reason: the request does not move). Refusals before any provider was tried (the
eligibility filter's context window, no admissible candidate) move at once (``refusal_reason``).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from gateway.config.models import IMMEDIATE_REASONS
from gateway.http.errors import ErrorReply

# A provider failure's error code (workers/forwarding.py, gateway/request/attempts.py) -> its reason.
_CODE_REASONS = {
    "upstream_rate_limited": "rate_limited",
    "upstream_unavailable": "unavailable",
    "upstream_bad_gateway": "unavailable",
    "bad_upstream_response": "unavailable",
    "upstream_busy": "unavailable",
    "upstream_timeout": "timeout",
    # A provider's 400 whose error code says so (held by the relay: workers/relay.py).
    "context_length_exceeded": "context_length_exceeded",
    "content_filter": "content_filter",
}
MAX_REFUSAL_BYTES = 65536  # of a 400's body read for its error code
# The detail of a timeout that came from the per-attempt head deadline (workers/upstream.py).
_HEAD_DEADLINE = "no response before the deadline"
# Refusals of a model made before any provider was tried, and the reason each one is.
_REFUSAL_REASONS = {
    "context_length_exceeded": "context_length_exceeded",
    "content_filter": "content_filter",
    "no_admissible": "unavailable",
    "no_provider_available": "unavailable",
}


def provider_reason(reply: ErrorReply, first_byte_timeout: bool) -> str | None:
    """The reason of one provider's failure (None: not a reason to move on). A timeout waiting for the
    response head is ``first_byte_timeout`` when that per-attempt timeout is configured."""
    reason = _CODE_REASONS.get(reply.code)
    if reason == "timeout" and first_byte_timeout and _HEAD_DEADLINE in reply.message:
        return "first_byte_timeout"
    return reason


def failure_reason(reasons: Iterable[str | None], on: frozenset[str]) -> str | None:
    """The reason the request moves to the next model, when every provider of the current model failed
    for a listed reason (the last one's, which the client would otherwise see); else None."""
    last = None
    for reason in reasons:
        if reason is None or reason not in on:
            return None
        last = reason
    return last


def refusal_reason(reply: ErrorReply, on: frozenset[str]) -> str | None:
    """The reason a refusal of the current model (no provider tried) moves the request on at once."""
    reason = _REFUSAL_REASONS.get(reply.code)
    return reason if reason is not None and reason in on else None


def refusals_to_hold(on: frozenset[str]) -> frozenset[str] | None:
    """The provider error codes a chain moving ``on`` these reasons reads a 400 for (None: none)."""
    codes = on.intersection(IMMEDIATE_REASONS)
    return frozenset(codes) if codes else None


def refusal_code(body: bytes, codes: frozenset[str]) -> str | None:
    """The error code of a provider's 400 body when it is one of ``codes``: the OpenAI shape's
    ``error.code`` (``{"error": {"code": "context_length_exceeded", ...}}``), or its ``error.type``."""
    try:
        document = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return None
    for key in ("code", "type"):
        value = error.get(key)
        if isinstance(value, str) and value in codes:
            return value
    return None
