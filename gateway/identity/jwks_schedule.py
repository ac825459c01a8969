"""When the supervisor fetches an issuer's key set (docs/identity.md). Pure: the clock is handed in.

- After a good fetch: the answer's ``Cache-Control: max-age`` (``no-store``/``no-cache``: the minimum),
  clamped to ``[refresh.min, refresh.max]`` (``refresh.default`` without one), minus the ``early``
  share, so the next set is there before the IdP would call this one stale.
- After a failed fetch (down, an error status, garbage): ``refresh.retry`` later; the last good set
  keeps serving meanwhile.
- A token naming an unknown ``kid`` makes the next fetch due now, at most once per
  ``UNKNOWN_KID_REFETCH_S`` per issuer (counted from the previous such refetch), so a client sending
  made-up kids cannot make the gateway hammer the IdP.
"""

from __future__ import annotations

import re
from typing import Any

UNKNOWN_KID_REFETCH_S = 30.0
_MAX_AGE = re.compile(r"(?:^|[,\s])max-age\s*=\s*\"?(\d+)")


def max_age_of(cache_control: str | None) -> float | None:
    """The ``max-age`` of a Cache-Control value in seconds, 0 for ``no-store``/``no-cache``, else None."""
    if not cache_control:
        return None
    value = cache_control.lower()
    if "no-store" in value or "no-cache" in value:
        return 0.0
    match = _MAX_AGE.search(value)
    return None if match is None else float(match.group(1))


def lifetime(refresh: Any, cache_control: str | None) -> float:
    """How long a key set fetched with ``cache_control`` serves before it is refetched (``refresh``:
    the entry's ``JwksRefresh``), early share taken off."""
    age = max_age_of(cache_control)
    ttl = float(refresh.default) if age is None else age
    ttl = min(max(ttl, float(refresh.min)), float(refresh.max))
    return ttl * (1.0 - float(refresh.early))


class FetchSchedule:
    """One issuer's next fetch (monotonic seconds) and its unknown-kid budget."""

    __slots__ = ("refresh", "due", "last_on_demand")

    def __init__(self, refresh: Any, now: float) -> None:
        self.refresh = refresh
        self.due = now  # the first fetch at once
        self.last_on_demand = -UNKNOWN_KID_REFETCH_S

    def fetched(self, now: float, cache_control: str | None) -> None:
        self.due = now + lifetime(self.refresh, cache_control)

    def failed(self, now: float) -> None:
        self.due = now + float(self.refresh.retry)

    def unknown_kid(self, now: float) -> bool:
        """A worker saw an unknown kid: True when that makes a fetch due now (else it waits)."""
        if now - self.last_on_demand < UNKNOWN_KID_REFETCH_S:
            return False
        self.last_on_demand = now
        self.due = min(self.due, now)
        return True

    def is_due(self, now: float) -> bool:
        return now >= self.due
