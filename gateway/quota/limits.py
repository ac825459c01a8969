"""What can limit a request: request rates, token budgets and a concurrency cap, and whose they are. Pure.

A ``Limits`` is one owner's set (a rule's, or a key's: docs/limits.md). A ``Scope`` is such a set with
its owner, as the ledger counts it: the rule's limits count per (tenant, rule), a key's per (tenant, key).
A request is metered by at most two scopes, its key's and its rule's, and every limit of both is
checked and taken in one ledger call (``ledger.py``). ``LimitRef`` names one limit of that call, in the
call's order, so a reply's index says which limit refused, in the words the 429 uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

MAX_LIMITS_PER_KIND = 8

ScopeKind = Literal["rule", "key"]
LimitKind = Literal["requests", "tokens", "in_flight"]


def window_text(seconds: int) -> str:
    """``60`` -> ``1m``, ``86400`` -> ``1d``, ``90`` -> ``90s`` (the config's own duration form)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


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


@dataclass(frozen=True, slots=True)
class Limits:
    """One owner's limits; ``max_in_flight`` 0 = no cap."""

    requests: tuple[RequestLimit, ...] = ()
    budgets: tuple[Budget, ...] = ()
    max_in_flight: int = 0

    @property
    def empty(self) -> bool:
        return not self.requests and not self.budgets and not self.max_in_flight

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


@dataclass(frozen=True, slots=True)
class LimitRef:
    """One limit of one admit call: its owner, its kind and the limit (None for the in-flight cap)."""

    scope: Scope
    kind: LimitKind
    limit: RequestLimit | Budget | None
    shadow: bool

    @property
    def text(self) -> str:
        """``rule team-a tokens 30000/1m``, ``key requests 60/1m``, ``rule team-a in-flight 4``."""
        if self.limit is None:
            return f"{self.scope.label()} in-flight {self.scope.limits.max_in_flight}"
        return f"{self.scope.label()} {self.kind} {self.limit.text}"


def limit_refs(scopes: Sequence[Scope]) -> tuple[LimitRef, ...]:
    """Every limit of ``scopes`` in the ledger call's order: per scope its requests, budgets, in-flight cap."""
    refs: list[LimitRef] = []
    for scope in scopes:
        limits = scope.limits
        refs += [LimitRef(scope, "requests", limit, limit.shadow) for limit in limits.requests]
        refs += [LimitRef(scope, "tokens", budget, budget.shadow) for budget in limits.budgets]
        if limits.max_in_flight:
            refs.append(LimitRef(scope, "in_flight", None, False))
    return tuple(refs)


def limits_problems(limits: Limits, where: str) -> list[str]:
    """One message per problem of one owner's limits, each naming its field under ``where``."""
    problems: list[str] = []
    for kind, what, entries in (("requests", "request limits", limits.requests), ("budgets", "budgets", limits.budgets)):
        if len(entries) > MAX_LIMITS_PER_KIND:
            problems.append(f"{where}.{kind}: at most {MAX_LIMITS_PER_KIND} entries")
        windows = [entry.window_s for entry in entries]
        if len(set(windows)) != len(windows):
            problems.append(f"{where}.{kind}: two {what} with the same window")
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


def limits_from_config(requests: Sequence[Any], budgets: Sequence[Any], max_in_flight: int | None) -> Limits:
    """A config block's ``requests``/``budgets``/``max_in_flight`` (gateway.config structs, duck-typed) as
    ``Limits``."""
    return Limits(
        requests=tuple(RequestLimit(int(r.window), r.count, r.count if r.burst is None else r.burst, r.shadow)
                       for r in requests),
        budgets=tuple(Budget(int(b.window), b.tokens, b.shadow) for b in budgets),
        max_in_flight=max_in_flight or 0,
    )
