"""``limits_from_claims`` (docs/identity.md, "Limits from claims"): claim values -> a subject's written limits."""

from __future__ import annotations

import pytest

from gateway.config.jwt import ClaimLimits
from gateway.identity.claim_limits import NO_VALUES, claim_values, subject_limits, whole_number
from gateway.identity.jwt_verify import claim_at
from gateway.identity.key_limits import KeyLimits, RequestRate, TokenBudget

SPEC = ClaimLimits(requests_per_minute="gridgate.rpm", tokens_per_minute="gridgate.tpm", max_in_flight="conc")


@pytest.mark.parametrize(("value", "expected"), [
    (60, 60), (60.0, 60), ("60", 60), (0, None), (-1, None), (True, None), (1.5, None), ("6e1", None),
    ("", None), ("٣", None), ([60], None), (None, None), (10**9, None), ("1" * 20, None)])
def test_a_limit_claim_is_a_whole_number_within_bounds(value, expected):
    assert whole_number(value, 10**6) == expected


def test_claim_values_names_the_claims_it_could_not_use():
    values, bad = claim_values(SPEC, {"gridgate": {"rpm": 120, "tpm": "lots"}}, claim_at)
    assert values == (120, None, None) and bad == ["gridgate.tpm"]
    assert claim_values(SPEC, {}, claim_at) == (NO_VALUES, [])


def test_claimed_limits_replace_the_configured_limit_of_their_kind_only():
    base = KeyLimits(requests=[RequestRate(window="60s", count=5), RequestRate(window="1h", count=100)],
                     budgets=[TokenBudget(window="1d", tokens=10**6)], max_in_flight=4)
    limits = subject_limits(base, (2, 500, None))
    assert [(r.window, r.count) for r in limits.requests] == [("1h", 100), ("1m", 2)]
    assert [(b.window, b.tokens) for b in limits.budgets] == [("1d", 10**6), ("1m", 500)]
    assert limits.max_in_flight == 4
    assert subject_limits(base, (None, None, 9)).max_in_flight == 9
    assert subject_limits(base, NO_VALUES) is base
    assert subject_limits(None, NO_VALUES) is None
    assert subject_limits(None, (3, None, None)).counted().requests[0].count == 3


def test_a_claim_spec_must_name_a_claim():
    with pytest.raises(ValueError, match="requests_per_minute"):
        ClaimLimits()
    with pytest.raises(ValueError, match="tokens_per_minute"):
        ClaimLimits(tokens_per_minute="a..b")
