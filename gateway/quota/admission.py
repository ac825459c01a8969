"""What an admission decided, as the worker answers it: the verdict, its headers and error text. Pure."""

from __future__ import annotations

import msgspec

from gateway.identity.limits import LimitRef, window_text
from gateway.quota.lease import Lease
from gateway.quota.ledger import Reservation
from gateway.quota.rate_headers import (  # noqa: F401 - re-exported
    H_LIMIT,
    H_LIMIT_REQUESTS,
    H_REMAINING,
    H_REMAINING_REQUESTS,
    H_RESET,
    H_RESET_REQUESTS,
    H_RETRY_AFTER,
    REQUEST_HEADERS,
    TOKEN_HEADERS,
    duration_text,
)
from gateway.quota.rules import QuotaRule

__all__ = ["ALLOWED_UNMETERED", "REJECTED", "Admission", "duration_text", "refusal_message", "window_text"]

# What the rate-limit headers are and how a reset reads (rate_headers.py), re-exported for the gate's users.


class Admission(msgspec.Struct, gc=False):
    """The verdict the worker acts on.

    ``allowed`` False -> answer ``status`` (429, 503, or 401 for a managed key in its tenant's deny set)
    with ``headers``, send nothing upstream.
    ``allowed`` True -> forward; add ``headers`` to the response. The request's record keeps it, and
    closing the record settles it once with what the request cost (``workers/outcomes.py`` calls
    ``QuotaGate.settle``; settling an admission that reserved nothing is a no-op).
    ``shadow``: the limits marked ``shadow`` that would have refused it (for the access log), or None.

    A ``msgspec.Struct``: one is built per metered request, and its constructor runs in C (half the
    cost of an ``__init__``). Not tracked by the GC: it holds no reference back to itself.
    """

    allowed: bool
    reason: str  # admitted|denied|denied_never_fits|denied_requests|denied_concurrency|key_blocked|key_revoked|backend_error_*
    status: int | None
    headers: tuple[tuple[bytes, bytes], ...]
    reservation: Reservation | None = None
    estimate: int = 0
    tenant_slot: int = -1  # TenantTokens slot (admitted only)
    message: str | None = None  # what refused, in words (denied only)
    lease: Lease | None = None  # the worker-held block it was admitted from (then ``reservation`` is None)
    # Admitted against a budget (a reservation or a block's share): the response's usage settles it.
    # A field, not derived from the two above: settling clears them, and it is read on every request.
    metered: bool = False
    shadow: tuple[str, ...] | None = None
    error_type: str | None = "tokens"  # the error body's type: tokens, requests (None: the status's)
    code: str = "rate_limit_exceeded"  # the error body's code (key_blocked, key_revoked: the deny set)
    worst_nusd: int = 0  # the worst-case cost reserved in USD budgets (what an unmeasured attempt costs)

    @property
    def error(self) -> tuple[str, str, str] | None:
        """(message, type, code) for the worker's OpenAI-style error body when not allowed."""
        if self.message is not None:
            return self.message, self.error_type, self.code
        return _ERRORS.get(self.reason)

    def __repr__(self) -> str:
        return f"Admission({self.reason}, status={self.status}, estimate={self.estimate})"


_ERRORS = {
    "backend_error_rejected": (
        "The quota service is unavailable; retry shortly.",
        "server_error",
        "quota_unavailable",
    ),
}


ALLOWED_UNMETERED = Admission(True, "backend_error_allowed", None, ())
# While the breaker is open the probe runs every ~100 ms: one second is an honest retry hint.
REJECTED = Admission(False, "backend_error_rejected", 503, ((H_RETRY_AFTER, b"1"),))


def refusal_message(ref: LimitRef, retry_s: int | None) -> str:
    """The 429 text: which limit refused (``rule team-a tokens 30000/1m``) and when to retry."""
    if ref.kind == "in_flight":
        return f"Too many concurrent requests: {ref.text}; retry after {retry_s} s."
    return f"Rate limit exceeded: {ref.text}; retry after {retry_s} s."


def never_fits_message(rule: QuotaRule | LimitRef, estimate: int, limit: int) -> str:
    """The 429 text for a request larger than a whole window of a budget: names the limit and the
    request, and says that retrying cannot help (the answer carries no Retry-After)."""
    if isinstance(rule, LimitRef):
        owner = f"{rule.scope.label()} tokens {rule.limit.text}" if rule.limit is not None else rule.text
        window = getattr(rule.limit, "window_s", None)
        per = f" per {window_text(window)}" if window is not None else ""
        return (
            f"Request too large for the token budget {owner}: its estimate is {estimate} tokens "
            f"(prompt + max_tokens), the budget is {limit} tokens{per}. It can never be admitted, so "
            f"retrying will not help: lower max_tokens or shorten the prompt."
        )
    window = next((b.window_s for b in rule.budgets if b.tokens == limit), None)
    per = f" per {window_text(window)}" if window is not None else ""
    return (
        f"Request too large for token quota rule {rule.name!r}: its estimate is {estimate} tokens "
        f"(prompt + max_tokens), the budget is {limit} tokens{per}. It can never be admitted, so "
        f"retrying will not help: lower max_tokens or shorten the prompt."
    )
