"""Money as integers: nano-USD amounts and prices in nano-USD per million tokens. Pure.

A request's cost is an integer number of nano-USD (1e-9 USD): budgets, counters and reports add
integers, so no amount drifts the way a float sum does. Per-token prices of cheap models are
fractions of a nano-USD (gpt-4o-mini's input: $0.15 per million tokens = 0.15 nano-USD a token),
so prices are held per MILLION tokens: an integer number of nano-USD per million tokens, exact for
any price written with up to nine decimals of USD per million tokens. A price is converted once,
when the table or the config is loaded; each request multiplies integers and rounds once
(``nusd_of``). See docs/pricing.md ("Rounding").
"""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext

NANO_PER_USD = 10**9
TOKENS_PER_PRICE_UNIT = 10**6  # prices are per million tokens
# The largest price accepted anywhere: $10,000 per million tokens ($0.01 a token). The table's
# dearest model is below it; the bound keeps every product of a realistic request far inside
# a 64-bit counter of the ledger.
MAX_USD_PER_MILLION = 10_000
MAX_NUSD_PER_MILLION = MAX_USD_PER_MILLION * NANO_PER_USD


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` in integers (``denominator`` > 0)."""
    return -(-numerator // denominator)


def nusd_of(femto_usd: int) -> int:
    """An amount in 1e-15 USD (tokens x nano-USD per million tokens) as whole nano-USD, rounded up:
    a request is never charged less than its exact cost, and at most 1 nano-USD more."""
    return ceil_div(femto_usd, TOKENS_PER_PRICE_UNIT)


_MAX_PRICE_TEXT = 64  # characters of a written price: more is no price anyone means


def _nusd_per_million(usd_per_million: Decimal) -> int:
    """USD per million tokens -> nano-USD per million tokens; finer than that is rounded up."""
    with localcontext() as context:
        context.prec = 2 * _MAX_PRICE_TEXT  # exact for every accepted price: no rounding but ours
        return int((usd_per_million * NANO_PER_USD).to_integral_value(rounding=ROUND_CEILING))


def parse_usd_per_million(value: object) -> int:
    """A price as written in the config (USD per million tokens: a decimal string, an integer or a
    number) -> nano-USD per million tokens. A YAML number is read as the decimal it was written as
    (``0.15`` is 0.15, not the binary float nearest to it). Raises ValueError saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError("must be a number of USD per million tokens (e.g. 2.5 or \"0.075\")")
    text = value.strip() if isinstance(value, str) else repr(value)
    if len(text) > _MAX_PRICE_TEXT:
        raise ValueError(f"must be a number of USD per million tokens, not {len(text)} characters")
    try:
        price = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a number of USD per million tokens (e.g. 2.5 or \"0.075\")") from None
    if not price.is_finite():
        raise ValueError(f"{value!r} is not a finite price")
    if price < 0:
        raise ValueError("must be >= 0")
    if price > MAX_USD_PER_MILLION:
        raise ValueError(f"must be <= {MAX_USD_PER_MILLION} (USD per million tokens)")
    return _nusd_per_million(price)


def usd_per_token_to_nusd_per_million(usd_per_token: float | int) -> int:
    """A source table's per-token USD price (a JSON float such as ``2.5e-06``) -> nano-USD per
    million tokens. The float is read at 15 significant digits, the precision a double keeps for
    any decimal, which takes away binary noise (``9.499999999999999e-07`` is 9.5e-07); what is
    finer than a nano-USD per million tokens is rounded up."""
    if isinstance(usd_per_token, bool) or not isinstance(usd_per_token, int | float):
        raise ValueError(f"{usd_per_token!r} is not a price")
    price = Decimal(format(usd_per_token, ".15g"))
    if not price.is_finite() or price < 0:
        raise ValueError(f"{usd_per_token!r} is not a price")
    return _nusd_per_million(price * TOKENS_PER_PRICE_UNIT)


def format_usd(nusd: int) -> str:
    """Nano-USD as a decimal USD string, exact (``1234567`` -> ``0.001234567``); for reports and docs."""
    sign = "-" if nusd < 0 else ""
    whole, fraction = divmod(abs(nusd), NANO_PER_USD)
    return f"{sign}{whole}.{fraction:09d}".rstrip("0").rstrip(".") if fraction else f"{sign}{whole}"
