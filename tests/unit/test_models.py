"""The ``models`` block (docs/models.md): config errors naming the field, the model table, the body
rewrite, and the sans-IO fallback decisions."""

from __future__ import annotations

import json
import random

import pytest

from gateway.check import model_problems
from gateway.config import ConfigError, Retry, parse_config
from gateway.http.errors import ErrorReply
from gateway.models.aliases import fallback_edges, model_routes, retarget_body, visible_aliases
from gateway.models.fallbacks import failure_reason, provider_reason, refusal_reason
from gateway.overlay.watch import load_inline_overlay
from gateway.routing.failover import Failover

BASE = """
clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]
routing:
  candidates:
    - {kind: inference_model, name: big, site: s, cluster: a, admission_state: new_and_existing, stable_id: a-big}
    - {kind: inference_model, name: small, site: s, cluster: a, admission_state: new_and_existing, stable_id: a-small}
"""


def problems(models_yaml: str) -> list[str]:
    try:
        parse_config(BASE + models_yaml)
    except ConfigError as error:
        return error.problems
    return []


@pytest.mark.parametrize(("block", "expected"), [
    ("models: {aliases: {fast: small, quick: fast}}",
     'models.aliases["quick"]: \'fast\' is an alias too'),
    ("models: {aliases: {fast: fast}}", 'models.aliases["fast"]: an alias cannot name itself'),
    ("models: {fallbacks: {big: {chain: [small, big]}}}",
     'models.fallbacks["big"].chain[1]: \'big\' makes a cycle: the chain names its own model'),
    ("models: {fallbacks: {big: {chain: [small, small]}}}",
     'models.fallbacks["big"].chain[1]: \'small\' makes a cycle: the chain names a model twice'),
    ("models: {aliases: {fast: small}, fallbacks: {big: {chain: [small, fast]}}}",
     'models.fallbacks["big"].chain[1]: \'fast\' makes a cycle'),
    ("models: {fallbacks: {big: {chain: [small], on: [rate_limited, overloaded]}}}",
     'models.fallbacks["big"].on[1]: unknown reason \'overloaded\''),
    ("models: {fallbacks: {big: {chain: [small], max_hops: 0}}}", 'models.fallbacks["big"].max_hops: must be >= 1'),
    ("models: {fallbacks: {big: {chain: [small], max_hops: 17}}}", 'models.fallbacks["big"].max_hops: must be <= 16'),
    ("models: {fallbacks: {big: {chain: []}}}", 'models.fallbacks["big"].chain: list at least one model'),
    ("models: {fallbacks: {big: {chain: [small], colour: red}}}", 'models.fallbacks["big"].colour: unknown key'),
])
def test_a_bad_models_block_is_an_error_naming_the_field(block, expected):
    found = problems(block)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_the_yaml_key_on_is_read_as_the_reasons_not_as_true():
    config = parse_config(BASE + "models:\n  fallbacks:\n    big:\n      chain: [small]\n      on: [rate_limited]\n")
    assert config.models.fallbacks["big"].on == ["rate_limited"]
    assert parse_config(BASE + "models: {fallbacks: {big: {chain: [small]}}}").models.fallbacks["big"].on == [
        "rate_limited", "unavailable", "timeout", "first_byte_timeout", "context_length_exceeded", "content_filter"]


def check_lines(models_yaml: str) -> list[str]:
    config = parse_config(BASE + models_yaml)
    snapshot = load_inline_overlay(config.routing.candidates or [], config.routing.expected_overlay_scope)
    return model_problems(config, snapshot)


def test_check_judges_the_block_against_the_overlay():
    assert check_lines("models: {aliases: {fast: small}, fallbacks: {big: {chain: [fast]}}}") == []
    assert check_lines("models: {fallbacks: {big: {chain: [small, medium]}}}") == [
        'models.fallbacks["big"].chain[1]: unknown model \'medium\' (neither a model the overlay serves nor an alias)']
    assert check_lines("models: {aliases: {small: big}}") == [
        'models.aliases["small"]: shadows the model \'small\' the overlay serves; rename the alias']
    assert check_lines("models: {aliases: {fast: tiny}}") == [
        'models.aliases["fast"]: target \'tiny\' is not a model the overlay serves']
    assert check_lines("models: {fallbacks: {medium: {chain: [small]}}}") == [
        'models.fallbacks["medium"]: \'medium\' is neither a model the overlay serves nor an alias']


def test_the_model_table_holds_only_aliases_and_chain_heads():
    config = parse_config(BASE + """
models:
  aliases: {fast: small, default: {target: big, hidden: true}}
  fallbacks: {big: {chain: [fast], max_hops: 1, on: [rate_limited]}}
""")
    routes = model_routes(config.models)
    assert set(routes) == {"fast", "default", "big"}  # "small" pays one dict miss, nothing else
    assert routes["fast"].target == "small" and routes["fast"].alias and routes["fast"].hops == 0
    # An alias without its own chain walks its target's; chain entries are resolved to their targets.
    assert routes["default"][1:] == ("big", True, ("small",), frozenset({"rate_limited"}), 1, None)
    assert routes["big"][1:] == ("big", False, ("small",), frozenset({"rate_limited"}), 1, None)
    assert visible_aliases(config.models) == (("fast", "small"),)
    assert fallback_edges(config.models) == ["big\x00small"]


def test_retarget_body_rewrites_only_the_model():
    body = b'{"model": "fast", "messages": [{"role": "user", "content": "model"}], "stream": true}'
    rewritten = retarget_body(body, "small")
    assert json.loads(rewritten) == {**json.loads(body), "model": "small"}
    assert retarget_body(rewritten, "small") is None  # already names it
    assert retarget_body(b'{"messages": []}', "small") is None  # no model member: nothing to rewrite
    assert retarget_body(b"not json", "small") is None
    assert retarget_body(b"", "small") is None


def reply(code: str, message: str = "") -> ErrorReply:
    return ErrorReply(503, code, message)


def test_failure_reasons_need_every_provider_to_fail_for_a_listed_reason():
    on = frozenset({"rate_limited", "unavailable"})
    assert failure_reason(["rate_limited", "unavailable"], on) == "unavailable"
    assert failure_reason(["rate_limited", "timeout"], on) is None
    assert failure_reason(["rate_limited", None], on) is None
    assert provider_reason(reply("upstream_rate_limited"), False) == "rate_limited"
    assert provider_reason(reply("upstream_busy"), False) == "unavailable"
    assert provider_reason(reply("upstream_timeout", "b: no response before the deadline"), True) == "first_byte_timeout"
    assert provider_reason(reply("upstream_timeout", "b: no response before the deadline"), False) == "timeout"
    assert provider_reason(reply("upstream_timeout", "b: answered 504"), True) == "timeout"
    assert provider_reason(reply("model_not_allowed"), True) is None
    all_reasons = frozenset({"context_length_exceeded", "unavailable"})
    assert refusal_reason(ErrorReply(400, "context_length_exceeded", ""), all_reasons) == "context_length_exceeded"
    assert refusal_reason(ErrorReply(400, "context_length_exceeded", ""), on) is None
    assert refusal_reason(ErrorReply(422, "no_eligible_provider", ""), all_reasons) is None


def test_a_chain_shares_one_attempt_budget_and_deadline():
    failover = Failover(Retry(attempts=3), deadline=100.0, rng=random.Random(1))
    failover.failed(0, reply("upstream_unavailable"))
    failover.failed(1, reply("upstream_unavailable"))
    failover.next_model()
    assert failover.tried == [] and failover.replies == [] and failover.attempts == 2
    assert failover.may_try_another(1.0)
    failover.failed(0, reply("upstream_unavailable"))  # the same provider, for the next model
    assert not failover.may_try_another(1.0)  # three attempts, all models together
    assert not Failover(Retry(attempts=3), deadline=100.0, rng=random.Random(1)).may_try_another(100.0)
