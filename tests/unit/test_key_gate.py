"""Managed keys at the head gate (workers/key_gate.py, workers/head_gate.py): a real host key table
written by its real writer, the real Authenticator, HeaderPlan and RouteTable; a bare slot holder
stands in for the server's connection (the gate only reads and writes its ``auth_memo``)."""

from __future__ import annotations

import json
import time

from gateway.identity.auth import Authenticator, KeyIdentity, hash_api_key
from gateway.identity.key_limits import KeyLimits, RequestRate
from gateway.identity.keyformat import key_digest, new_key, new_kid
from gateway.keys.lookup import KeyLookup
from gateway.keys.record import KeyRecord
from gateway.keys.view import KeyEntry, views_of
from gateway.request.headers import HeaderPlan
from gateway.request.routes import KEY, RouteTable
from shm.keys import KeyTable, KeyTableWriter
from workers.head_gate import Admitted, HeadGate, HeadRefusal
from workers.key_gate import ManagedKeyGate, key_answer


class Connection:
    __slots__ = ("auth_memo",)

    def __init__(self) -> None:
        self.auth_memo = None


class Host:
    """A key table, its writer, and a gate over it (YAML key ``sk-yaml`` for tenant ``yaml-team``)."""

    def __init__(self) -> None:
        self.table = KeyTable.create(100)
        self.writer = KeyTableWriter(self.table)
        self.writer.set_minute(29_000_000)
        self.lookup = KeyLookup(self.table)
        auth = Authenticator([("yaml-team", hash_api_key("sk-yaml"))])
        self.gate = HeadGate(RouteTable("/mcp"), auth, HeaderPlan("X-Model"), keys=ManagedKeyGate(self.lookup))

    def put(self, key: str, version: int = 1, **fields) -> KeyRecord:
        kid = key.split("-")[1]
        base = dict(kid=kid, tenant="team-a", status="active", digest=key_digest(key).hex(), created_at=1,
                    created_by="ops", updated_at=1, version=version)
        record = KeyRecord(**{**base, **fields})
        for digest, blob in views_of(record, time.time()).items():
            self.writer.put(digest, blob)
        return record

    def used_slots(self) -> list[int]:
        return [slot for slot, _ in self.table.used_since(29_000_000)]

    def call(self, key: str, conn: Connection | None = None, target: bytes = b"/v1/chat/completions",
             method: bytes = b"POST") -> Admitted | HeadRefusal:
        headers = [(b"host", b"g"), (b"authorization", b"Bearer " + key.encode())]
        return self.gate(conn or Connection(), method, target, headers)


def test_a_managed_key_is_admitted_with_its_entry_and_marked_used() -> None:
    host = Host()
    key = new_key(new_kid())
    host.put(key, alias="ci", models=["gpt-*"])
    admitted = host.call(key)
    assert type(admitted) is Admitted and admitted.tenant == "team-a"
    assert admitted.managed is not None and admitted.managed.alias == "ci"
    assert host.used_slots() == [admitted.managed.slot]


def test_yaml_keys_work_beside_managed_keys_and_carry_no_entry() -> None:
    host = Host()
    admitted = host.call("sk-yaml")
    assert type(admitted) is Admitted and (admitted.tenant, admitted.managed) == ("yaml-team", None)
    unknown = host.call(new_key(new_kid()))
    assert type(unknown) is HeadRefusal and (unknown.status, unknown.code) == (401, "invalid_api_key")
    assert host.used_slots() == []


def test_blocked_revoked_and_expired_keys_are_401_naming_why_and_never_marked_used() -> None:
    host = Host()
    blocked, revoked, expired = (new_key(new_kid()) for _ in range(3))
    host.put(blocked, status="blocked")
    host.put(revoked, status="revoked")
    host.put(expired, expires_at=int(time.time()) - 1)
    for key, code in ((blocked, "key_blocked"), (revoked, "key_revoked"), (expired, "key_expired")):
        refusal = host.call(key)
        assert type(refusal) is HeadRefusal and (refusal.status, refusal.code) == (401, code)
        assert json.loads(refusal.body())["error"]["type"] == "authentication_error" and refusal.close
        assert refusal.tenant == "team-a"  # its access line names whose key was refused
        assert key.split("-")[1] in refusal.message and key.split("-")[2] not in refusal.message
        assert (b"www-authenticate", b'Bearer realm="gridgate"') in refusal.headers
    assert host.used_slots() == []
    soon = new_key(new_kid())
    host.put(soon, expires_at=int(time.time()) + 3600)
    assert type(host.call(soon)) is Admitted


def test_a_block_reaches_a_keep_alive_connection_on_its_next_request() -> None:
    host = Host()
    key = new_key(new_kid())
    record = host.put(key)
    conn = Connection()
    assert type(host.call(key, conn)) is Admitted
    assert conn.auth_memo is not None and conn.auth_memo[2] == key_digest(key)  # the digest, not a verdict
    host.put(key, version=record.version + 1, status="blocked")
    refusal = host.call(key, conn)
    assert type(refusal) is HeadRefusal and refusal.code == "key_blocked"
    host.put(key, version=record.version + 2)
    assert type(host.call(key, conn)) is Admitted
    host.writer.remove(key_digest(key))  # revoked and dropped, or never known: plain invalid key
    assert host.call(key, conn).code == "invalid_api_key"  # type: ignore[union-attr]


def test_the_key_route_and_its_answer_never_show_the_secret() -> None:
    host = Host()
    key = new_key(new_kid())
    host.put(key, alias="ci", limits=KeyLimits(requests=[RequestRate(window="1m", count=60)]))
    admitted = host.call(key, target=b"/v1/gridgate/key?x=1", method=b"GET")
    assert type(admitted) is Admitted and admitted.route.kind == KEY
    entry: KeyEntry = admitted.managed  # type: ignore[assignment]
    assert admitted.key is entry.identity and entry.identity.kid == entry.kid
    body = key_answer(admitted.key, entry)
    answer = json.loads(body)
    assert (answer["source"], answer["kid"], answer["tenant"], answer["alias"]) == ("managed", entry.kid, "team-a", "ci")
    assert answer["limits"]["requests"] == [{"window": "1m", "count": 60, "burst": None, "shadow": False}]
    assert answer["spend"] is None and answer["remaining"] is None
    assert key.encode() not in body and key_digest(key).hex().encode() not in body
    assert key.split("-")[2].encode() not in body
    yaml = json.loads(key_answer(KeyIdentity("yaml-team", "ci-bot"), None))
    assert (yaml["source"], yaml["kid"], yaml["tenant"], yaml["alias"], yaml["limits"]) == (
        "config", None, "yaml-team", "ci-bot", None)
    limits = KeyLimits(requests=[RequestRate(window="1m", count=60)])
    configured = json.loads(key_answer(KeyIdentity("yaml-team", "ci-bot", None, limits.counted(), written=limits), None))
    assert configured["limits"] == answer["limits"]  # a YAML key's limits in the managed key's form
