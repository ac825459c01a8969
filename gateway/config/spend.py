"""USD budgets as the config and the key records write them: ``quota.rules[].spend``, ``auth.keys[].limits.spend``
and a managed key's ``limits.spend`` (docs/limits.md, "USD budgets"; docs/pricing.md).

One schema for all three, in a module of its own so the quota config (gateway/config/quota.py) and the
key records (gateway/keys/record.py) both import it without importing each other. Pure.
"""

from __future__ import annotations

from decimal import ROUND_FLOOR, Decimal
from typing import Literal
from zoneinfo import ZoneInfoNotFoundError

import msgspec

from gateway.pricing.period import zone
from gateway.pricing.units import NANO_PER_USD
from gateway.yaml_config import StrictStruct

MAX_USD = 1_000_000_000
MAX_THRESHOLDS = 8


class SpendLimit(StrictStruct):
    """A USD budget per calendar period of ``tz``: ``hard`` refuses a request whose worst-case cost
    no longer fits, ``soft`` only alerts; each ``alert_at`` fraction is reported once per period."""

    usd: float
    period: Literal["1d", "1w", "1mo"]
    tz: str | None = None  # IANA zone of the period's start; None: UTC
    enforce: Literal["hard", "soft"] = "hard"
    alert_at: list[float] = msgspec.field(default_factory=lambda: [0.5, 0.8, 1.0])

    def __post_init__(self) -> None:
        if not 0 < self.usd <= MAX_USD:
            raise ValueError(f"usd: must be > 0 and <= {MAX_USD}")
        if self.tz is not None:
            try:
                zone(self.tz)
            except (ZoneInfoNotFoundError, ValueError, TypeError):
                raise ValueError("tz: not a known time zone (an IANA name such as Europe/Paris)") from None
        if len(self.alert_at) > MAX_THRESHOLDS:
            raise ValueError(f"alert_at: at most {MAX_THRESHOLDS} thresholds")
        for index, threshold in enumerate(self.alert_at):
            if not 0 < threshold <= 1:
                raise ValueError(f"alert_at[{index}]: must be > 0 and <= 1")
        if len({round(t * 1000) for t in self.alert_at}) != len(self.alert_at):
            raise ValueError("alert_at: two thresholds within 0.001 of each other")

    @property
    def nusd(self) -> int:
        """The budget in nano-USD, read as the decimal written (``5.1`` is 5.1 USD, not the float)."""
        return int((Decimal(repr(self.usd)) * NANO_PER_USD).to_integral_value(rounding=ROUND_FLOOR))

