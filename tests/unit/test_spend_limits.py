"""USD budgets, the pure parts (docs/limits.md, "USD budgets"; docs/pricing.md): calendar periods and their
ids in a time zone (DST changes and month ends included), what a request's attempts cost (cached and
reasoning tokens, clamping of impossible usage), the config's errors naming the field, and the words of
a budget."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import yaml

from gateway.config import ConfigError, PriceOverride, Pricing, parse_config
from gateway.identity.key_limits import KeyLimits, SpendLimit, counted_limits
from gateway.identity.limits import limits_problems, usd_text
from gateway.pricing.period import PeriodClock, period_span
from gateway.pricing.table import shipped_table
from gateway.quota.rules import rules_from_config
from gateway.spend.price_book import PriceBook
from workers.request_cost import attempts_cost, usage_cost


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(("period", "tz", "now", "ident", "start", "end"), [
    ("1d", None, "2026-12-01T23:59:59+00:00", "20261201", "2026-12-01T00:00:00Z", "2026-12-02T00:00:00Z"),
    ("1d", None, "2026-12-02T00:00:00+00:00", "20261202", "2026-12-02T00:00:00Z", "2026-12-03T00:00:00Z"),
    # ISO weeks from Monday; 2026-12-31 is a Thursday of week 53, and Jan 1 2027 belongs to it too.
    ("1w", None, "2026-12-03T12:00:00+00:00", "2026W49", "2026-11-30T00:00:00Z", "2026-12-07T00:00:00Z"),
    ("1w", None, "2027-01-01T12:00:00+00:00", "2026W53", "2026-12-28T00:00:00Z", "2027-01-04T00:00:00Z"),
    ("1mo", None, "2026-02-28T23:00:00+00:00", "202602", "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z"),
    ("1mo", None, "2026-12-31T23:59:59+00:00", "202612", "2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z"),
    # New York: 2026-03-08 springs forward (a 23-hour day), 2026-11-01 falls back (a 25-hour day).
    ("1d", "America/New_York", "2026-03-08T12:00:00-04:00", "20260308", "2026-03-08T05:00:00Z",
     "2026-03-09T04:00:00Z"),
    ("1d", "America/New_York", "2026-11-01T23:30:00-05:00", "20261101", "2026-11-01T04:00:00Z",
     "2026-11-02T05:00:00Z"),
    # Still the 30th of November in New York, already December in UTC: the month is New York's.
    ("1mo", "America/New_York", "2026-12-01T03:00:00+00:00", "202611", "2026-11-01T04:00:00Z",
     "2026-12-01T05:00:00Z"),
    ("1w", "America/New_York", "2026-03-09T01:00:00-04:00", "2026W11", "2026-03-09T04:00:00Z",
     "2026-03-16T04:00:00Z"),
])
def test_a_period_has_an_id_a_start_and_an_end_in_its_zone(period: Any, tz: str | None, now: str, ident: str,
                                                           start: str, end: str) -> None:
    span = period_span(period, tz, at(now))
    assert (span.id, iso(span.start), iso(span.end)) == (ident, start, end)


def test_a_day_across_a_dst_change_is_23_or_25_hours_long() -> None:
    spring = period_span("1d", "America/New_York", at("2026-03-08T12:00:00-04:00"))
    autumn = period_span("1d", "America/New_York", at("2026-11-01T12:00:00-05:00"))
    assert (spring.end - spring.start, autumn.end - autumn.start) == (23 * 3600, 25 * 3600)


def test_the_clock_recomputes_only_when_an_instant_leaves_its_period() -> None:
    clock = PeriodClock("1d", None)
    first = clock.at(at("2026-12-01T10:00:00+00:00"))
    assert clock.at(at("2026-12-01T23:59:59+00:00")) is first  # remembered: no zone arithmetic
    assert clock.at(at("2026-12-02T00:00:00+00:00")).id == "20261202"


# -- what a request costs ------------------------------------------------------------------------------

PRICES = PriceBook.from_config(Pricing(overrides={"m": PriceOverride(input=2.5, output=10, cached_input=1.25,
                                                                    reasoning=20)}), shipped_table())


def usage(**counts: Any) -> SimpleNamespace:
    fields = dict.fromkeys(("total_tokens", "prompt_tokens", "completion_tokens", "cached_tokens",
                            "cache_write_tokens", "reasoning_tokens"))
    return SimpleNamespace(**(fields | counts))


def test_cached_and_reasoning_tokens_are_priced_apart() -> None:
    # 8,000 x 2.50 + 2,000 x 1.25 + 600 x 10 + 400 x 20 = 36,500 USD per million tokens
    cost, clamped = usage_cost(PRICES, "m", usage(prompt_tokens=10_000, completion_tokens=1_000, cached_tokens=2_000,
                                                  reasoning_tokens=400, total_tokens=11_000), 10**9)
    assert (cost, clamped) == (36_500_000, False)


@pytest.mark.parametrize("bad", [usage(prompt_tokens=-5, completion_tokens=3),
                                 usage(prompt_tokens=1.5, completion_tokens=3),
                                 usage(prompt_tokens=10**9, completion_tokens=10**9)])
def test_impossible_or_absurd_usage_is_charged_the_reservation(bad: SimpleNamespace) -> None:
    assert usage_cost(PRICES, "m", bad, 1_000_000) == (1_000_000, True)


def test_absurd_usage_without_a_reservation_is_charged_what_it_says_but_never_below_zero() -> None:
    assert usage_cost(PRICES, "m", usage(prompt_tokens=-5, completion_tokens=3), 0) == (0, True)


def result(status: int = 200, **counts: Any) -> SimpleNamespace:
    return SimpleNamespace(status=status, usage=usage(**counts) if counts else None)


@pytest.mark.parametrize(("case", "served", "owed", "expected"), [
    (result(200, prompt_tokens=100, completion_tokens=10, total_tokens=110), True, 0, 350_000),  # 250 + 100 nano-USD x 1000
    (result(400), True, 0, 0),  # a provider 4xx without usage: it refused the work
    (result(200), True, 0, 1_000_000),  # served without usage (a cut stream): the worst case
    (result(502), True, 0, 1_000_000),
    (result(0), False, 0, 1_000_000),  # sent, no answer came
    (None, False, 40, 2_000_000),  # two failed attempts that cost the estimate (20 tokens) each
    (result(400), True, 20, 1_000_000),  # one failed attempt charged, then a 4xx without usage
])
def test_attempts_cost_as_tokens_do(case: Any, served: bool, owed: int, expected: int) -> None:
    assert attempts_cost(PRICES, "m", case, served, owed, 20, 1_000_000) == (expected, False)


def test_a_request_without_a_model_is_not_priced() -> None:
    assert attempts_cost(PRICES, None, result(200), True, 0, 20, 1_000_000) == (None, False)


def test_an_unmetered_request_without_usage_has_no_known_cost() -> None:
    assert attempts_cost(PRICES, "m", result(200), True, 0, 0, 0, metered=False) == (None, False)
    assert attempts_cost(PRICES, "m", result(400), True, 0, 0, 0, metered=False) == (0, False)
    assert attempts_cost(PRICES, "m", result(200, prompt_tokens=100, completion_tokens=10), True, 0, 0, 0,
                         metered=False) == (350_000, False)


# -- the config --------------------------------------------------------------------------------------

BASE = {"clusters": [{"name": "a", "endpoints": ["h:1"]}], "routing": {"overlay_file": "o.json"}}


def problems(document: dict[str, Any]) -> list[str]:
    try:
        parse_config(yaml.safe_dump({**BASE, **document}))
    except ConfigError as exc:
        return [str(problem) for problem in exc.problems]
    return []


@pytest.mark.parametrize(("spend", "problem"), [
    ({"usd": 5, "period": "2d"}, "quota.rules[0].spend[1].period: expected 1d, 1mo or 1w, got '2d'"),
    ({"usd": 0, "period": "1d"}, "quota.rules[0].spend[1].usd: must be > 0 and <= 1000000000"),
    ({"usd": -1, "period": "1d"}, "quota.rules[0].spend[1].usd: must be > 0 and <= 1000000000"),
    ({"usd": 5, "period": "1w", "tz": "Mars/Olympus"},
     "quota.rules[0].spend[1].tz: not a known time zone (an IANA name such as Europe/Paris)"),
    ({"eur": 5, "period": "1w"}, "quota.rules[0].spend[1].eur: unknown key"),
    ({"usd": 5, "period": "1w", "enforce": "strict"}, "quota.rules[0].spend[1].enforce: expected hard or soft, got 'strict'"),
    ({"usd": 5, "period": "1w", "alert_at": [0.5, 1.5]}, "quota.rules[0].spend[1].alert_at[1]: must be > 0 and <= 1"),
])
def test_a_bad_spend_limit_is_an_error_naming_its_field(spend: dict[str, Any], problem: str) -> None:
    rule = {"name": "team-a", "spend": [{"usd": 5, "period": "1d"}, spend]}
    found = problems({"quota": {"rules": [rule]}})
    assert found and found[0].startswith(problem), found


def test_a_rule_may_have_spend_limits_only_and_one_per_period() -> None:
    config = parse_config(yaml.safe_dump({**BASE, "quota": {"rules": [
        {"name": "team-a", "spend": [{"usd": 5.1, "period": "1d"}, {"usd": 100, "period": "1mo", "enforce": "soft",
                                                                  "tz": "Europe/Paris", "alert_at": [1.0, 0.5]}]}]}}))
    (rule,) = rules_from_config(config.quota)
    day, month = rule.spend
    assert (day.nusd, day.hard, day.alert_at, day.text) == (5_100_000_000, True, (500, 800, 1000), "$5.10/1d (UTC)")
    assert (month.hard, month.alert_at, month.text) == (False, (500, 1000), "$100.00/1mo (Europe/Paris)")
    twice = counted_limits([], [], None, [SpendLimit(usd=1, period="1d")] * 2)
    assert limits_problems(twice, "quota.rules[0]") == [
        "quota.rules[0].spend: two spend limits with the same period (one budget per period)"]


def test_a_managed_key_with_two_budgets_of_one_period_is_refused() -> None:
    with pytest.raises(ValueError, match="spend: two spend limits with the same period"):
        msgspec.convert({"spend": [{"usd": 1, "period": "1d"}, {"usd": 2, "period": "1d"}]}, KeyLimits)


def test_a_budget_in_words() -> None:
    assert [usd_text(n) for n in (5_000_000_000, 250_000_000, 125_000_000, 1)] == [
        "$5.00", "$0.25", "$0.125", "$0.000000001"]


def test_a_block_admits_worst_cases_that_fit_its_nano_usd_and_settles_the_real_costs() -> None:
    from gateway.quota.lease import Lease, SpendAllowance, next_spend
    from gateway.quota.ledger import Reservation

    lease = Lease(Reservation(b"z", b"p", b"m", 0), None, closes_at=100.0, spend=SpendAllowance(100, 900))
    assert lease.take(0, 1.0, 150) is None and not lease.closed  # larger than the block: to Valkey, block open
    assert lease.take(0, 1.0, 40) == () and lease.take(0, 1.0, 40) == ()
    assert lease.spend.remaining == 1000 - 80  # type: ignore[union-attr]
    assert lease.take(0, 1.0, 40) is None and lease.closed and lease.spend.filled  # type: ignore[union-attr]
    assert not lease.end(0, 0, True, 40, 7)  # charged its real cost: 7 of its 40
    assert lease.end(0, 0, False, 40, 0)  # never reached a provider: nothing; closed and idle: settle it
    assert lease.spend_charged == 7
    # It filled up with 2 requests: the next holds twice as many (at least 4) of its latest worst case.
    assert next_spend(lease, 40) == 4 * 40
    assert next_spend(None, 40) == 160  # a first block: room for 4 worst cases
