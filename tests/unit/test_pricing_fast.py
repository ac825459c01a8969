"""The request path's pricing (``PriceBook.usage_cost``, ``request_cost.attempts_cost``) is written out for
speed: it must give what the general path gives (``PriceBook.cost`` -> ``cost.request_cost`` /
``total_only_cost``, after the usage's counts are checked), nano-USD for nano-USD, and count the same
unpriced, estimated and clamped requests, over usages of every shape a provider (or a broken one) sends."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import PriceOverride, Pricing
from gateway.pricing.cost import PriceRow
from gateway.pricing.table import PriceTable
from gateway.pricing.units import parse_usd_per_million
from gateway.spend.price_book import PriceBook
from workers.request_cost import ABSURD_FACTOR, attempts_cost, usage_cost

FIELDS = ("total_tokens", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_write_tokens",
          "reasoning_tokens")


def row(start: int, *usd: str) -> PriceRow:
    return PriceRow(start, *(parse_usd_per_million(price) for price in usd))


TABLE = PriceTable({
    "flat": (row(0, "2.5", "10", "1.25", "3.125", "20"),),
    # fractions of a nano-USD per token: the rounding up shows
    "cheap": (row(0, "0.15", "0.6", "0.0375", "0.1875", "0.000123457"),),
    "tiered": (row(0, "1.25", "10", "0.125", "1.25", "10"), row(200_001, "2.5", "15.0000005", "0.25", "2.5", "15"),
               row(1_000_001, "5", "30", "0.5", "5", "40")),
    "free": (row(0, "0", "0", "0", "0", "0"),),
})
# priced by an override, by the table, by the table without its provider prefix, by a relative
# (``estimate``), and not at all
MODELS = ("ovr-1", "flat", "cheap", "tiered", "free", "acme/tiered", "flat-2099-01-01", "acme/cheap:v2",
          "nothing", "acme/nothing")
# Counts a provider reports, and ones no provider could: negative, a float, a bool, a string, huge.
VALUES = (None, 0, 1, 7, 40, 999, 10_000, 200_000, 200_001, 1_000_001, 10**12, -1, 1.5, True, "3")


def book(unpriced: str) -> PriceBook:
    pricing = Pricing(overrides={"ovr-*": PriceOverride(input="0.3", output="1.2", cached_input="0.03")},
                      unpriced=unpriced)  # type: ignore[arg-type]
    return PriceBook.from_config(pricing, TABLE)


def usage(**counts: Any) -> SimpleNamespace:
    return SimpleNamespace(**(dict.fromkeys(FIELDS) | counts))


def usages() -> list[SimpleNamespace]:
    """Every shape by hand (absent, total-only, cache and reasoning parts beyond their whole), then a
    seeded sample of all the values in every field."""
    shaped = [usage(), usage(total_tokens=500), usage(total_tokens=300_000), usage(total_tokens=0),
              usage(total_tokens=-3), usage(prompt_tokens=100), usage(completion_tokens=100),
              usage(prompt_tokens=1_000, completion_tokens=50, total_tokens=1_050),
              usage(prompt_tokens=1_000, completion_tokens=50, cached_tokens=400, reasoning_tokens=20),
              usage(prompt_tokens=1_000, completion_tokens=50, cached_tokens=5_000, cache_write_tokens=10),
              usage(prompt_tokens=1_000, completion_tokens=50, cached_tokens=600, cache_write_tokens=600),
              usage(prompt_tokens=1_000, completion_tokens=50, reasoning_tokens=80),
              usage(prompt_tokens=300_000, completion_tokens=2_000, cached_tokens=0, reasoning_tokens=0),
              usage(prompt_tokens=2_000_000, completion_tokens=10, cache_write_tokens=1_500_000),
              usage(prompt_tokens=None, completion_tokens=None, total_tokens=None, cached_tokens=50)]
    pick = random.Random(20260514)
    sampled = [usage(**{name: pick.choice(VALUES) for name in FIELDS}) for _ in range(3_000)]
    # mostly plain counts, as providers send them
    plain = [usage(**{name: pick.choice(VALUES[:11]) for name in FIELDS}) for _ in range(3_000)]
    return shaped + sampled + plain


def general_usage_cost(prices: PriceBook, model: str, usage: Any, worst: int) -> tuple[int, bool]:
    """The general path: the counts checked, then ``PriceBook.cost``."""
    for value in (getattr(usage, name) for name in FIELDS):
        if value is not None and (value.__class__ is not int or value < 0):
            return worst, True
    cost = prices.cost(model, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                       usage.cache_write_tokens, usage.reasoning_tokens, usage.total_tokens)
    if worst and cost > ABSURD_FACTOR * worst:
        return worst, True
    return cost, False


def general_attempts_cost(prices: PriceBook, model: str | None, result: Any, served: bool, owed: int,
                          estimate: int, worst: int, metered: bool = True) -> tuple[int | None, bool]:
    if model is None:
        return None, False
    cost = owed // estimate * worst if estimate > 0 else 0
    if result is None:
        return cost, False
    found = result.usage
    if served and found is not None and (found.total_tokens is not None or found.prompt_tokens is not None
                                         or found.completion_tokens is not None):
        extra, clamped = general_usage_cost(prices, model, found, worst)
        return cost + extra, clamped
    if served and 400 <= result.status < 500:
        return cost, False
    return (cost + worst, False) if metered else (None, False)


def counts(prices: PriceBook) -> tuple[int, int, int]:
    return prices.counts.zero, prices.counts.estimated, prices.counts.rejected


@pytest.mark.parametrize("unpriced", ["zero", "estimate"])
def test_the_fast_usage_cost_is_the_general_one_for_every_usage(unpriced: str) -> None:
    fast, general = book(unpriced), book(unpriced)
    checked = 0
    for found in usages():
        for model in MODELS:
            for worst in (0, 1_000, 10**9):
                expected = general_usage_cost(general, model, found, worst)
                assert usage_cost(fast, model, found, worst) == expected, (model, vars(found), worst)
                assert counts(fast) == counts(general), (model, vars(found))
                checked += 1
    assert checked > 100_000
    # every branch was taken: unpriced and estimated requests were counted, costs were clamped
    assert fast.counts.zero and (fast.counts.estimated if unpriced == "estimate" else True)


@pytest.mark.parametrize("unpriced", ["zero", "estimate"])
def test_a_usage_known_to_hold_counts_is_priced_as_one_that_is_checked(unpriced: str) -> None:
    """``usage_cost(..., checked=True)`` (an observer whose counts are counts by construction) skips the
    check, and an unpriced model's counts: same cost and counts, memoised or first seen."""
    checked, general = book(unpriced), book(unpriced)
    plain = [found for found in usages() if all(value is None or value.__class__ is int and value >= 0
                                                    for value in vars(found).values())]
    assert len(plain) > 3_000
    for found in plain:
        for model in (*MODELS, "flat/" + "x" * 300):  # and one too long to be memoised
            assert checked.usage_cost(model, found, True) == general.cost(
                model, found.prompt_tokens, found.completion_tokens, found.cached_tokens, found.cache_write_tokens,
                found.reasoning_tokens, found.total_tokens), (model, vars(found))
            assert counts(checked) == counts(general)
    assert checked.counts.zero and (checked.counts.estimated if unpriced == "estimate" else True)


def test_an_impossible_count_counts_no_unpriced_request() -> None:
    fast = book("estimate")
    assert fast.usage_cost("nothing", usage(prompt_tokens=-1, completion_tokens=3)) is None
    assert fast.usage_cost("flat-2099", usage(prompt_tokens=True, completion_tokens=3)) is None
    assert counts(fast) == (0, 0, 0)
    assert fast.usage_cost("nothing", usage(prompt_tokens=1, completion_tokens=3)) == 0
    assert fast.usage_cost("flat-2099", usage(total_tokens=1_000)) == 20_000_000  # each at the dearest: $20/M
    assert counts(fast) == (1, 1, 0)


def test_the_fast_path_prices_a_model_first_seen_and_one_past_the_memo_alike() -> None:
    fast, general = book("zero"), book("zero")
    long_name = "flat/" + "x" * 300  # too long to be memoised: looked up every time
    for model in (long_name, "flat", long_name, "flat"):
        found = usage(prompt_tokens=1_234, completion_tokens=56)
        assert fast.usage_cost(model, found) == general.cost(model, 1_234, 56)
    assert counts(fast) == counts(general) == (2, 0, 0)


def result(status: int, found: SimpleNamespace | None) -> SimpleNamespace:
    return SimpleNamespace(status=status, usage=found)


def test_the_fast_attempts_cost_is_the_general_one() -> None:
    fast, general = book("estimate"), book("estimate")
    found_usages = [None, usage(), usage(total_tokens=90), usage(prompt_tokens=100, completion_tokens=10),
                    usage(prompt_tokens=-1, completion_tokens=10), usage(prompt_tokens=10**9, completion_tokens=1),
                    usage(prompt_tokens=1_000, completion_tokens=100, cached_tokens=500, reasoning_tokens=50)]
    results = [None] + [result(status, found) for status in (0, 200, 400, 429, 502) for found in found_usages]
    combos = itertools.product(("flat", "flat-2099", "nothing", None), results, (True, False), (0, 20, 45),
                               (0, 20), (0, 1_000_000), (True, False))
    for model, outcome, served, owed, estimate, worst, metered in combos:
        expected = general_attempts_cost(general, model, outcome, served, owed, estimate, worst, metered)
        assert attempts_cost(fast, model, outcome, served, owed, estimate, worst, metered) == expected
        assert counts(fast) == counts(general)
    assert fast.counts.zero and fast.counts.estimated
