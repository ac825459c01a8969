"""What a request cost in nano-USD, from the usage its provider reported (docs/pricing.md, "What a request
costs"; docs/configuration.md, "What a request is charged"). Pure: ``Outcomes.close`` calls it once per
request that reached a provider.

Attempts cost by the rules tokens follow: the usage a provider reported, priced as the model that served
(``RequestRecord.served``); without usage, a provider 4xx costs nothing and anything else that may have
worked (a 5xx, a timeout, a cut stream) the worst case the admission reserved. A usage that cannot be a
provider's count (not an integer, negative) or that costs over ``ABSURD_FACTOR`` times the worst case
reserved is charged that worst case instead, and counted: never a crash, never a refund below zero.
"""

from __future__ import annotations

from typing import Any

from gateway.request.usage import SseUsageFilter, UsageScanner
from gateway.spend.price_book import PriceBook

ABSURD_FACTOR = 10
# The usage observers whose counts are each None or a plain int >= 0 by construction, so pricing them
# needs no check (``PriceBook.usage_cost(..., checked=True)``): ``UsageScanner`` sets them only from
# msgspec-decoded ``int >= 0`` fields or from the ASCII digits of ``\d+``, ``SseUsageFilter`` only from
# values ``_is_count`` accepted or from its scanner's (tests/unit/test_outcomes_fast.py feeds them
# anything). The others (gateway/request/usage_surfaces.py: counts summed from several fields) are checked.
CHECKED_OBSERVERS = (UsageScanner, SseUsageFilter)


def usage_cost(prices: PriceBook, model: str, usage: Any, worst: int) -> tuple[int, bool]:
    """(nano-USD, clamped) of one reported usage; ``worst``: what the admission reserved (0: nothing,
    then only an impossible count is clamped, to 0)."""
    cost = prices.usage_cost(model, usage)
    if cost is None or (worst and cost > ABSURD_FACTOR * worst):
        return worst, True
    return cost, False


def attempts_cost(prices: PriceBook, model: str | None, result: Any, served: bool, owed_tokens: int,
                  estimate: int, worst: int, metered: bool = True) -> tuple[int | None, bool]:
    """(nano-USD, clamped) of every attempt of a request that reached a provider. ``result``: the last
    attempt's ``AttemptResult`` (None: every attempt ended without one); ``owed_tokens``: the tokens the
    attempts that did not serve cost (each nothing or the estimate), so as many of them cost the worst
    case. None when there is no model to price, or when a request no quota metered (so nothing was
    reserved, and its stream was not asked for usage) ended without usage: its cost is not known.

    Runs once per request that reached a provider, so ``usage_cost`` is written out in it."""
    if model is None:
        return None, False
    cost = owed_tokens // estimate * worst if owed_tokens and estimate > 0 else 0
    if result is None:
        return cost, False
    if served:
        usage = result.usage
        if usage is not None and (usage.total_tokens is not None or usage.prompt_tokens is not None
                                  or usage.completion_tokens is not None):
            extra = prices.usage_cost(model, usage)
            if extra is None or (worst and extra > ABSURD_FACTOR * worst):
                return cost + worst, True
            return cost + extra, False
        if 400 <= result.status < 500:
            return cost, False
    # No usage: a 5xx, a cut stream, or sent and no answer came (the provider may be working on it).
    return (cost + worst, False) if metered else (None, False)
