"""Quota rules: which budgets apply to a (tenant, model). Pure: data in, data out.

``rules_from_config`` maps the config's ``quota.rules`` onto these structs (duck-typed: no config import).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_BUDGETS_PER_RULE = 8


@dataclass(frozen=True, slots=True)
class Budget:
    """``tokens`` may be spent per fixed window of ``window_s`` seconds (aligned to the Unix epoch)."""

    window_s: int
    tokens: int


@dataclass(frozen=True, slots=True)
class QuotaRule:
    """One ``quota.rules`` entry.

    ``match_tenant``/``match_model`` of None mean "any"; a rule with both None is the default rule.
    ``max_in_flight`` (0 = unlimited) caps concurrent reservations of one tenant under this rule, across
    every worker and gateway sharing the Valkey (see ``ledger`` for how it is counted).
    """

    name: str
    budgets: tuple[Budget, ...]
    default_max_tokens: int
    match_tenant: str | None = None
    match_model: str | None = None
    max_in_flight: int = 0

    @property
    def is_default(self) -> bool:
        return self.match_tenant is None and self.match_model is None

    def matches(self, tenant: str, model: str | None) -> bool:
        if self.match_tenant is not None and self.match_tenant != tenant:
            return False
        return self.match_model is None or self.match_model == model


def validate_rules(rules: Sequence[QuotaRule]) -> list[str]:
    """Return one message per problem (empty list = valid), each naming the offending field."""
    problems: list[str] = []
    seen: set[str] = set()
    for i, rule in enumerate(rules):
        where = f"quota.rules[{i}]"
        if not rule.name:
            problems.append(f"{where}.name: must not be empty")
        elif rule.name in seen:
            problems.append(f"{where}.name: duplicate rule name {rule.name!r}")
        seen.add(rule.name)
        if rule.is_default and i != len(rules) - 1:
            problems.append(f"{where}.match: a rule without match is the default and must be last")
        if not 1 <= len(rule.budgets) <= MAX_BUDGETS_PER_RULE:
            problems.append(f"{where}.budgets: needs 1..{MAX_BUDGETS_PER_RULE} budgets")
        windows = [b.window_s for b in rule.budgets]
        if len(set(windows)) != len(windows):
            problems.append(f"{where}.budgets: two budgets with the same window")
        for j, budget in enumerate(rule.budgets):
            if budget.window_s < 1:
                problems.append(f"{where}.budgets[{j}].window: must be at least 1s")
            if budget.tokens < 1:
                problems.append(f"{where}.budgets[{j}].tokens: must be at least 1")
        if rule.default_max_tokens < 0:
            problems.append(f"{where}.estimate.default_max_tokens: must be >= 0")
        if rule.max_in_flight < 0:
            problems.append(f"{where}.max_in_flight: must be >= 0")
    return problems


class RuleSet:
    """Ordered rules with first-match-wins lookup.

    Lookups are memoised per (tenant, model): tenants come from the configured keys and models from
    the overlay, so the cache stays small; it is capped anyway so hostile model names cannot grow it.
    """

    __slots__ = ("rules", "_cache")

    _CACHE_CAP = 4096

    def __init__(self, rules: Sequence[QuotaRule]) -> None:
        problems = validate_rules(rules)
        if problems:
            raise ValueError("; ".join(problems))
        self.rules: tuple[QuotaRule, ...] = tuple(rules)
        self._cache: dict[tuple[str, str | None], QuotaRule | None] = {}

    def match(self, tenant: str, model: str | None) -> QuotaRule | None:
        """The first rule matching, or None (no rule and no default: the request is unmetered)."""
        key = (tenant, model)
        try:
            return self._cache[key]
        except KeyError:
            pass
        found = next((r for r in self.rules if r.matches(tenant, model)), None)
        if len(self._cache) >= self._CACHE_CAP:
            self._cache.clear()
        self._cache[key] = found
        return found

    def rules_for_tenant(self, tenant: str) -> list[QuotaRule]:
        """Every rule that can apply to ``tenant`` for some model (for ``/admin/quota``)."""
        return [r for r in self.rules if r.match_tenant in (None, tenant)]


def rules_from_config(quota: Any) -> list[QuotaRule]:
    """The config's ``quota.rules`` (gateway.config structs) as the ledger's rule structs."""
    return [
        QuotaRule(
            name=rule.name,
            budgets=tuple(Budget(int(budget.window), budget.tokens) for budget in rule.budgets),
            default_max_tokens=rule.estimate.default_max_tokens,
            match_tenant=rule.match.tenant if rule.match else None,
            match_model=rule.match.model if rule.match else None,
            max_in_flight=rule.max_in_flight or 0,
        )
        for rule in quota.rules
    ]
