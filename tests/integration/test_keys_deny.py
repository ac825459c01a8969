"""A blocked or revoked managed key is refused by the quota's admission call itself (docs/keys.md,
docs/limits.md): the admit reads the tenant's deny set in the same atomic call as the limits, against the
real bundled Valkey, in-process and through two real gateways."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
import valkey

from gateway.identity.auth import KeyIdentity
from gateway.identity.limits import Budget, Limits, RequestLimit
from gateway.keys.store import deny_set_key
from gateway.quota.ledger import QuotaLedger
from gateway.valkey.resp_transport import RespTransport
from tests.harness import candidate, envelope, mock_served, request
from tests.integration.test_keys_e2e import TOKENS, admin, host_status, wait_for
from tests.integration.test_limits_ledger import DAY, admit, counters, new_tenant, open_gate, rule


def managed(tenant: str, kid: str = "k1a2b3c4d5e6") -> KeyIdentity:
    return KeyIdentity(tenant, None, kid, Limits(requests=(RequestLimit(DAY, 1000, 1000),),
                                                 budgets=(Budget(DAY, 1_000_000),)))


def deny_state(url: str, tenant: str) -> dict[bytes, bytes]:
    client = valkey.Valkey.from_url(url)
    try:
        return client.hgetall(deny_set_key(tenant))
    finally:
        client.close()


@pytest.mark.parametrize("status", ["blocked", "revoked"])
def test_a_kid_in_the_deny_set_is_refused_by_the_admit_and_nothing_is_written(valkey_url: str, status: str) -> None:
    tenant = new_tenant()
    key = managed(tenant)
    other = managed(tenant, "kzzzzzzzzzzz")
    the_rule = rule(tenant, requests=[RequestLimit(DAY, 1000, 1000)], budgets=[Budget(DAY, 1_000_000)])
    deny = valkey.Valkey.from_url(valkey_url)

    async def scenario() -> None:
        # Exact admission (no worker-held blocks): every admit of the key reaches the script. With blocks, a
        # managed key's blocks are asked for by the same admit, deny set included (test_keys_blocks.py).
        async with open_gate(valkey_url, [the_rule], lease=None) as gate:
            held = [await admit(gate, tenant, 30, key=key) for _ in range(20)]
            assert all(a.allowed and a.lease is None and a.reservation is not None for a in held)
            assert gate.counters.leased == 0 and gate.counters.leases_granted == 0
            deny.hset(deny_set_key(tenant), key.kid, status)  # what the key store writes with the record
            before = counters(valkey_url, tenant)
            denied_before = deny_state(valkey_url, tenant)
            refused = await admit(gate, tenant, 30, key=key)
            assert (refused.allowed, refused.status, refused.reason) == (False, 401, f"key_{status}")
            assert refused.error == (f"API key {key.kid} {'was revoked' if status == 'revoked' else 'is blocked'}",
                                     None, f"key_{status}")
            assert refused.reservation is None and refused.lease is None
            # Every key of the tenant (its clocks, windows, reservations) and the deny set, as they were.
            assert counters(valkey_url, tenant) == before
            assert deny_state(valkey_url, tenant) == denied_before
            assert gate.counters.denied == 0  # not a limit's refusal
            # Another key of the tenant is not refused; a YAML key (no kid) never reads the deny set.
            assert (await admit(gate, tenant, 30, key=other)).allowed
            assert (await admit(gate, tenant, 30, key=KeyIdentity(tenant, "yaml", None, key.limits))).allowed
            if status == "blocked":  # unblocking takes the kid out of the set: admitted again
                deny.hdel(deny_set_key(tenant), key.kid)
                assert (await admit(gate, tenant, 30, key=key)).allowed
            for admission in held:
                gate.settle(admission, 5)
            await gate.drain()

    try:
        asyncio.run(scenario())
    finally:
        deny.close()


def test_the_deny_set_key_is_the_ledgers_escaping_of_the_tenant_in_its_hash_slot() -> None:
    ledger = QuotaLedger(RespTransport(), reservation_timeout_s=120)
    tenant = "t{x}:%|"
    account = ledger.account(tenant, None, managed(tenant))
    assert account is not None
    assert deny_set_key(tenant) == "gg:keys:v1:{t%7Bx%7D%3A%25%7C}:deny"
    # Same hash tag as every ledger key of the tenant: one Cluster slot for the whole call.
    assert account.prefix.split(b"}")[0].split(b"{")[1] == deny_set_key(tenant).split("}")[0].split("{")[1].encode()
    assert account.leasable and account.managed  # its blocks are its own, asked for with the deny set
    assert ledger.account(tenant, None, KeyIdentity(tenant, "ci", None, managed(tenant).limits)).leasable  # type: ignore[union-attr]


def test_with_exact_admission_a_block_on_one_gateway_is_refused_by_the_next_admission_on_another(
        gateway_factory, mock_provider, keys_store) -> None:
    """Gateway B's supervisor (its key table's follower) is stopped, so B's table still says ``active``:
    only the admission call can refuse the key there. Exact admission (``lease: null``): the very next
    one; with worker-held blocks, within a block's life (test_keys_blocks.py)."""
    handle = mock_provider("provider-a")
    extra = {"auth": {}, "admin": {"tokens": TOKENS},
             "quota": {"backend": {"kind": "valkey", "url": keys_store.url}, "lease": None,
                       "rules": [{"name": "r", "budgets": [{"window": "1m", "tokens": 1_000_000}]}]}}
    first = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra=extra)
    second = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra=extra)
    status, created = admin(first, "POST", "/admin/keys", {"tenant": "team-d"})
    assert status == 201
    kid, secret = created["record"]["kid"], created["key"]
    wait_for(lambda: host_status(second, kid) == "active", "the key in the second host's table")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    auth = [("Authorization", f"Bearer {secret}")]
    assert request("127.0.0.1", second.port, "POST", "/v1/chat/completions", body, auth)[0] == 200
    served = mock_served(handle)
    os.kill(second.process.pid, signal.SIGSTOP)  # its follower stops: its table keeps "active"
    try:
        status, _ = admin(first, "POST", f"/admin/keys/{kid}/block")
        assert status == 200
        status, _, data = request("127.0.0.1", second.port, "POST", "/v1/chat/completions", body, auth)
        error = json.loads(data)["error"]
        assert (status, error["code"], error["type"]) == (401, "key_blocked", "authentication_error")
        assert error["message"] == f"API key {kid} is blocked"
        assert request("127.0.0.1", first.port, "POST", "/v1/chat/completions", body, auth)[0] == 401
        assert mock_served(handle) == served  # neither refused request reached the provider
    finally:
        os.kill(second.process.pid, signal.SIGCONT)
    wait_for(lambda: host_status(second, kid) == "blocked", "the block in the second host's table")
