"""What an admission decided, as the worker answers it: the verdict, its headers and error text. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gateway.quota.ledger import Reservation
from gateway.quota.rules import QuotaRule

if TYPE_CHECKING:
    from gateway.quota.lease import Lease

H_RETRY_AFTER = b"retry-after"
H_LIMIT = b"x-ratelimit-limit-tokens"
H_REMAINING = b"x-ratelimit-remaining-tokens"
H_RESET = b"x-ratelimit-reset-tokens"


class Admission(msgspec.Struct, gc=False):
    """The verdict the worker acts on.

    ``allowed`` False -> answer ``status`` (429 or 503) with ``headers``, send nothing upstream.
    ``allowed`` True -> forward; add ``headers`` to the response. The request's record keeps it, and
    closing the record settles it once with what the request cost (``workers/outcomes.py`` calls
    ``QuotaGate.settle``; settling an admission that reserved nothing is a no-op).

    A ``msgspec.Struct``: one is built per metered request, and its constructor runs in C (half the
    cost of an ``__init__``). Not tracked by the GC: it holds no reference back to itself.
    """

    allowed: bool
    reason: str  # admitted|denied|denied_never_fits|denied_concurrency|backend_error_*
    status: int | None
    headers: tuple[tuple[bytes, bytes], ...]
    reservation: Reservation | None = None
    estimate: int = 0
    tenant_slot: int = -1  # TenantTokens slot (admitted only)
    message: str | None = None  # the never-fits explanation
    lease: Lease | None = None  # the worker-held block it was admitted from (then ``reservation`` is None)
    # Admitted against a budget (a reservation or a block's share): the response's usage settles it.
    # A field, not derived from the two above: settling clears them, and it is read on every request.
    metered: bool = False

    @property
    def error(self) -> tuple[str, str, str] | None:
        """(message, type, code) for the worker's OpenAI-style error body when not allowed."""
        if self.message is not None:
            return self.message, "tokens", "rate_limit_exceeded"
        return _ERRORS.get(self.reason)

    def __repr__(self) -> str:
        return f"Admission({self.reason}, status={self.status}, estimate={self.estimate})"


_ERRORS = {
    "denied": (
        "Token quota exceeded for this API key; retry after the Retry-After delay.",
        "tokens",
        "rate_limit_exceeded",
    ),
    "denied_concurrency": (
        "Too many concurrent requests for this API key.",
        "requests",
        "rate_limit_exceeded",
    ),
    "backend_error_rejected": (
        "The token quota service is unavailable; retry shortly.",
        "server_error",
        "quota_unavailable",
    ),
}


ALLOWED_UNMETERED = Admission(True, "backend_error_allowed", None, ())
# While the breaker is open the probe runs every ~100 ms: one second is an honest retry hint.
REJECTED = Admission(False, "backend_error_rejected", 503, ((H_RETRY_AFTER, b"1"),))


def never_fits_message(rule: QuotaRule, estimate: int, limit: int) -> str:
    """The 429 text for a request larger than a whole window of a budget: names the limit and the
    request, and says that retrying cannot help (the answer carries no Retry-After)."""
    window = next((b.window_s for b in rule.budgets if b.tokens == limit), None)
    per = f" per {window_text(window)}" if window is not None else ""
    return (
        f"Request too large for token quota rule {rule.name!r}: its estimate is {estimate} tokens "
        f"(prompt + max_tokens), the budget is {limit} tokens{per}. It can never be admitted, so "
        f"retrying will not help: lower max_tokens or shorten the prompt."
    )


def window_text(seconds: int) -> str:
    """``60`` -> ``1m``, ``86400`` -> ``1d``, ``90`` -> ``90s`` (the config's own duration form)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def duration_text(ms: int) -> bytes:
    """``x-ratelimit-reset-tokens`` in the duration form OpenAI uses (``250ms``, ``17.5s``, ``6m0s``,
    ``1h2m3s``), so clients that already parse OpenAI's headers parse ours."""
    ms = max(0, ms)
    if ms < 1000:
        return b"%dms" % ms
    minutes, ms = divmod(ms, 60000)
    hours, minutes = divmod(minutes, 60)
    seconds = (b"%d.%03d" % divmod(ms, 1000)).rstrip(b"0").rstrip(b".") + b"s"
    if hours:
        return b"%dh%dm" % (hours, minutes) + seconds
    if minutes:
        return b"%dm" % minutes + seconds
    return seconds
