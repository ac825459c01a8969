"""Calendar periods of USD budgets: which period an instant falls in, its id, its start and its end. Pure.

A spend limit counts per calendar period of its time zone (docs/limits.md, "USD budgets"): ``1d`` from
local midnight, ``1w`` the ISO week from Monday midnight, ``1mo`` from the first of the month. The
period's id names its counter in the ledger (``20261201``, ``2026W49``, ``202612``), so a new period
starts a new counter without anyone resetting one.

``PeriodClock`` remembers the current period of one (period, zone) and recomputes it only when an
instant falls outside it: the zone arithmetic runs once per period, never per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo
from functools import cache
from typing import Literal
from zoneinfo import ZoneInfo

Period = Literal["1d", "1w", "1mo"]
PERIODS: tuple[Period, ...] = ("1d", "1w", "1mo")


@dataclass(frozen=True, slots=True)
class PeriodSpan:
    """One calendar period: its id and its bounds in Unix seconds (``start`` <= t < ``end``)."""

    id: str
    start: int
    end: int

    def contains(self, now: float) -> bool:
        return self.start <= now < self.end


@cache
def zone(name: str | None) -> tzinfo:
    """The zone of a spend limit (None or ``UTC``: UTC). Raises ZoneInfoNotFoundError/ValueError."""
    return UTC if name in (None, "UTC") else ZoneInfo(name)  # type: ignore[arg-type]


def _midnight(day: date, where: tzinfo) -> int:
    """Unix seconds of ``day``'s start in ``where`` (a midnight a DST change skips is read as the
    zone's rule reads it: the first instant of the day)."""
    return int(datetime(day.year, day.month, day.day, tzinfo=where).timestamp())


def period_span(period: Period, tz: str | None, now: float) -> PeriodSpan:
    """The period of kind ``period`` in zone ``tz`` that contains ``now`` (Unix seconds)."""
    where = zone(tz)
    today = datetime.fromtimestamp(now, where).date()
    if period == "1d":
        first, after = today, today + timedelta(days=1)
        ident = first.strftime("%Y%m%d")
    elif period == "1w":
        first = today - timedelta(days=today.weekday())
        after = first + timedelta(days=7)
        year, week, _ = first.isocalendar()
        ident = f"{year}W{week:02d}"
    elif period == "1mo":
        first = today.replace(day=1)
        after = (first + timedelta(days=32)).replace(day=1)
        ident = first.strftime("%Y%m")
    else:
        raise ValueError(f"unknown period {period!r} (1d, 1w or 1mo)")
    return PeriodSpan(ident, _midnight(first, where), _midnight(after, where))


class PeriodClock:
    """The current period of one (period, zone), recomputed only when ``now`` leaves it."""

    __slots__ = ("period", "tz", "_span")

    def __init__(self, period: Period, tz: str | None) -> None:
        self.period = period
        self.tz = tz
        self._span: PeriodSpan | None = None

    def at(self, now: float) -> PeriodSpan:
        span = self._span
        if span is None or not span.contains(now):
            span = self._span = period_span(self.period, self.tz, now)
        return span


def rfc3339(seconds: int) -> str:
    """Unix seconds as ``2026-12-02T00:00:00Z`` (UTC)."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
