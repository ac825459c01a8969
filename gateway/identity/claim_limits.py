"""A JWT subject's own limits taken from its token's claims (``auth.jwt[].limits_from_claims``,
docs/identity.md "Limits from claims"). Pure.

The IdP says how much a subject may use (``gridgate.rpm: 120``); the gateway turns that into the same
written limits (``KeyLimits``) a key has, so the quota meters a subject exactly as it meters a key: no
special case below the identity. A claim's limit replaces the entry's configured limit of that kind
(the ``1m`` request limit, the ``1m`` token budget, the in-flight cap); every other configured limit
stays. A claim that is missing keeps the configured limit silently; a value that is not a whole
number within the limit's bounds keeps it too and is reported (``bad`` names the claims), so a
mistyped claim at the IdP never refuses, and never lifts, a subject's limits.
"""

from __future__ import annotations

from typing import Any

from gateway.identity.key_limits import (
    MAX_IN_FLIGHT,
    MAX_REQUESTS_PER_SECOND,
    MAX_TOKENS,
    KeyLimits,
    RequestRate,
    TokenBudget,
)

MINUTE = "1m"
# (config field, upper bound) in the order of a ``ClaimValues`` tuple.
BOUNDS = (("requests_per_minute", 60 * MAX_REQUESTS_PER_SECOND), ("tokens_per_minute", MAX_TOKENS),
          ("max_in_flight", MAX_IN_FLIGHT))
_MAX_DIGITS = 16

ClaimValues = tuple[int | None, int | None, int | None]  # requests per minute, tokens per minute, in flight
NO_VALUES: ClaimValues = (None, None, None)


def whole_number(value: Any, high: int) -> int | None:
    """``value`` as an int in ``1..high``: an integer, an integral float (JSON ``60.0``) or a string of
    digits (IdP mappers often emit strings); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and 0 < len(value) <= _MAX_DIGITS and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and 1 <= value <= high:
        return value
    return None


def claim_values(spec: Any, claims: dict[str, Any], claim_at: Any) -> tuple[ClaimValues, list[str]]:
    """The limits ``spec`` (a ``ClaimLimits``) reads from ``claims``, and the claim paths whose values
    were present but unusable. ``claim_at(claims, path)`` resolves a (dotted) claim path."""
    values: list[int | None] = []
    bad: list[str] = []
    for field, high in BOUNDS:
        path = getattr(spec, field)
        raw = None if path is None else claim_at(claims, path)
        value = None if raw is None else whole_number(raw, high)
        if raw is not None and value is None:
            bad.append(path)
        values.append(value)
    return (values[0], values[1], values[2]), bad


def subject_limits(base: KeyLimits | None, values: ClaimValues) -> KeyLimits | None:
    """``base`` (the entry's ``limits``) with the claims' values in place of its limits of that kind;
    None when there is neither. ``ValueError`` when the result is not a valid set of limits (the
    caller keeps ``base``)."""
    rpm, tpm, in_flight = values
    if base is None and values == NO_VALUES:
        return None
    base = base or KeyLimits()
    if values == NO_VALUES:
        return base
    requests = list(base.requests)
    budgets = list(base.budgets)
    if rpm is not None:
        requests = [rate for rate in requests if rate.window != MINUTE] + [RequestRate(window=MINUTE, count=rpm)]
    if tpm is not None:
        budgets = [budget for budget in budgets if budget.window != MINUTE] + [TokenBudget(window=MINUTE, tokens=tpm)]
    return KeyLimits(requests=requests, budgets=budgets,
                     max_in_flight=base.max_in_flight if in_flight is None else in_flight, spend=list(base.spend))
