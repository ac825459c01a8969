"""Quota rules: which rule meters a (tenant, model, key). Pure: data in, data out.

``rules_from_config`` maps the config's ``quota.rules`` onto these structs (duck-typed: no config import;
their entries are ``gateway.identity.key_limits``'s).
``match.model`` and ``match.key`` are globs (``fnmatch``, case-sensitive: ``*``, ``?``, ``[...]``); a key
glob matches the key's kid or its alias (docs/limits.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Protocol

from gateway.identity.key_limits import counted_limits
from gateway.identity.limits import Budget, Limits, RequestLimit, Scope, SpendBudget, limits_problems

__all__ = ["Budget", "KeyLike", "QuotaRule", "RequestLimit", "RuleSet", "rules_from_config", "validate_rules"]


class KeyLike(Protocol):
    """What a rule reads of the request's key (``gateway.identity.auth.KeyIdentity``)."""

    @property
    def kid(self) -> str | None: ...
    @property
    def alias(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class QuotaRule:
    """One ``quota.rules`` entry.

    ``match_tenant`` (exact), ``match_model`` and ``match_key`` (globs) of None mean "any"; a rule with
    all three None is the default rule. ``max_in_flight`` (0 = unlimited) caps concurrent requests of one
    tenant under this rule, across every worker and gateway sharing the Valkey.
    """

    name: str
    budgets: tuple[Budget, ...]
    default_max_tokens: int
    match_tenant: str | None = None
    match_model: str | None = None
    max_in_flight: int = 0
    requests: tuple[RequestLimit, ...] = ()
    match_key: str | None = None
    spend: tuple[SpendBudget, ...] = ()
    match_subject: str | None = None  # a glob over the subject of a JWT or certificate identity only

    @property
    def is_default(self) -> bool:
        return (self.match_tenant is None and self.match_model is None and self.match_key is None
                and self.match_subject is None)

    @property
    def limits(self) -> Limits:
        return Limits(self.requests, self.budgets, self.max_in_flight, self.spend)

    @property
    def scope(self) -> Scope:
        return Scope("rule", self.name, self.limits)

    def matches(self, tenant: str, model: str | None, key: KeyLike | None = None) -> bool:
        if self.match_tenant is not None and self.match_tenant != tenant:
            return False
        if self.match_model is not None and (model is None or not fnmatchcase(model, self.match_model)):
            return False
        if self.match_subject is not None and not subject_matches(self.match_subject, key):
            return False
        return self.match_key is None or (key is not None and key_matches(self.match_key, key))


def key_matches(pattern: str, key: KeyLike) -> bool:
    """A key glob matches the key's kid or its alias."""
    kid, alias = key.kid, key.alias
    return (kid is not None and fnmatchcase(kid, pattern)) or (alias is not None and fnmatchcase(alias, pattern))


def subject_matches(pattern: str, key: KeyLike | None) -> bool:
    """A subject glob matches the subject (alias) of an identity from an IdP or a certificate (``via``
    set), never an API key's alias."""
    via = getattr(key, "via", None)
    alias = None if key is None else key.alias
    return via is not None and alias is not None and fnmatchcase(alias, pattern)


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
        if rule.limits.empty:
            problems.append(f"{where}.budgets: a rule needs budgets, requests, spend or max_in_flight")
        problems += limits_problems(rule.limits, where)
        if rule.default_max_tokens < 0:
            problems.append(f"{where}.estimate.default_max_tokens: must be >= 0")
    return problems


def model_glob_problems(rules: Sequence[QuotaRule], models: Iterable[str]) -> list[str]:
    """A rule whose ``match.model`` glob matches none of ``models`` (an overlay's capabilities) could
    never apply to a request: one problem each (``gridgate check``: the overlay it reads)."""
    names = list(models)
    return [f"quota.rules[{i}].match.model: {rule.match_model!r} matches no model of the overlay"
            for i, rule in enumerate(rules)
            if rule.match_model is not None and not any(fnmatchcase(name, rule.match_model) for name in names)]


class RuleSet:
    """Ordered rules with first-match-wins lookup.

    Lookups are memoised per (tenant, model, key): tenants and keys come from the configured keys and
    models from the overlay, so the cache stays small; it is capped anyway so hostile model names cannot
    grow it.
    """

    __slots__ = ("rules", "_cache")

    _CACHE_CAP = 4096

    def __init__(self, rules: Sequence[QuotaRule]) -> None:
        problems = validate_rules(rules)
        if problems:
            raise ValueError("; ".join(problems))
        self.rules: tuple[QuotaRule, ...] = tuple(rules)
        self._cache: dict[tuple[str, str | None, object], QuotaRule | None] = {}

    def match(self, tenant: str, model: str | None, key: KeyLike | None = None) -> QuotaRule | None:
        """The rule a JWT's claims name (``KeyIdentity.rule``) if there is one of that name, else the
        first rule matching, or None (no rule and no default: the rule meters nothing)."""
        cache_key = (tenant, model, key)
        try:
            return self._cache[cache_key]
        except KeyError:
            pass
        named = getattr(key, "rule", None)  # a JWT whose claims name its rule (docs/identity.md)
        found = None if named is None else next((r for r in self.rules if r.name == named), None)
        if found is None:
            found = next((r for r in self.rules if r.matches(tenant, model, key)), None)
        if len(self._cache) >= self._CACHE_CAP:
            self._cache.clear()
        self._cache[cache_key] = found
        return found

    def rules_for_tenant(self, tenant: str) -> list[QuotaRule]:
        """Every rule that can apply to ``tenant`` for some model or key (for ``/admin/quota``)."""
        return [r for r in self.rules if r.match_tenant in (None, tenant)]


def rules_from_config(quota: Any) -> list[QuotaRule]:
    """The config's ``quota.rules`` (gateway.config structs) as the ledger's rule structs."""
    rules = []
    for rule in quota.rules:
        limits = counted_limits(rule.requests, rule.budgets, rule.max_in_flight, rule.spend)
        match = rule.match
        rules.append(QuotaRule(
            name=rule.name,
            budgets=limits.budgets,
            default_max_tokens=rule.estimate.default_max_tokens,
            match_tenant=match.tenant if match else None,
            match_model=match.model if match else None,
            max_in_flight=limits.max_in_flight,
            requests=limits.requests,
            match_key=match.key if match else None,
            spend=limits.spend,
            match_subject=match.subject if match else None,
        ))
    return rules
