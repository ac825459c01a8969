from __future__ import annotations

import pytest

from gateway.quota.admission import duration_text, never_fits_message, window_text
from gateway.quota.breaker import Breaker
from gateway.quota.counters import TenantTokens
from gateway.quota.rules import Budget, QuotaRule, RuleSet, validate_rules
from gateway.request.estimate import (
    MAX_ALLOWANCE,
    completion_allowance,
    estimate_prompt_tokens,
    estimate_tokens,
)

MINUTE = (Budget(60, 1000),)


def rule(name: str, tenant: str | None = None, model: str | None = None, **kw: object) -> QuotaRule:
    return QuotaRule(name, kw.pop("budgets", MINUTE), kw.pop("default_max_tokens", 100), tenant, model, **kw)  # type: ignore[arg-type]


def test_first_matching_rule_wins() -> None:
    rules = RuleSet([rule("a-gpt", "team-a", "gpt"), rule("a", "team-a"), rule("default")])
    assert rules.match("team-a", "gpt").name == "a-gpt"
    assert rules.match("team-a", "llama").name == "a"
    assert rules.match("team-a", None).name == "a"
    assert rules.match("team-b", "gpt").name == "default"


def test_model_only_rule_applies_to_every_tenant() -> None:
    rules = RuleSet([rule("big-model", model="huge"), rule("default")])
    assert rules.match("anyone", "huge").name == "big-model"
    assert rules.match("anyone", "small").name == "default"


def test_without_a_default_unmatched_requests_are_unmetered() -> None:
    rules = RuleSet([rule("a", "team-a")])
    assert rules.match("team-b", "m") is None
    assert rules.match("team-b", "m") is None  # memoised miss stays a miss


def test_rules_for_tenant_lists_what_can_apply() -> None:
    rules = RuleSet([rule("a-gpt", "team-a", "gpt"), rule("b", "team-b"), rule("default")])
    assert [r.name for r in rules.rules_for_tenant("team-a")] == ["a-gpt", "default"]


def test_default_rule_must_be_last() -> None:
    problems = validate_rules([rule("default"), rule("a", "team-a")])
    assert any("quota.rules[0].match" in p for p in problems)
    with pytest.raises(ValueError):
        RuleSet([rule("default"), rule("a", "team-a")])


@pytest.mark.parametrize("count", [0, 9])
def test_a_rule_has_one_to_eight_budgets(count: int) -> None:
    budgets = tuple(Budget(60 * (i + 1), 10) for i in range(count))
    assert any("budgets" in p for p in validate_rules([rule("a", budgets=budgets)]))


def test_eight_budgets_are_fine() -> None:
    budgets = tuple(Budget(60 * (i + 1), 10) for i in range(8))
    assert validate_rules([rule("a", budgets=budgets)]) == []


def test_invalid_budgets_and_duplicate_names_are_named() -> None:
    problems = validate_rules(
        [rule("a", budgets=(Budget(0, 10), Budget(60, 0))), rule("a", budgets=(Budget(60, 1), Budget(60, 2)))]
    )
    assert any("budgets[0].window" in p for p in problems)
    assert any("budgets[1].tokens" in p for p in problems)
    assert any("duplicate rule name" in p for p in problems)
    assert any("same window" in p for p in problems)


def test_prompt_estimate_is_body_bytes_over_four_rounded_up() -> None:
    assert estimate_prompt_tokens(0) == 0
    assert estimate_prompt_tokens(1) == 1
    assert estimate_prompt_tokens(4) == 1
    assert estimate_prompt_tokens(4001) == 1001


def test_estimate_takes_the_largest_allowance_the_body_names_else_the_default() -> None:
    assert estimate_tokens(400, 50, 70, 1024) == 170
    assert estimate_tokens(400, 70, 50, 1024) == 170
    assert estimate_tokens(400, None, 70, 1024) == 170
    assert estimate_tokens(400, None, None, 1024) == 1124
    assert estimate_tokens(400, 0, None, 1024) == 100  # zero is a count, not an absence
    assert estimate_tokens(400, 0, 70, 1024) == 170


def test_a_small_max_tokens_beside_a_large_allowance_reserves_the_large_one() -> None:
    # Providers obey the field they know: {"max_tokens": 1, "max_completion_tokens": 20000} may
    # generate 20,000 tokens (issue 27, finding 4: 40 such requests used 16x a 50,000 budget).
    assert completion_allowance(1, 20000) == 20000
    assert completion_allowance(1, None, 30000) == 30000  # the Responses API's max_output_tokens
    assert completion_allowance(40000, 20000, 30000) == 40000
    assert completion_allowance(None, None, None) is None
    assert estimate_tokens(0, 1, 20000, 1024) == 20000
    assert estimate_tokens(0, None, None, 1024, max_output_tokens=5) == 5


def test_an_allowance_beyond_the_ledger_s_integers_is_capped_not_wrapped() -> None:
    assert completion_allowance(10**26, None) == MAX_ALLOWANCE
    assert completion_allowance(-(10**26), 7) == 7


@pytest.mark.parametrize("bad", [-5, True, 3.5, "10"])
def test_estimate_ignores_allowances_that_are_not_counts(bad: object) -> None:
    assert estimate_tokens(0, bad, None, 7) == 7  # type: ignore[arg-type]
    assert estimate_tokens(0, None, bad, 7) == 7  # type: ignore[arg-type]
    assert estimate_tokens(0, 3, bad, 7, bad) == 3  # type: ignore[arg-type]


def test_breaker_opens_after_consecutive_failures_and_closes_on_the_first_answer() -> None:
    breaker = Breaker(failures_to_open=3)
    assert not breaker.failure() and not breaker.failure()
    assert not breaker.success()  # a success in between resets the count (and closed nothing)
    assert [breaker.failure() for _ in range(4)] == [False, False, True, False]  # opens once
    assert breaker.is_open
    assert breaker.success() and not breaker.is_open  # the first answer closes it: no cool-down
    assert not breaker.success()


def test_breaker_trips_at_once_and_needs_a_full_count_again_after_closing() -> None:
    breaker = Breaker(failures_to_open=2)
    assert breaker.trip() and breaker.is_open and not breaker.trip()
    assert breaker.success()
    assert not breaker.failure() and breaker.failure()


def test_never_fits_message_names_the_limit_and_the_request() -> None:
    rule = QuotaRule("team-a", (Budget(60, 1000), Budget(86400, 50_000)), 10)
    message = never_fits_message(rule, 5000, 1000)
    assert "'team-a'" in message and "5000 tokens" in message and "1000 tokens per 1m" in message
    assert "never be admitted" in message
    assert [window_text(s) for s in (1, 90, 60, 7200, 86400)] == ["1s", "90s", "1m", "2h", "1d"]


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, b"0ms"), (250, b"250ms"), (1000, b"1s"), (17500, b"17.5s"), (60000, b"1m0s"), (3723000, b"1h2m3s")],
)
def test_reset_header_uses_openai_duration_form(ms: int, text: bytes) -> None:
    assert duration_text(ms) == text


def test_tenant_tokens_are_bounded_to_the_configured_tenants() -> None:
    tokens = TenantTokens(["team-a", "team-b", "team-a", "other"])
    assert tokens.names == ["team-a", "team-b", "other"]
    tokens.add(tokens.slot("team-a"), 10, 5, 15)
    tokens.add(tokens.slot("team-a"), None, 7, 10)  # prompt derived from the total
    tokens.add(tokens.slot("stranger"), 3, None, 4)  # completion derived; an unknown tenant is "other"
    tokens.add(tokens.slot("team-b"), None, None, 99)  # a total alone cannot be split: not counted
    assert tokens.snapshot() == {"team-a": (13, 12), "team-b": (0, 0), "other": (3, 1)}
    assert tokens.learned == {}


def test_a_managed_keys_tenant_gets_a_slot_of_its_own_with_the_supervisors_index_up_to_a_bound() -> None:
    from gateway.quota.counters import MAX_LEARNED

    tokens = TenantTokens(["team-a"])
    other = tokens.slot("stranger")
    new = tokens.slot("team-m", 7)  # a managed key's tenant: the index its table entry carried
    assert new != other and tokens.slot("team-m") == new  # learned once, found by name after
    assert tokens.slot("team-a", 9) == 0  # a configured tenant keeps its own slot
    tokens.add(new, 4, 2, 6)
    assert tokens.snapshot()["team-m"] == (4, 2) and tokens.learned == {"team-m": 7}
    for n in range(MAX_LEARNED):
        tokens.slot(f"team-{n}", 10 + n)
    assert len(tokens.learned) == MAX_LEARNED
    assert tokens.slot("one-too-many", 500) == other  # past the bound: under "other"


def test_model_and_key_matches_are_globs_and_a_key_glob_reads_kid_or_alias() -> None:
    from gateway.identity.auth import KeyIdentity

    rules = RuleSet([
        QuotaRule("bots", MINUTE, 100, match_key="ci-*"),
        QuotaRule("gpt", MINUTE, 100, match_model="gpt-4*"),
        QuotaRule("default", MINUTE, 100),
    ])
    bot, managed, human = KeyIdentity("a", "ci-nightly"), KeyIdentity("a", None, "ci-Xy12"), KeyIdentity("a", "bob")
    assert rules.match("a", "gpt-4o", bot).name == "bots"
    assert rules.match("a", "gpt-4o", managed).name == "bots"  # the kid matches too
    assert rules.match("a", "gpt-4o", human).name == "gpt"
    assert rules.match("a", "gpt-3.5", human).name == "default"
    assert rules.match("a", "gpt-4o", None).name == "gpt"  # no key (auth off): key rules never match
    assert rules.match("a", None, human).name == "default"  # no model named: a model glob never matches


def test_a_model_glob_matching_no_model_of_an_overlay_is_named() -> None:
    from gateway.quota.rules import model_glob_problems

    rules = [QuotaRule("a", MINUTE, 1, match_model="gpt-*"), QuotaRule("b", MINUTE, 1, match_model="llama-[0-9]*"),
             QuotaRule("c", MINUTE, 1)]
    assert model_glob_problems(rules, ["gpt-4o", "mistral"]) == [
        "quota.rules[1].match.model: 'llama-[0-9]*' matches no model of the overlay"]


def test_rules_with_request_limits_alone_are_valid_and_their_limits_are_checked() -> None:
    from gateway.quota.rules import RequestLimit

    assert validate_rules([rule("r", budgets=(), requests=(RequestLimit(60, 10, 10),))]) == []
    problems = validate_rules([rule("r", budgets=(), requests=(RequestLimit(0, 0, 0), RequestLimit(0, 5, 5)))])
    assert "quota.rules[0].requests: two request limits with the same window" in problems
    assert "quota.rules[0].requests[0].window: must be 1s..1d" in problems
    assert "quota.rules[0].requests[0].count: must be at least 1" in problems
    assert "quota.rules[0].requests[0].burst: must be at least 1" in problems
    assert validate_rules([rule("r", budgets=())]) == ["quota.rules[0].budgets: a rule needs budgets, requests, spend or "
                                                        "max_in_flight"]
