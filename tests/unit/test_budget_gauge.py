"""Which tenants and keys ``gridgate_budget_remaining_nanousd`` reads (gateway/supervisor/spend.py), and the
supervisor's read of every managed key in its host table (gateway/supervisor/keys.py). The values
themselves come from the ledger: tests/integration/test_spend_e2e.py reads them back from real gateways."""

from __future__ import annotations

import asyncio
import json

import msgspec

from gateway.config import parse_config
from gateway.identity.auth import KeyIdentity, hash_api_key
from gateway.identity.key_limits import KeyLimits
from gateway.identity.keyformat import key_digest, new_key
from gateway.keys.record import PreviousSecret
from gateway.keys.view import views_of
from gateway.spend.series import MAX_KEYS, MAX_TENANTS
from gateway.supervisor.keys import KeyService, keys_in_table
from gateway.supervisor.spend import gauge_tenants, managed_spend_scopes
from shm.keys import KeyTable, KeyTableWriter
from tests.unit.test_key_table import record as key_record

ONE_USD_A_DAY = msgspec.convert({"spend": [{"usd": 1, "period": "1d"}]}, KeyLimits)
SPEND = ONE_USD_A_DAY.counted()


def _config(keys: list[str], rule_tenants: list[str]):
    return parse_config(json.dumps({
        "listen": "127.0.0.1:8080", "clusters": [{"name": "a", "endpoints": ["127.0.0.1:9"]}],
        "routing": {"overlay_file": "overlay.json"},
        "auth": {"keys": [{"tenant": tenant, "key": hash_api_key(f"sk-{n}")} for n, tenant in enumerate(keys)]},
        "quota": {"backend": {"kind": "embedded"},
                  "rules": [{"name": f"r-{tenant}", "match": {"tenant": tenant}, "budgets": [{"window": "1m", "tokens": 10}]}
                            for tenant in rule_tenants]}}))


def test_the_gauge_reads_the_configs_tenants_then_those_only_managed_keys_name_once_each():
    config = _config(["yaml-a", "yaml-b"], ["ruled", "yaml-a"])
    managed = [KeyIdentity("team-x", kid="k1"), KeyIdentity("yaml-b", kid="k2"), KeyIdentity("team-y", kid="k3"),
               KeyIdentity("team-x", kid="k4")]
    assert gauge_tenants(config, managed) == ["yaml-a", "yaml-b", "ruled", "team-x", "team-y"]
    assert gauge_tenants(config, []) == ["yaml-a", "yaml-b", "ruled"]


def test_the_gauges_tenants_stop_at_the_spend_counters_bound():
    many = [KeyIdentity(f"team-{n}", kid=f"k{n}") for n in range(MAX_TENANTS + 50)]
    tenants = gauge_tenants(_config(["yaml-a"], ["yaml-a"]), many)
    assert len(tenants) == MAX_TENANTS and tenants[:2] == ["yaml-a", "team-0"]


def test_only_managed_keys_with_a_usd_budget_of_their_own_get_a_key_series_at_most_max_keys():
    tokens_only = msgspec.convert({"budgets": [{"window": "1m", "tokens": 10}]}, KeyLimits).counted()
    managed = [KeyIdentity("t1", kid="spender", limits=SPEND), KeyIdentity("t1", kid="none"),
               KeyIdentity("t1", kid="tokens", limits=tokens_only), KeyIdentity("t2", kid="other", limits=SPEND)]
    scopes = managed_spend_scopes(managed)
    assert {tenant: [scope.name for scope in found] for tenant, found in scopes.items()} == {
        "t1": ["spender"], "t2": ["other"]}
    assert scopes["t1"][0].limits is SPEND
    crowd = [KeyIdentity(f"t{n % 3}", kid=f"k{n}", limits=SPEND) for n in range(MAX_KEYS + 10)]
    assert sum(len(found) for found in managed_spend_scopes(crowd).values()) == MAX_KEYS


def test_every_key_of_the_table_is_read_once_per_kid_and_revoked_ones_are_left_out():
    table = KeyTable.create(100)
    writer = KeyTableWriter(table)
    old = new_key("AAAAAAAAAAAA")
    rotated = key_record(new_key("AAAAAAAAAAAA"), previous=[PreviousSecret(key_digest(old).hex(), until=2000)],
                      limits=ONE_USD_A_DAY)
    records = [rotated, key_record(new_key("BBBBBBBBBBBB"), tenant="team-b", status="blocked"),
               key_record(new_key("CCCCCCCCCCCC"), status="revoked")]
    records += [key_record(new_key(f"D{n:011d}"), tenant="team-d") for n in range(30)]
    for made in records:
        for digest, blob in views_of(made, now=1000).items():
            writer.put(digest, blob)
    assert len(table) == len(records) + 1  # the rotated key's two secrets
    keys = asyncio.run(keys_in_table(writer, batch=7))  # yields to the loop on the way
    by_kid = {key.kid: key for key in keys}
    assert sorted(by_kid) == sorted(made.kid for made in records if made.status != "revoked")
    assert len(keys) == len(by_kid)  # one per kid: the rotated key's two secrets are one key
    spender = by_kid[rotated.kid]
    assert (spender.tenant, spender.limits.spend[0].nusd) == ("team-a", 1_000_000_000)
    assert by_kid[records[1].kid].tenant == "team-b" and by_kid[records[1].kid].limits is None


def test_a_slot_freed_while_the_scan_yields_is_skipped():
    table = KeyTable.create(10)
    writer = KeyTableWriter(table)
    made = key_record(new_key("AAAAAAAAAAAA"))
    ((digest, blob),) = views_of(made, now=1000).items()
    writer.put(digest, blob)
    writer.put(b"\x01" * 32, b"not a record")
    assert [key.kid for key in asyncio.run(keys_in_table(writer))] == [made.kid]


def test_the_supervisor_reads_its_table_again_only_after_a_change():
    config = parse_config(json.dumps({
        "listen": "127.0.0.1:8080", "clusters": [{"name": "a", "endpoints": ["127.0.0.1:9"]}],
        "routing": {"overlay_file": "overlay.json"},
        "auth": {"store": {"kind": "valkey", "url": "valkey://127.0.0.1:1/0"}}}))
    service = KeyService(embedded=None)  # type: ignore[arg-type]  # a valkey URL: nothing embedded is asked for
    service.prepare(config)  # the table; the follower (which would write it) is not started
    writer = service._writer  # the table's one writer, which the follower would write with
    assert writer is not None

    def put(key: str, tenant: str) -> None:
        for digest, blob in views_of(key_record(key, tenant=tenant), now=1000).items():
            writer.put(digest, blob)

    async def reads() -> list[list[str]]:
        seen = []
        put(new_key("AAAAAAAAAAAA"), "team-a")
        first = await service.managed_keys()
        seen.append([key.tenant for key in first])
        assert await service.managed_keys() is first  # unchanged: not read again
        put(new_key("BBBBBBBBBBBB"), "team-b")
        seen.append(sorted(key.tenant for key in await service.managed_keys()))
        return seen

    assert asyncio.run(reads()) == [["team-a"], ["team-a", "team-b"]]
    service.table.close()
