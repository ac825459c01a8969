"""Which price a model gets: overrides from the config, the table, the unpriced policy."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, Pricing, parse_config
from gateway.pricing.table import parse_table, shipped_table
from gateway.pricing.units import parse_usd_per_million
from gateway.spend.price_book import MAX_MODEL_NAME, MEMO_SIZE, PriceBook, override_warnings

BASE = """
clusters: [{name: a, endpoints: ["127.0.0.1:1"]}]
routing: {overlay_file: overlay.json}
"""

TABLE = parse_table(b"""{"format": 1, "source": "s", "source_version": "v", "source_sha256": "h", "license": "MIT",
  "unit": "nano-USD per million tokens",
  "columns": ["from_prompt_tokens", "input", "output", "cached_input", "cache_write", "reasoning"],
  "models": {
    "gpt-4o": [[0,2500000000,10000000000,1250000000,2500000000,10000000000]],
    "gpt-4o-mini": [[0,150000000,600000000,75000000,150000000,600000000]],
    "ft:gpt-4o-mini-2024-07-18": [[0,300000000,1200000000,150000000,300000000,1200000000]],
    "azure/gpt-4o": [[0,2750000000,11000000000,1375000000,2750000000,11000000000]]
  }}""")


def pricing(yaml: str) -> Pricing:
    return parse_config(BASE + yaml).pricing


def book(yaml: str = "", table=TABLE) -> PriceBook:
    return PriceBook.from_config(pricing(yaml), table)


def per_million(usd: str) -> int:
    return parse_usd_per_million(usd)


def test_table_models_are_priced_by_their_exact_name_then_without_the_provider_prefix() -> None:
    prices = book()
    assert prices.price("gpt-4o").base.input == per_million("2.5")
    assert prices.price("azure/gpt-4o").base.input == per_million("2.75")  # its own entry wins
    openai = prices.price("openai/gpt-4o")
    assert openai is not None and openai.name == "gpt-4o" and openai.source == "table"
    assert prices.price("gpt-4o-2099-01-01") is None  # no estimate under the default policy


def test_overrides_win_over_the_table_first_glob_first_and_may_be_free() -> None:
    prices = book("""
pricing:
  overrides:
    "gpt-4o-mini": {input: 0, output: 0}
    "gpt-4o*": {input: "1.5", output: 6, cached_input: 0.5, reasoning: 12}
    "llama-local-*": {input: 0.1, output: 0.2, cache_write: 0.3}
""")
    free = prices.price("gpt-4o-mini")
    assert free is not None and free.source == "override" and free.name == "gpt-4o-mini"
    assert prices.cost("gpt-4o-mini", 10**6, 10**6) == 0
    negotiated = prices.price("gpt-4o")
    assert negotiated is not None and negotiated.name == "gpt-4o*"
    assert (negotiated.base.input, negotiated.base.output, negotiated.base.cached_input, negotiated.base.cache_write,
            negotiated.base.reasoning) == (per_million("1.5"), per_million("6"), per_million("0.5"),
                                           per_million("1.5"), per_million("12"))
    private = prices.price("llama-local-70b")
    assert private is not None
    # not given: the cached-input price is the input price, the reasoning price the output price
    assert (private.base.cached_input, private.base.cache_write, private.base.reasoning) == (
        per_million("0.1"), per_million("0.3"), per_million("0.2"))
    assert prices.cost("llama-local-70b", 1_000_000, 1_000_000, cached_tokens=500_000) == 300_000_000  # $0.30
    assert prices.price("openai/gpt-4o").source == "table"  # globs match the whole name


def test_the_cost_is_of_the_model_that_served_and_counts_what_had_no_price() -> None:
    prices = book()
    assert prices.cost("gpt-4o", 10_000, 1_000, cached_tokens=2_000) == 32_500_000
    assert prices.cost("gpt-4o-mini", 10_000, 1_000, cached_tokens=2_000) == 1_950_000
    assert prices.cost("my-private-model", 10_000, 1_000) == 0
    assert prices.cost("my-private-model", 10_000, 1_000) == 0
    assert prices.counts.zero == 2 and prices.counts.estimated == 0 and prices.counts.rejected == 0
    assert prices.admits("my-private-model")  # zero: it may run


def test_usage_as_an_observer_reports_it_passes_as_it_is() -> None:
    prices = book()
    # counts a provider did not report are None: none of them
    assert prices.cost("gpt-4o", 10_000, 1_000, cached_tokens=None, reasoning_tokens=None) == 35_000_000
    assert prices.cost("gpt-4o", None, 1_000, None, None, None) == 10_000_000
    # only a total: every token at the dearest price of the model, never less than it could have cost
    assert prices.cost("gpt-4o", None, None, total_tokens=1_000) == 10_000_000
    assert prices.cost("gpt-4o", None, None, None, None, None, None) == 0


def test_reject_refuses_unpriced_models_only() -> None:
    prices = book("pricing: {unpriced: reject}")
    assert prices.admits("gpt-4o") and prices.admits("openai/gpt-4o")
    assert not prices.admits("my-private-model")
    assert prices.counts.rejected == 1
    assert prices.worst_case_cost("my-private-model", 1000, 1000) == 0
    assert prices.counts.rejected == 1  # a worst case counts nothing


def test_estimate_prices_a_model_as_its_nearest_relative() -> None:
    prices = book("pricing: {unpriced: estimate}")
    dated = prices.price("gpt-4o-mini-2099-01-01")
    assert dated is not None and dated.name == "gpt-4o-mini" and dated.source == "estimate"
    assert prices.price("gpt-4o-2099-01-01").name == "gpt-4o"
    assert prices.price("ft:gpt-4o-mini-2024-07-18:acme::x1").name == "ft:gpt-4o-mini-2024-07-18"
    assert prices.price("openai/gpt-4o.preview").name == "gpt-4o"
    assert prices.price("gpt-4") is None  # a prefix of a known name is no relative
    assert prices.price("gpt-4omni") is None  # nor a name that only starts alike
    assert prices.cost("gpt-4o-2099-01-01", 1_000_000, 0) == 2_500_000_000
    assert prices.cost("something-else", 1_000_000, 0) == 0
    assert (prices.counts.estimated, prices.counts.zero) == (1, 1)
    assert prices.admits("something-else")


def test_worst_case_uses_the_same_price_as_the_cost() -> None:
    prices = book('pricing: {overrides: {"m-*": {input: 1, output: 2, cache_write: 3, reasoning: 4}}}')
    assert prices.worst_case_cost("m-1", 1_000_000, 1_000_000) == per_million("3") + per_million("4")
    assert prices.worst_case_cost("gpt-4o", 1_000_000, 0) == per_million("2.5")


def test_lookups_are_memoised_and_the_memo_stays_bounded() -> None:
    prices = book()
    first = prices.price("gpt-4o")
    assert prices.price("gpt-4o") is first
    for index in range(MEMO_SIZE * 2 + 10):
        prices.price(f"client-made-name-{index}")
    assert len(prices._memo) <= MEMO_SIZE
    long_name = "x" * (MAX_MODEL_NAME + 1)
    assert prices.price(long_name) is None and long_name not in prices._memo


def test_a_very_long_name_is_not_estimated() -> None:
    prices = book("pricing: {unpriced: estimate}")
    assert prices.price("gpt-4o-" + "x" * MAX_MODEL_NAME) is None
    assert prices.price("gpt-4o-" + "x" * 10) is not None


def test_the_shipped_table_serves_a_book() -> None:
    prices = PriceBook.from_config(Pricing(), shipped_table())
    assert prices.cost("gpt-4o", 10_000, 1_000, cached_tokens=2_000) == 32_500_000


def test_globs_that_match_nothing_known_are_warned_about_not_refused() -> None:
    config = pricing("""
pricing:
  overrides:
    "gpt-4o*": {input: 1, output: 1}
    "llama-local-*": {input: 0, output: 0}
    "gtp-4o": {input: 1, output: 1}
""")
    overlay_models = ["llama-local-70b"]
    assert override_warnings(config.overrides, [*TABLE.models, *overlay_models]) == [
        'pricing.overrides["gtp-4o"]: matches no model of the price table or the overlay']
    assert len(override_warnings(config.overrides, TABLE.models)) == 2


def test_the_supervisor_warns_at_start_and_reload_of_a_glob_no_model_of_the_table_or_overlay_has(caplog) -> None:
    from gateway.check import validate_deployment
    from gateway.supervisor.spend import warn_unmatched_overrides

    config = parse_config("""
clusters: [{name: a, endpoints: ["127.0.0.1:1"]}]
routing:
  candidates:
    - {kind: inference_model, name: llama-local-70b, site: s, cluster: a, admission_state: new_and_existing,
       stable_id: a-llama}
pricing:
  overrides:
    "gpt-4o*": {input: 1, output: 1}
    "llama-local-*": {input: 0, output: 0}
    "gtp-4o": {input: 1, output: 1}
""")
    overlay = validate_deployment(config)  # what the supervisor checks at start and on a reload, then warns
    with caplog.at_level("WARNING", logger="gridgate.supervisor"):
        assert warn_unmatched_overrides(config, overlay) == [
            'pricing.overrides["gtp-4o"]: matches no model of the price table or the overlay']
    assert [r.getMessage() for r in caplog.records] == [
        'pricing.overrides["gtp-4o"]: matches no model of the price table or the overlay']
    assert len(warn_unmatched_overrides(config, None)) == 2  # no overlay: the table's models alone
    assert warn_unmatched_overrides(parse_config(BASE), None) == []


@pytest.mark.parametrize(("yaml", "problem"), [
    ('pricing: {overrides: {"gpt-*": {input: -1, output: 1}}}', 'pricing.overrides["gpt-*"].input: must be >= 0'),
    ('pricing: {overrides: {"gpt-*": {input: 1, output: "-0.1"}}}', 'pricing.overrides["gpt-*"].output: must be >= 0'),
    ('pricing: {overrides: {"a": {input: 1, output: 1}, "b*": {input: 1, output: 1, cached_input: -2}}}',
     'pricing.overrides["b*"].cached_input: must be >= 0'),
    ('pricing: {overrides: {"gpt-*": {input: 1, output: 1, cache_read: 1}}}',
     'pricing.overrides["gpt-*"].cache_read: unknown key'),
    ('pricing: {overrides: {"gpt-*": {input: 1}}}', 'pricing.overrides["gpt-*"].output: required key is missing'),
    ('pricing: {overrides: {"gpt-*": {input: "two", output: 1}}}',
     """pricing.overrides["gpt-*"].input: 'two' is not a number of USD per million tokens"""),
    ('pricing: {overrides: {"gpt-*": {input: true, output: 1}}}',
     'pricing.overrides["gpt-*"].input: expected a string, an integer or a number, got true'),
    ('pricing: {overrides: {"gpt-*": {input: 1, output: 1, reasoning: 20000}}}',
     'pricing.overrides["gpt-*"].reasoning: must be <= 10000'),
    ('pricing: {overrides: {"": {input: 1, output: 1}}}', "pricing.overrides: a model glob must not be empty"),
    ("pricing: {unpriced: free}", "pricing.unpriced: expected estimate, reject or zero, got 'free'"),
    ("pricing: {currency: EUR}", "pricing.currency: unknown key"),
])
def test_bad_pricing_config_is_an_error_naming_the_field(yaml: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(BASE + yaml)
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith(problem), caught.value.problems


def test_pricing_defaults_to_zero_for_unpriced_and_no_overrides() -> None:
    config = parse_config(BASE)
    assert config.pricing.unpriced == "zero" and config.pricing.overrides == {}
