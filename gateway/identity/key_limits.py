"""A key's limits as they are written (docs/limits.md, "Keys"; docs/keys.md): one value type for all of
``auth.keys[].limits`` in the YAML config, a managed key's ``limits`` in the admin API's bodies and its
record in the key store, and the host key table's entries. Its entries (``RequestRate``, ``TokenBudget``,
``SpendLimit``) are a quota rule's ``requests``, ``budgets`` and ``spend`` too. Pure.

Windows are durations in the config's own form (``1m``, ``24h``), kept normalised (``60s`` becomes
``1m``): a record's JSON in Valkey and a table entry's msgpack hold the same bytes as before there was
one type. Every check raises ``ValueError`` naming its field, which the YAML loader and the admin API
prefix with the path (``auth.keys[0].limits.requests[0].count: must be >= 1``,
``limits.requests[0].count: must be >= 1``).

``counted_limits`` and ``KeyLimits.counted`` turn written limits into the ``Limits`` the quota counts
(gateway/identity/limits.py); ``KeyLimits.body`` is the JSON form the admin API and ``GET
/v1/gridgate/key`` answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import ROUND_FLOOR, Decimal
from typing import Any, ClassVar, Literal
from zoneinfo import ZoneInfoNotFoundError

import msgspec

from gateway.identity.limits import NO_LIMITS, Budget, Limits, RequestLimit, SpendBudget, block_problems
from gateway.pricing.period import PeriodClock, zone
from gateway.pricing.units import NANO_PER_USD
from gateway.yaml_config import DAY, Range, StrictStruct, check_ranges, format_duration, parse_duration

MAX_COUNT = 1_000_000_000  # counts of requests and tokens per request
MAX_TOKENS = 10**15  # tokens of a budget or a lease block
# A request limit's slots are timed in microseconds on Valkey's clock: finer than a million requests
# a second per limit cannot be metered.
MAX_REQUESTS_PER_SECOND = 1_000_000
MAX_IN_FLIGHT = 1_000_000
MAX_USD = 1_000_000_000
MAX_THRESHOLDS = 8


def _window(text: str, low: float, high: float) -> str:
    """``text`` normalised (``60s`` -> ``1m``); ``ValueError`` naming ``window`` unless within low..high."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise ValueError(f"window: {exc}") from None
    if seconds < low:
        raise ValueError(f"window: must be >= {format_duration(low)}")
    if seconds > high:
        raise ValueError(f"window: must be <= {format_duration(high)}")
    return format_duration(seconds)


class RequestRate(StrictStruct):
    """``requests[]``: at most ``count`` requests per ``window`` (whole seconds, 1s..1d), at most
    ``burst`` at once (GCRA)."""

    window: str
    count: int
    burst: int | None = None  # None: ``count``
    shadow: bool = False  # counts and reports, never refuses

    _RANGES: ClassVar[dict[str, Range]] = {"count": (1, MAX_COUNT), "burst": (1, MAX_COUNT)}

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "window", _window(self.window, 1, DAY))
        seconds = parse_duration(self.window)
        if seconds != int(seconds):
            raise ValueError("window: must be whole seconds (1s..1d)")
        check_ranges(self, self._RANGES)
        if self.count > seconds * MAX_REQUESTS_PER_SECOND:
            raise ValueError(f"count: more than {MAX_REQUESTS_PER_SECOND} requests per second cannot be metered")

    @property
    def window_s(self) -> int:
        return int(parse_duration(self.window))


class TokenBudget(StrictStruct):
    """``budgets[]``: ``tokens`` per fixed ``window`` (1s..366d, aligned to the Unix epoch)."""

    window: str
    tokens: int
    shadow: bool = False  # counts and reports, never refuses

    _RANGES: ClassVar[dict[str, Range]] = {"tokens": (1, MAX_TOKENS)}

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "window", _window(self.window, 1, 366 * DAY))
        check_ranges(self, self._RANGES)

    @property
    def window_s(self) -> int:
        return int(parse_duration(self.window))


class SpendLimit(StrictStruct):
    """``spend[]``: a USD budget per calendar period of ``tz`` (docs/limits.md, "USD budgets"): ``hard``
    refuses a request whose worst-case cost no longer fits, ``soft`` only alerts; each ``alert_at``
    fraction is reported once per period."""

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


class KeyLimits(StrictStruct):
    """One key's own limits, on top of its quota rule's (docs/limits.md, "Keys"): the YAML key's
    ``limits``, the managed key's ``limits``."""

    requests: list[RequestRate] = []
    budgets: list[TokenBudget] = []
    max_in_flight: int | None = None  # None: no cap
    spend: list[SpendLimit] = []  # USD budgets (docs/limits.md, "USD budgets")

    _RANGES: ClassVar[dict[str, Range]] = {"max_in_flight": (1, MAX_IN_FLIGHT)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        problems = block_problems([r.window_s for r in self.requests], [b.window_s for b in self.budgets],
                                  [s.period for s in self.spend])
        if problems:
            raise ValueError(problems[0])

    def counted(self) -> Limits:
        """These limits as the quota counts them (``NO_LIMITS`` when there are none, as for most keys)."""
        if not (self.requests or self.budgets or self.max_in_flight or self.spend):
            return NO_LIMITS
        return counted_limits(self.requests, self.budgets, self.max_in_flight, self.spend)

    def body(self) -> dict[str, Any]:
        """The JSON form: ``{"requests": [{"window": "1m", "count": 60, "burst": null, "shadow": false}],
        "budgets": [], "max_in_flight": null, "spend": []}``."""
        return msgspec.to_builtins(self)


def counted_limits(requests: Sequence[RequestRate], budgets: Sequence[TokenBudget], max_in_flight: int | None,
                   spend: Sequence[SpendLimit] = ()) -> Limits:
    """Written limits (a rule's ``requests``/``budgets``/``max_in_flight``/``spend``, or a key's) as the
    quota counts them."""
    return Limits(
        requests=tuple(RequestLimit(r.window_s, r.count, r.count if r.burst is None else r.burst, r.shadow)
                       for r in requests),
        budgets=tuple(Budget(b.window_s, b.tokens, b.shadow) for b in budgets),
        max_in_flight=max_in_flight or 0,
        spend=tuple(SpendBudget(s.nusd, s.period, s.tz or "UTC", s.enforce == "hard",
                                tuple(sorted({round(t * 1000) for t in s.alert_at})), PeriodClock(s.period, s.tz))
                    for s in spend),
    )
