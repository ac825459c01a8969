"""workers/model_access.py: the one decision of whether a request's tenant and key may use a model."""

from __future__ import annotations

import json

import msgspec

from gateway.config import TenantPolicy
from gateway.keys.view import KeyEntry, decode_entry
from gateway.routing.tenants import OPEN, Policy
from workers.model_access import may_use, model_refusal


def key_entry(models: list[str] | None) -> KeyEntry:
    # The table's blob of a record (array-like), as the supervisor writes it: decoded, as the worker does.
    blob = msgspec.msgpack.encode(["AbCdEfGhIjKl", "team-a", "ci", "active", models, {}, None, None])
    return decode_entry(blob, slot=0)


def test_a_key_without_models_leaves_the_decision_to_its_tenant() -> None:
    assert may_use(OPEN, key_entry(None), "anything") and may_use(OPEN, None, "anything")
    assert model_refusal("team-a", OPEN, key_entry(None), "anything") is None


def test_the_key_globs_narrow_case_sensitively_and_an_empty_list_allows_nothing() -> None:
    scoped = key_entry(["gpt-4*", "claude-3-haiku"])
    assert may_use(OPEN, scoped, "gpt-4o") and may_use(OPEN, scoped, "claude-3-haiku")
    assert not may_use(OPEN, scoped, "claude-3-haiku-x")
    assert not may_use(OPEN, scoped, "GPT-4o")  # case-sensitive, as capabilities are
    assert not may_use(OPEN, key_entry([]), "gpt-4o")
    refused = model_refusal("team-a", OPEN, scoped, "claude-3-opus")
    assert refused is not None and (refused.status, refused.code) == (403, "model_not_allowed")
    assert refused.message == "API key AbCdEfGhIjKl may not use model 'claude-3-opus'"
    assert json.loads(refused.body())["error"]["type"] == "permission_error"


def test_the_tenant_policy_refuses_first_and_says_so() -> None:
    policy = Policy(TenantPolicy(tenant="team-a", allowed_capabilities=["gpt-*"]))
    wide_key = key_entry(["*"])
    assert may_use(policy, wide_key, "gpt-4o") and not may_use(policy, wide_key, "claude-3-opus")
    refused = model_refusal("team-a", policy, wide_key, "claude-3-opus")
    assert refused is not None and refused.message == "The API key of tenant 'team-a' may not use 'claude-3-opus'."
    both = model_refusal("team-a", policy, key_entry(["gpt-4o"]), "claude-3-opus")
    assert both is not None and "tenant" in both.message  # the tenant's rule is named when both refuse


def test_a_long_model_name_is_cut_in_the_message() -> None:
    refused = model_refusal("team-a", OPEN, key_entry(["gpt-4o"]), "m" * 5000)
    assert refused is not None and len(refused.message) < 300 and refused.message.endswith("...'")
