from __future__ import annotations

import pytest

from gateway.quota.estimate import estimate_prompt_tokens, estimate_tokens
from gateway.quota.gate import Breaker, duration_text
from gateway.quota.rules import Budget, QuotaRule, RuleSet, validate_rules

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


def test_estimate_uses_max_tokens_then_max_completion_tokens_then_default() -> None:
    assert estimate_tokens(400, 50, 70, 1024) == 150
    assert estimate_tokens(400, None, 70, 1024) == 170
    assert estimate_tokens(400, None, None, 1024) == 1124
    assert estimate_tokens(400, 0, 70, 1024) == 100


@pytest.mark.parametrize("bad", [-5, True, 3.5, "10"])
def test_estimate_ignores_allowances_that_are_not_counts(bad: object) -> None:
    assert estimate_tokens(0, bad, None, 7) == 7  # type: ignore[arg-type]


def test_breaker_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    breaker = Breaker(failures_to_open=3, cooldown_s=2.0)
    for now in (0.0, 0.1):
        assert breaker.allow(now)
        breaker.failure(now)
    assert breaker.allow(0.2)
    breaker.success()  # a success in between resets the count
    for now in (1.0, 1.1, 1.2):
        breaker.failure(now)
    assert breaker.is_open
    assert not breaker.allow(1.3)
    assert breaker.retry_after_s(1.3) == 2
    assert breaker.allow(3.3)  # the probe
    assert not breaker.allow(3.3)  # only one probe at a time
    breaker.failure(3.4)  # probe failed: another cool-down
    assert not breaker.allow(5.0)
    assert breaker.allow(5.5)
    breaker.success()
    assert not breaker.is_open and breaker.allow(5.6) and breaker.allow(5.6)


def test_a_cancelled_probe_frees_the_probe_slot() -> None:
    breaker = Breaker(failures_to_open=1, cooldown_s=1.0)
    breaker.failure(0.0)
    assert breaker.allow(1.5)
    breaker.abandoned()  # the probing request was cancelled before the backend answered
    assert breaker.allow(1.6) and breaker.is_open


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, b"0ms"), (250, b"250ms"), (1000, b"1s"), (17500, b"17.5s"), (60000, b"1m0s"), (3723000, b"1h2m3s")],
)
def test_reset_header_uses_openai_duration_form(ms: int, text: bytes) -> None:
    assert duration_text(ms) == text
