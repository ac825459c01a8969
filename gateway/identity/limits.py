"""What can limit a request: request rates, token budgets and a concurrency cap, and whose they are. Pure.

A ``Limits`` is one owner's set (a rule's, or a key's: docs/limits.md) as the quota counts it; their
written form (the config's, a managed key record's) is ``key_limits.py``'s. A ``Scope`` is such a set
with its owner, as the ledger counts it: the rule's limits count per (tenant, rule), a key's per (tenant, key).
A request is metered by at most two scopes, its key's and its rule's, and every limit of both is
checked and taken in one ledger call (``ledger.py``). ``LimitRef`` names one limit of that call, in the
call's order, so a reply's index says which limit refused, in the words the 429 uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.pricing.period import PeriodClock
from gateway.pricing.units import NANO_PER_USD, format_usd
from gateway.yaml_config import format_duration

MAX_LIMITS_PER_KIND = 8

ScopeKind = Literal["rule", "key"]
LimitKind = Literal["requests", "tokens", "spend", "in_flight"]


def window_text(seconds: int) -> str:
    """``60`` -> ``1m``, ``86400`` -> ``1d``, ``90`` -> ``90s``: the config's own duration form, the one a
    written window is kept in (``key_limits.py``)."""
    return format_duration(seconds)


@dataclass(frozen=True, slots=True)
class RequestLimit:
    """At most ``count`` requests per ``window_s``, ``burst`` of them at once: GCRA (a request takes a slot;
    slots come back one every ``window_s / count``, up to ``burst`` banked). No window boundaries."""

    window_s: int
    count: int
    burst: int
    shadow: bool = False

    @property
    def text(self) -> str:
        burst = f" burst {self.burst}" if self.burst != self.count else ""
        return f"{self.count}/{window_text(self.window_s)}{burst}"


@dataclass(frozen=True, slots=True)
class Budget:
    """``tokens`` may be spent per fixed window of ``window_s`` seconds (aligned to the Unix epoch)."""

    window_s: int
    tokens: int
    shadow: bool = False

    @property
    def text(self) -> str:
        return f"{self.tokens}/{window_text(self.window_s)}"


def usd_text(nusd: int) -> str:
    """``$5.00``; a budget finer than a cent in full (``$0.125``)."""
    return f"${nusd // NANO_PER_USD}.{nusd % NANO_PER_USD // 10**7:02d}" if nusd % 10**7 == 0 else f"${format_usd(nusd)}"


@dataclass(frozen=True, slots=True, eq=False)
class SpendBudget:
    """``nusd`` nano-USD may be spent per calendar ``period`` of zone ``tz`` (docs/limits.md, "USD
    budgets"). ``hard``: admission reserves the request's worst-case cost and refuses what no longer
    fits; soft: counts and alerts only. ``alert_at``: thresholds in thousandths of the budget.
    ``clock`` remembers the current period (compared by identity: one per configured limit)."""

    nusd: int
    period: str
    tz: str
    hard: bool
    alert_at: tuple[int, ...]
    clock: PeriodClock

    @property
    def text(self) -> str:
        """``$5.00/1d (UTC)``."""
        return f"{self.budget_text} ({self.tz})"

    @property
    def budget_text(self) -> str:
        """``$5.00/1d``."""
        return f"{usd_text(self.nusd)}/{self.period}"

    @property
    def thresholds(self) -> str:
        """``alert_at`` as the ledger stores it: ``500/800/1000``."""
        return "/".join(str(t) for t in self.alert_at)


@dataclass(frozen=True, slots=True)
class Limits:
    """One owner's limits; ``max_in_flight`` 0 = no cap."""

    requests: tuple[RequestLimit, ...] = ()
    budgets: tuple[Budget, ...] = ()
    max_in_flight: int = 0
    spend: tuple[SpendBudget, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.requests and not self.budgets and not self.max_in_flight and not self.spend

    @property
    def has_shadow(self) -> bool:
        return any(limit.shadow for limit in self.requests) or any(budget.shadow for budget in self.budgets)


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Scope:
    """An owner's limits as the ledger counts them: ``name`` is the rule's name, or the key's identity."""

    kind: ScopeKind
    name: str
    limits: Limits
    tag: str = "r"  # in the ledger's keys: r (a rule), a (a key by its alias), k (a key by its kid)

    def label(self) -> str:
        """How a 429 names the owner: ``rule team-a``; a key is the caller's own: ``key``."""
        return f"rule {self.name}" if self.kind == "rule" else "key"

    def owner(self) -> str:
        """How an alert names the owner: ``rule team-a``, ``key <kid or alias>``."""
        return f"{self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class LimitRef:
    """One limit of one admit call: its owner, its kind and the limit (None for the in-flight cap)."""

    scope: Scope
    kind: LimitKind
    limit: RequestLimit | Budget | SpendBudget | None
    shadow: bool

    @property
    def text(self) -> str:
        """``rule team-a tokens 30000/1m``, ``key requests 60/1m``, ``rule team-a in-flight 4``."""
        if self.limit is None:
            return f"{self.scope.label()} in-flight {self.scope.limits.max_in_flight}"
        return f"{self.scope.label()} {self.kind} {self.limit.text}"


def limit_refs(scopes: Sequence[Scope]) -> tuple[LimitRef, ...]:
    """Every limit of ``scopes`` in the ledger call's order: per scope its requests, budgets, spend
    limits, in-flight cap."""
    refs: list[LimitRef] = []
    for scope in scopes:
        limits = scope.limits
        refs += [LimitRef(scope, "requests", limit, limit.shadow) for limit in limits.requests]
        refs += [LimitRef(scope, "tokens", budget, budget.shadow) for budget in limits.budgets]
        refs += [LimitRef(scope, "spend", spend, False) for spend in limits.spend]
        if limits.max_in_flight:
            refs.append(LimitRef(scope, "in_flight", None, False))
    return tuple(refs)


def block_problems(request_windows: Sequence[int], budget_windows: Sequence[int],
                   periods: Sequence[str]) -> list[str]:
    """One message per problem across one owner's entries (too many of a kind, two of a kind with the
    same window or period), each naming its field relative to the owner (``requests: ...``)."""
    problems: list[str] = []
    for kind, twice, keys in (("requests", "two request limits with the same window", request_windows),
                              ("budgets", "two budgets with the same window", budget_windows),
                              ("spend", "two spend limits with the same period (one budget per period)", periods)):
        if len(keys) > MAX_LIMITS_PER_KIND:
            problems.append(f"{kind}: at most {MAX_LIMITS_PER_KIND} entries")
        if len(set(keys)) != len(keys):
            problems.append(f"{kind}: {twice}")
    return problems


def limits_problems(limits: Limits, where: str) -> list[str]:
    """One message per problem of one owner's limits, each naming its field under ``where``."""
    problems = [f"{where}.{problem}" for problem in block_problems(
        [entry.window_s for entry in limits.requests], [entry.window_s for entry in limits.budgets],
        [spend.period for spend in limits.spend])]
    for j, request in enumerate(limits.requests):
        if not 1 <= request.window_s <= 86400:
            problems.append(f"{where}.requests[{j}].window: must be 1s..1d")
        if request.count < 1:
            problems.append(f"{where}.requests[{j}].count: must be at least 1")
        if request.burst < 1:
            problems.append(f"{where}.requests[{j}].burst: must be at least 1")
    for j, budget in enumerate(limits.budgets):
        if budget.window_s < 1:
            problems.append(f"{where}.budgets[{j}].window: must be at least 1s")
        if budget.tokens < 1:
            problems.append(f"{where}.budgets[{j}].tokens: must be at least 1")
    if limits.max_in_flight < 0:
        problems.append(f"{where}.max_in_flight: must be >= 0")
    return problems
