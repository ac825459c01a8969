"""The managed-key store and the follower on a real Valkey (bundled binary), in this process: what is
written where, what a refused change leaves, how a host table follows, reloads and records uses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import valkey

from gateway.identity.key_limits import KeyLimits
from gateway.identity.keyformat import key_digest
from gateway.keys.follower import KeyFollower
from gateway.keys.lookup import KeyLookup
from gateway.keys.record import CreateKey
from gateway.keys.store import (
    ALL,
    BY_ALIAS,
    BY_TENANT,
    LOG,
    RECORD,
    KeyConflict,
    KeyNotFound,
    KeyStore,
    deny_set_key,
)
from gateway.valkey.client import BACKEND_ERRORS, create_client
from gateway.valkey.embedded import EmbeddedValkey
from shm.keys import KeyTable, KeyTableWriter
from tests.integration.test_quota_cluster import cluster_url  # noqa: F401 - the 3-node cluster fixture
from workers.key_gate import ManagedKeyGate


@pytest.fixture(scope="module")
def keys_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Valkey of this module's own: every test starts from an empty store (FLUSHALL)."""
    server = EmbeddedValkey(tmp_path_factory.mktemp("keys-valkey"))
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
def direct(keys_valkey: str) -> Iterator[valkey.Valkey]:
    client = valkey.Valkey.from_url(keys_valkey)
    client.flushall()
    yield client
    client.close()


def run(coroutine):
    return asyncio.run(coroutine)


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def with_store(url: str, body, *, cluster: bool = False):
    store = KeyStore(create_client(url, timeout_s=2.0), cluster=cluster)
    try:
        return await body(store)
    finally:
        await store.close()


def create(tenant: str = "team-a", **fields) -> CreateKey:
    return CreateKey(tenant=tenant, **fields)


@pytest.mark.parametrize("cluster", [False, True], ids=["one-call", "deny-set-apart"])
def test_block_and_revoke_are_in_the_deny_set_when_the_call_returns(keys_valkey, direct, cluster):
    async def body(store: KeyStore):
        _, record = await store.create(create(), "ops", 1000)
        kid = record.kid
        deny = deny_set_key("team-a")
        assert direct.hget(deny, kid) is None
        await store.set_status(kid, "block", "ops", 1001)
        assert direct.hget(deny, kid) == b"blocked"
        await store.set_status(kid, "unblock", "ops", 1002)
        assert direct.hget(deny, kid) is None
        await store.set_status(kid, "revoke", "ops", 1003)
        assert direct.hget(deny, kid) == b"revoked"
        return kid

    kid = run(with_store(keys_valkey, body, cluster=cluster))
    assert deny_set_key("team-a") == "gg:keys:v1:{team-a}:deny"
    actions = [fields[b"action"] for _, fields in direct.xrange(LOG)]
    assert actions == [b"create", b"block", b"unblock", b"revoke"]
    assert [int(fields[b"n"]) for _, fields in direct.xrange(LOG)] == [1, 2, 3, 4]
    assert direct.zrange(ALL, 0, -1) == [kid.encode()] and direct.zrange(BY_TENANT + "team-a", 0, -1) == [kid.encode()]


def test_a_refused_change_changes_nothing(keys_valkey, direct):
    async def body(store: KeyStore):
        _, record = await store.create(create(alias="ci"), "ops", 1000)
        await store.set_status(record.kid, "revoke", "ops", 1001)
        before = (direct.get(RECORD + record.kid), direct.xlen(LOG), direct.hgetall(deny_set_key("team-a")))
        for change in (store.set_status(record.kid, "unblock", "ops", 1002),
                       store.set_status(record.kid, "block", "ops", 1002),
                       store.patch(record.kid, {"alias": "other"}, "ops", 1002),
                       store.rotate(record.kid, 60, "ops", 1002)):
            with pytest.raises(KeyConflict, match="revoked"):
                await change
        assert (direct.get(RECORD + record.kid), direct.xlen(LOG), direct.hgetall(deny_set_key("team-a"))) == before
        assert direct.zrange(BY_ALIAS + "ci", 0, -1) == [record.kid.encode()]
        with pytest.raises(KeyNotFound):
            await store.set_status("AAAAAAAAAAAA", "block", "ops", 1002)

    run(with_store(keys_valkey, body))


def test_the_store_and_its_log_never_hold_a_key(keys_valkey, direct):
    async def body(store: KeyStore):
        key, record = await store.create(create(), "ops", 1000)
        new_key, _ = await store.rotate(record.kid, 3600, "ops", 1001)
        return key, new_key

    keys = run(with_store(keys_valkey, body))
    everything = b"".join(direct.dump(name) or b"" for name in direct.keys("*"))
    for key in keys:
        assert key.encode() not in everything
        assert key_digest(key).hex().encode() not in b"".join(str(e).encode() for e in direct.xrange(LOG))


def test_listing_pages_through_a_filter_with_a_cursor(keys_valkey, direct):
    async def body(store: KeyStore):
        kids = set()
        for n in range(7):
            _, record = await store.create(create("team-b" if n % 2 else "team-a", alias=f"a{n % 3}"), "ops", 1000)
            kids.add(record.kid)
        seen, cursor = [], None
        while True:
            page, cursor = await store.page(tenant="team-a", alias=None, status=None, cursor=cursor, limit=2)
            seen += page
            if cursor is None:
                break
        assert len(seen) == 4 and all(r.tenant == "team-a" for r in seen)
        assert [r.kid for r in seen] == sorted(r.kid for r in seen)
        by_alias, _ = await store.page(tenant=None, alias="a0", status=None, cursor=None, limit=10)
        assert len(by_alias) == 3
        await store.set_status(seen[0].kid, "block", "ops", 1001)
        blocked, _ = await store.page(tenant=None, alias=None, status="blocked", cursor=None, limit=10)
        assert [r.kid for r in blocked] == [seen[0].kid]

    run(with_store(keys_valkey, body))


async def follower_on(url: str, capacity: int = 1000, clock: Clock | None = None) -> tuple[KeyFollower, KeyTable]:
    table = KeyTable.create(capacity)
    follower = KeyFollower(KeyStore(create_client(url, timeout_s=2.0)), KeyStore(create_client(url, timeout_s=5.0)),
                           KeyTableWriter(table), clock=clock or Clock(), backend_errors=BACKEND_ERRORS)
    await follower.load()
    return follower, table


async def drain(follower: KeyFollower) -> None:
    """Apply everything the log holds after what the follower applied."""
    while True:
        before = follower.stats.entries_applied + follower.stats.loads
        await follower.follow_once()
        if follower.stats.entries_applied + follower.stats.loads == before:
            return


def test_a_follower_loads_the_store_then_applies_every_change(keys_valkey, direct):
    async def body(store: KeyStore):
        now = Clock().now
        key_a, a = await store.create(create(limits=KeyLimits(max_in_flight=2)), "ops", now)
        follower, table = await follower_on(keys_valkey)
        lookup = KeyLookup(table)
        assert lookup(key_digest(key_a)).limits.max_in_flight == 2
        key_b, b = await store.create(create("team-b", models=["gpt-*"]), "ops", now)
        await store.set_status(a.kid, "block", "ops", now)
        new_b, _ = await store.rotate(b.kid, 3600, "ops", now)
        await drain(follower)
        assert lookup(key_digest(key_a)).status == "blocked"
        assert lookup(key_digest(new_b)).models == ["gpt-*"] and lookup(key_digest(new_b)).expires_at is None
        assert lookup(key_digest(key_b)).expires_at == int(now) + 3600  # the old secret, until its grace ends
        await store.set_status(a.kid, "revoke", "ops", now)
        await store.rotate(b.kid, 0, "ops", now)  # no grace: the new secret stops, the old one keeps its grace
        await drain(follower)
        assert lookup(key_digest(key_a)).status == "revoked"
        assert lookup(key_digest(new_b)) is None and lookup(key_digest(key_b)) is not None
        assert len(table) == 3 and follower.stats.loads == 1
        follower.end_graces(now + 3600)
        assert lookup(key_digest(key_b)) is None and len(table) == 2
        await follower.close()

    run(with_store(keys_valkey, body))


def test_a_follower_that_missed_trimmed_changes_reloads_everything(keys_valkey, direct):
    async def body(store: KeyStore):
        key_a, a = await store.create(create(), "ops", 1000)
        follower, table = await follower_on(keys_valkey)
        key_b, _ = await store.create(create(), "ops", 1001)
        await store.set_status(a.kid, "block", "ops", 1002)
        key_c, _ = await store.create(create(), "ops", 1003)
        direct.xtrim(LOG, maxlen=1, approximate=False)  # the follower never read the first two of these three
        await drain(follower)
        assert follower.stats.loads == 2
        lookup = KeyLookup(table)
        assert lookup(key_digest(key_a)).status == "blocked"
        assert lookup(key_digest(key_b)) is not None and lookup(key_digest(key_c)) is not None
        await follower.close()

    run(with_store(keys_valkey, body))


def test_a_store_that_was_reset_reloads_the_table(keys_valkey, direct):
    async def body(store: KeyStore):
        old, _ = await store.create(create(), "ops", 1000)
        follower, table = await follower_on(keys_valkey)
        direct.flushall()
        new, _ = await store.create(create(), "ops", 1001)  # change number 1 again
        await drain(follower)
        assert follower.stats.loads == 2
        lookup = KeyLookup(table)
        assert lookup(key_digest(old)) is None and lookup(key_digest(new)) is not None
        await follower.close()

    run(with_store(keys_valkey, body))


def test_uses_are_written_once_a_minute_at_minute_resolution(keys_valkey, direct):
    async def body(store: KeyStore):
        clock = Clock(1_800_000_030.0)
        key, record = await store.create(create(), "ops", clock.now)
        other_key, other = await store.create(create(), "ops", clock.now)
        follower, table = await follower_on(keys_valkey, clock=clock)
        await follower.tick()  # publishes the minute
        assert ManagedKeyGate(KeyLookup(table)).admit(key_digest(key)) is not None  # the request path's mark
        clock.now += 60
        await follower.tick()
        assert await store.last_used([record.kid, other.kid]) == [1_800_000_000, None]
        # Within the next minute a new use is not written at every tick (each collection scans the whole
        # table: once a second, that cost the supervisor ~3 % of a core at 100,000 slots)...
        clock.now += 10  # 1_800_000_100: the same minute as the last collection
        assert ManagedKeyGate(KeyLookup(table)).admit(key_digest(other_key)) is not None
        for _ in range(3):
            clock.now += 1
            await follower.tick()
        assert await store.last_used([record.kid, other.kid]) == [1_800_000_000, None]
        # ...but at the first tick of the minute after it.
        clock.now += 30
        await follower.tick()
        assert await store.last_used([record.kid, other.kid]) == [1_800_000_000, 1_800_000_060]
        await follower.close()

    run(with_store(keys_valkey, body))


def test_the_store_and_a_follower_work_on_a_valkey_cluster(cluster_url):  # noqa: F811 - the fixture
    # Every store key shares the {gg-keys} slot; each tenant's deny set lives in the tenant's slot, so it
    # is written by a call of its own, and must still hold the kid when block returns.
    async def body(store: KeyStore):
        follower, table = await follower_on_cluster(cluster_url)
        key, record = await store.create(create("team-cluster", alias="c"), "ops", Clock().now)
        await store.set_status(record.kid, "block", "ops", Clock().now)
        deny = create_client(cluster_url, timeout_s=2.0)
        try:
            assert await deny.execute_command("HGET", deny_set_key("team-cluster"), record.kid) == b"blocked"
            await drain(follower)
            assert KeyLookup(table)(key_digest(key)).status == "blocked"
            await store.set_status(record.kid, "unblock", "ops", Clock().now)
            assert await deny.execute_command("HGET", deny_set_key("team-cluster"), record.kid) is None
            page, _ = await store.page(tenant=None, alias="c", status=None, cursor=None, limit=10)
            assert [r.kid for r in page] == [record.kid]
        finally:
            await deny.aclose()
            await follower.close()

    async def follower_on_cluster(url: str) -> tuple[KeyFollower, KeyTable]:
        table = KeyTable.create(100)
        follower = KeyFollower(KeyStore(create_client(url, timeout_s=2.0), cluster=True),
                               KeyStore(create_client(url, timeout_s=5.0), cluster=True),
                               KeyTableWriter(table), clock=Clock(), backend_errors=BACKEND_ERRORS)
        await follower.load()
        return follower, table

    run(with_store(cluster_url, body, cluster=True))


def test_a_record_that_cannot_be_read_is_skipped_and_the_others_load(keys_valkey, direct):
    async def body(store: KeyStore):
        key, _ = await store.create(create(), "ops", Clock().now)
        direct.set(RECORD + "BrokenRecord", b'{"kid": "BrokenRecord", "tenant": 7')
        direct.zadd(ALL, {"BrokenRecord": 0})
        follower, table = await follower_on(keys_valkey)
        assert KeyLookup(table)(key_digest(key)) is not None and len(table) == 1
        await follower.close()

    run(with_store(keys_valkey, body))
