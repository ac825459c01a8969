"""Prefix affinity's rendezvous ranking (docs/routing.md, "Prefix affinity"): a provider that goes away
takes only its own prefixes along, each to the next provider of its ranking (so they spread over the
others, no herd onto one); every other prefix stays where it was. A real gateway and three private mock providers on loopback."""

from __future__ import annotations

from tests.harness import request
from tests.integration.test_prefix_affinity import PREFIX, overlay, served_by, three

PROMPTS = range(24)


def test_a_provider_that_goes_away_takes_only_its_own_prefixes_along(mock_provider, loopback_gateway_factory):
    handles = {name: mock_provider(name) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {**PREFIX, "retry": {"attempts": 3, "backoff": {"base": "1ms", "max": "5ms"}},
                         "cooling": {"default": "30s", "max": "30s"}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    homes = {prompt: served_by(gateway.port, prompt) for prompt in PROMPTS}
    gone = max(set(homes.values()), key=list(homes.values()).count)  # the provider with most prefixes
    assert 0 < list(homes.values()).count(gone) < len(PROMPTS)
    failing = {"fail_rate": 1.0, "fail_status": 503, "retry_after": "30"}
    assert request("127.0.0.1", handles[gone].port, "POST", "/admin/config", failing)[0] == 200
    served_by(gateway.port, next(p for p in PROMPTS if homes[p] == gone), "cools it")  # fails over: cooled
    after = {prompt: served_by(gateway.port, prompt, "again") for prompt in PROMPTS}
    assert {p: after[p] for p in PROMPTS if homes[p] != gone} == {p: homes[p] for p in PROMPTS if homes[p] != gone}
    assert all(after[p] != gone for p in PROMPTS)
    moved = [after[p] for p in PROMPTS if homes[p] == gone]
    assert set(moved) == set(handles) - {gone}  # spread by their rankings over both others: no herd
    stable = {prompt: served_by(gateway.port, prompt, "once more") for prompt in PROMPTS}
    assert stable == after  # each moved prefix keeps its next place
