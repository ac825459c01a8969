"""The ledger's report of one tenant (``QuotaLedger.report``, read for ``/admin/quota``): what its counters
hold per scope, as the script's reply lists them (pure).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.identity.limits import Scope, usd_text
from gateway.pricing.period import rfc3339


@dataclass(frozen=True, slots=True)
class WindowReport:
    window_s: int
    limit: int
    used: int
    reserved: int
    remaining: int
    reset_s: float
    shadow: bool = False


@dataclass(frozen=True, slots=True)
class RequestReport:
    window_s: int
    count: int
    burst: int
    remaining: int  # slots a burst could take now
    full_in_s: float  # until every slot is back
    shadow: bool = False


@dataclass(frozen=True, slots=True)
class SpendReport:
    usd: str  # $5.00
    period: str
    tz: str
    enforce: str  # hard | soft
    limit_nusd: int
    spent_nusd: int
    reserved_nusd: int
    remaining_nusd: int
    resets_at: str  # RFC 3339
    reset_s: float


@dataclass(frozen=True, slots=True)
class ScopeReport:
    kind: str  # rule | key
    name: str
    in_flight: int  # its open reservations (a block counts once)
    max_in_flight: int
    requests: tuple[RequestReport, ...]
    windows: tuple[WindowReport, ...]
    spend: tuple[SpendReport, ...] = ()


def read_report(scopes: Sequence[Scope], values: list[int], time: Callable[[], float]) -> list[ScopeReport]:
    """Per scope, what a report reply's counters say (``values[2:]``, in the order of the call's scopes and
    of their limits; ``time``: the ledger's clock, for a USD budget's period). Raises ValueError or
    IndexError for a reply of another length."""
    at = 2
    reports = []
    for scope in scopes:
        limits = scope.limits
        in_flight = values[at]
        at += 1
        requests = []
        for request in limits.requests:
            remaining, full_ms = values[at:at + 2]
            at += 2
            requests.append(RequestReport(request.window_s, request.count, request.burst, remaining,
                                          max(0, full_ms) / 1000, request.shadow))
        windows = []
        for budget in limits.budgets:
            used, reserved, reset_ms = (max(0, x) for x in values[at:at + 3])
            at += 3
            windows.append(WindowReport(budget.window_s, budget.tokens, used, reserved,
                                        max(0, budget.tokens - used - reserved), reset_ms / 1000, budget.shadow))
        spends = []
        for spent in limits.spend:
            used, reserved, reset_ms = values[at:at + 3]
            at += 3
            used, reserved = max(0, used), max(0, reserved)
            spends.append(SpendReport(usd_text(spent.nusd), spent.period, spent.tz,
                                      "hard" if spent.hard else "soft", spent.nusd, used, reserved,
                                      max(0, spent.nusd - used - reserved), rfc3339(spent.clock.at(time()).end),
                                      max(0, reset_ms) / 1000))
        reports.append(ScopeReport(scope.kind, scope.name, in_flight, limits.max_in_flight, tuple(requests),
                                   tuple(windows), tuple(spends)))
    if at != len(values):
        raise ValueError("reply length")
    return reports
