"""The arithmetic of spend: prices in integer nano-USD per million tokens, one rounding per request."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.pricing.cost import ModelPrice, PriceRow, request_cost, worst_case_cost
from gateway.pricing.units import (
    MAX_NUSD_PER_MILLION,
    format_usd,
    nusd_of,
    parse_usd_per_million,
    usd_per_token_to_nusd_per_million,
)

USD = 10**9  # nano-USD


def flat(input_: int, output: int, cached: int | None = None, write: int | None = None,
         reasoning: int | None = None) -> ModelPrice:
    row = PriceRow(0, input_, output, input_ if cached is None else cached, input_ if write is None else write,
                   output if reasoning is None else reasoning)
    return ModelPrice.of("m", "override", (row,))


def per_million(usd: str) -> int:
    return parse_usd_per_million(usd)


# --- conversions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("written", "nusd_per_million"), [
    ("2.5", 2_500_000_000), (2.5, 2_500_000_000), (0.15, 150_000_000), ("0.075", 75_000_000),
    (3, 3_000_000_000), (0, 0), ("0", 0), (" 1.25 ", 1_250_000_000), ("1e-3", 1_000_000),
    (0.1 + 0.2, 300_000_001),  # the float 0.30000000000000004 as written: its 17th digit rounds up
    ("0.0000000001", 1),  # finer than a nano-USD per million tokens: rounded up
    ("10000", 10_000 * USD),
])
def test_config_prices_are_read_as_the_decimal_written(written: object, nusd_per_million: int) -> None:
    assert parse_usd_per_million(written) == nusd_per_million


@pytest.mark.parametrize(("written", "problem"), [
    (-1, "must be >= 0"), ("-0.5", "must be >= 0"), (10_000.01, "must be <= 10000"), ("1e30", "must be <= 10000"),
    ("abc", "is not a number"), ("", "is not a number"), (float("nan"), "not a finite price"),
    ("Infinity", "not a finite price"), (True, "must be a number"), ([1], "must be a number"),
    ("1" * 80, "not 80 characters"),
])
def test_bad_config_prices_say_why(written: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_usd_per_million(written)


@pytest.mark.parametrize(("per_token", "nusd_per_million"), [
    (2.5e-06, 2_500_000_000), (1e-05, 10_000_000_000), (1.25e-07, 125_000_000),
    (9.499999999999999e-07, 950_000_000),  # binary noise of 9.5e-07 is not a price
    (2.9999900000000002e-06, 2_999_990_000), (0.0, 0), (0, 0), (3.75e-08, 37_500_000),
])
def test_source_prices_lose_their_binary_noise(per_token: float, nusd_per_million: int) -> None:
    assert usd_per_token_to_nusd_per_million(per_token) == nusd_per_million


def test_amounts_round_up_to_whole_nano_usd_once() -> None:
    assert nusd_of(0) == 0
    assert nusd_of(1) == 1  # 1e-15 USD is charged 1 nano-USD: never less than the exact cost
    assert nusd_of(1_000_000) == 1
    assert nusd_of(1_000_001) == 2
    assert format_usd(32_500_000) == "0.0325"
    assert format_usd(5 * USD) == "5"
    assert format_usd(-1) == "-0.000000001"


# --- cost of one request --------------------------------------------------------------------------


def test_each_part_of_the_usage_has_its_price() -> None:
    price = flat(per_million("3"), per_million("15"), cached=per_million("0.30"), write=per_million("3.75"),
                 reasoning=per_million("20"))
    # 10,000 prompt tokens: 6,000 plain, 3,000 read from the cache, 1,000 written to it;
    # 2,000 completion tokens: 1,500 visible, 500 reasoning.
    cost = request_cost(price, 10_000, 2_000, cached_tokens=3_000, cache_write_tokens=1_000, reasoning_tokens=500)
    expected_usd = (Fraction(6_000 * 3) + Fraction(3_000 * 30, 100) + Fraction(1_000 * 375, 100)
                    + Fraction(1_500 * 15) + Fraction(500 * 20)) / 10**6
    assert cost == expected_usd * USD == 55_150_000  # $0.05515


def test_without_a_reasoning_price_reasoning_costs_the_output_price() -> None:
    price = flat(per_million("2"), per_million("8"))
    assert request_cost(price, 100, 1_000, reasoning_tokens=800) == request_cost(price, 100, 1_000)


def test_inconsistent_usage_never_costs_more_than_its_whole_nor_below_zero() -> None:
    price = flat(per_million("1"), per_million("4"), cached=0, write=per_million("9"), reasoning=per_million("7"))
    # cached beyond the prompt: the whole prompt is cached, nothing is written or plain
    assert request_cost(price, 100, 0, cached_tokens=500, cache_write_tokens=50) == 0
    # cache writes beyond what is left of the prompt: capped at it
    assert request_cost(price, 100, 0, cached_tokens=40, cache_write_tokens=500) == nusd_of(60 * price.base.cache_write)
    # reasoning beyond the completion: all of the completion is reasoning
    assert request_cost(price, 0, 10, reasoning_tokens=99) == nusd_of(10 * price.base.reasoning)
    # negative counts count as none
    assert request_cost(price, -5, -5, cached_tokens=-5, cache_write_tokens=-5, reasoning_tokens=-5) == 0
    assert request_cost(price, 10, 10, cached_tokens=-5, reasoning_tokens=-5) == request_cost(price, 10, 10)


def test_a_free_model_costs_nothing() -> None:
    assert request_cost(flat(0, 0), 10**9, 10**9, cached_tokens=5, reasoning_tokens=5) == 0
    assert worst_case_cost(flat(0, 0), 10**9, 10**9) == 0


def test_large_requests_stay_exact_integers() -> None:
    price = flat(MAX_NUSD_PER_MILLION - 1, MAX_NUSD_PER_MILLION - 3)
    cost = request_cost(price, 10**12 + 1, 10**12 + 7)
    exact = Fraction((10**12 + 1) * (MAX_NUSD_PER_MILLION - 1) + (10**12 + 7) * (MAX_NUSD_PER_MILLION - 3), 10**6)
    assert type(cost) is int and cost == -(-exact.numerator // exact.denominator)


# --- tiers by prompt size -------------------------------------------------------------------------

TIERED = ModelPrice.of("tiered", "table", (
    PriceRow(0, per_million("1.25"), per_million("10"), per_million("0.125"), per_million("1.25"), per_million("10")),
    PriceRow(200_001, per_million("2.5"), per_million("15"), per_million("0.25"), per_million("2.5"), per_million("15")),
))


def test_the_tier_is_chosen_by_the_prompt_size_and_prices_the_whole_request() -> None:
    assert request_cost(TIERED, 200_000, 1_000) == (200_000 * 1_250 + 1_000 * 10_000)  # $0.26 at the base tier
    assert request_cost(TIERED, 200_001, 1_000) == (200_001 * 2_500 + 1_000 * 15_000)  # every token at the tier's price
    assert TIERED.tier(0) is TIERED.base
    assert TIERED.tier(10**9) is TIERED.above[-1]


def test_worst_case_is_every_prompt_token_at_its_dearest_and_every_completion_token_too() -> None:
    price = flat(per_million("3"), per_million("15"), cached=per_million("0.3"), write=per_million("3.75"),
                 reasoning=per_million("20"))
    assert worst_case_cost(price, 1_000, 100) == nusd_of(1_000 * per_million("3.75") + 100 * per_million("20"))
    assert worst_case_cost(TIERED, 1_000, 100) == nusd_of(1_000 * per_million("1.25") + 100 * per_million("10"))
    assert worst_case_cost(TIERED, 300_000, 100) == nusd_of(300_000 * per_million("2.5") + 100 * per_million("15"))


# --- properties -----------------------------------------------------------------------------------

prices = st.integers(min_value=0, max_value=MAX_NUSD_PER_MILLION)
counts = st.integers(min_value=0, max_value=10**9)


@st.composite
def usages(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    prompt, completion = draw(counts), draw(counts)
    cached = draw(st.integers(0, prompt))
    written = draw(st.integers(0, prompt - cached))
    return prompt, completion, cached, written, draw(st.integers(0, completion))


@st.composite
def model_prices(draw: st.DrawFn) -> ModelPrice:
    starts = sorted(draw(st.sets(st.integers(1, 10**9), max_size=3)))
    rows = [PriceRow(start, *(draw(prices) for _ in range(5))) for start in [0, *starts]]
    return ModelPrice.of("m", "table", rows)


@given(st.lists(usages(), min_size=1, max_size=50), prices, prices, prices, prices, prices)
def test_per_request_costs_add_up_to_the_cost_of_the_summed_usage_within_a_nano_usd_each(
    requests: list[tuple[int, int, int, int, int]], input_: int, output: int, cached: int, write: int, reasoning: int
) -> None:
    price = flat(input_, output, cached, write, reasoning)
    charged = sum(request_cost(price, *usage) for usage in requests)
    summed = [sum(column) for column in zip(*requests, strict=True)]
    whole = request_cost(price, *summed)
    # each request is rounded up once: the sum is never below the exact total, and at most 1 nano-USD
    # per request above it
    assert whole <= charged < whole + len(requests)


@given(model_prices(), usages(), counts, counts)
def test_no_usage_within_the_reservation_costs_more_than_the_worst_case(
    price: ModelPrice, usage: tuple[int, int, int, int, int], extra_prompt: int, extra_completion: int
) -> None:
    prompt, completion = usage[0], usage[1]
    reserved = worst_case_cost(price, prompt + extra_prompt, completion + extra_completion)
    assert request_cost(price, *usage) <= reserved
    assert worst_case_cost(price, prompt, completion) <= reserved  # monotone in both sizes
