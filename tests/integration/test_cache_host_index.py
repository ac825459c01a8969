"""The response cache's host index (docs/cache.md, "The host index"): a miss of a key nobody in the fleet has
awaits no Valkey call, and everything stays correct when the index cannot tell. Real request paths in this
process (tests/inprocess.py: a path is one worker, an index and its follower one host), a real mock provider
and the real bundled Valkey; and a real two-worker gateway for the supervisor's side."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gateway.cache.index_follower import IndexFollower
from gateway.valkey.client import create_client
from shm.cache_index import CacheIndex, CacheIndexWriter, KeyPlace
from tests.harness import admin_get, candidate, envelope, metric_value, request, wait_until
from tests.inprocess import InProcessGateway, Provider, start_provider

FAST_RETRY = {"attempts": 1, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
CHAT = "/v1/chat/completions"
TTL_MS, WAIT_MS = 3_600_000, 30_000


def body(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}


class Host:
    """One host's index and its follower (the supervisor's part), on this loop."""

    def __init__(self, valkey_url: str, capacity: int = 1024, workers: int = 2) -> None:
        self.index = CacheIndex.create(capacity, workers)
        self.writer = CacheIndexWriter(self.index)
        self.follower = IndexFollower(valkey_url, self.writer, WAIT_MS, TTL_MS)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Host:
        self.task = asyncio.ensure_future(self.follower.run())
        async with asyncio.timeout(5):
            await self.follower.authoritative.wait()
        return self

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


@contextlib.asynccontextmanager
async def worker(tmp_path: Path, provider: Provider, valkey_url: str, host: Host | None, slot: int = 0,
                 cache: dict[str, Any] | None = None) -> AsyncIterator[InProcessGateway]:
    directory = tmp_path / uuid.uuid4().hex[:8]
    directory.mkdir()
    config = {"routing": {"retry": FAST_RETRY},
              "cache": {"enabled": True, "backend": {"url": valkey_url}, "index": {}, **(cache or {})}}
    path = await InProcessGateway.start(directory, {provider.name: [provider.address]},
                                        envelope([candidate("m", provider.name)], "deterministic"), extra=config,
                                        cache_index=None if host is None else host.index, slot=slot)
    try:
        yield path
    finally:
        await path.close()


async def answered(path: InProcessGateway, question: dict[str, Any]) -> tuple[int, str, bytes]:
    answer = await path.request("POST", CHAT, question)
    return answer.status, answer.headers["x-gridgate-cache"], answer.body


async def eventually(predicate: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def settled() -> None:
    await asyncio.sleep(0.15)  # the tick's write, the announcement's way to the followers, the SET


def test_a_miss_of_an_unknown_key_awaits_nothing_and_its_repeat_is_a_hit(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        host = await Host(valkey_url).start()
        try:
            async with worker(tmp_path, provider, valkey_url, host) as a:
                question = body(uuid.uuid4().hex)
                first = await answered(a, question)
                assert first[:2] == (200, "miss") and a.path.cache.led_at_once == 1
                await settled()
                assert host.follower.announced >= 1
                a.path.cache.local = None  # read Valkey, not the worker's copy
                assert await answered(a, question) == (200, "hit", first[2])
                assert a.path.cache.led_at_once == 1 and provider.served == 1
        finally:
            await host.stop()
            provider.server.close()
    asyncio.run(scenario())


def test_an_entry_stored_through_one_host_is_a_hit_through_another(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        one, two = await Host(valkey_url).start(), await Host(valkey_url).start()
        try:
            async with worker(tmp_path, provider, valkey_url, one) as a, \
                    worker(tmp_path, provider, valkey_url, two) as b:
                question = body(uuid.uuid4().hex)
                first = await answered(a, question)
                assert first[1] == "miss"
                await settled()
                assert await answered(b, question) == (200, "hit", first[2])
                assert b.path.cache.led_at_once == 0 and provider.served == 1
        finally:
            await one.stop()
            await two.stop()
            provider.server.close()
    asyncio.run(scenario())


def test_a_host_started_after_entries_exist_finds_them_by_its_scan(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        questions = [body(uuid.uuid4().hex) for _ in range(3)]
        try:
            async with worker(tmp_path, provider, valkey_url, None) as a:  # no index: no announcements heard
                firsts = [await answered(a, question) for question in questions]
                await settled()
            late = await Host(valkey_url).start()
            try:
                assert late.follower.scanned >= 3 and late.follower.announced == 0
                async with worker(tmp_path, provider, valkey_url, late) as b:
                    for question, first in zip(questions, firsts, strict=True):
                        assert await answered(b, question) == (200, "hit", first[2])
                    assert b.path.cache.led_at_once == 0 and provider.served == 3
            finally:
                await late.stop()
        finally:
            provider.server.close()
    asyncio.run(scenario())


def test_identical_requests_on_two_workers_of_a_host_share_one_upstream_call(tmp_path, valkey_url):
    """The first leads at once and takes its in-flight cell; the other worker sees the cell and waits for
    it (by its poll), awaiting no claim of its own."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5, latency_ms=300)
        host = await Host(valkey_url).start()
        try:
            async with worker(tmp_path, provider, valkey_url, host, slot=0) as a, \
                    worker(tmp_path, provider, valkey_url, host, slot=1) as b:
                question = body(uuid.uuid4().hex)
                leader = asyncio.ensure_future(answered(a, question))
                await asyncio.sleep(0)  # a's request is read and led, nothing awaited
                await asyncio.sleep(0.01)
                others = await asyncio.gather(*(answered(b, question) for _ in range(3)),
                                              *(answered(a, question) for _ in range(2)))
                first = await leader
                assert first[1] == "miss" and a.path.cache.led_at_once == 1
                assert [state for _, state, _ in others] == ["hit"] * 5
                assert {payload for _, _, payload in others} == {first[2]}
                assert provider.served == 1 and b.path.cache.led_at_once == 0
                slot = host.index.place(_digest_of(a)).slot  # its cell: held a moment after the store, then free
                await eventually(lambda: host.index.leaders(slot) == host.index.no_leaders, timeout=3)
        finally:
            await host.stop()
            provider.server.close()
    asyncio.run(scenario())


def _digest_of(path: InProcessGateway) -> int:
    from gateway.cache.announce import key_digest
    (name,) = path.path.cache.known_keys.values()
    return key_digest(name.key)


def test_identical_requests_on_two_hosts_share_one_call_once_the_claim_is_announced(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5, latency_ms=400)
        one, two = await Host(valkey_url).start(), await Host(valkey_url).start()
        try:
            async with worker(tmp_path, provider, valkey_url, one) as a, \
                    worker(tmp_path, provider, valkey_url, two) as b:
                question = body(uuid.uuid4().hex)
                leader = asyncio.ensure_future(answered(a, question))
                await asyncio.sleep(0.05)  # the claim and its announcement have reached host two's index
                others = await asyncio.gather(*(answered(b, question) for _ in range(3)))
                first = await leader
                assert first[1] == "miss"
                assert [state for _, state, _ in others] == ["hit"] * 3 and provider.served == 1
                assert b.path.cache.led_at_once == 0
        finally:
            await one.stop()
            await two.stop()
            provider.server.close()
    asyncio.run(scenario())


def test_a_cut_subscription_makes_the_index_not_authoritative_and_misses_stay_correct(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        host = await Host(valkey_url).start()
        admin = create_client(valkey_url)
        try:
            async with worker(tmp_path, provider, valkey_url, host) as a:
                assert await admin.execute_command(b"CLIENT", b"KILL", b"TYPE", b"pubsub") >= 1
                await asyncio.sleep(0.05)
                assert not host.index.authoritative(asyncio.get_running_loop().time()) or not host.follower.live
                question = body(uuid.uuid4().hex)
                if not host.follower.live:  # before it is back: the awaited lookup, as without an index
                    first = await answered(a, question)
                    assert first[1] == "miss" and a.path.cache.led_at_once == 0
                    await settled()
                    a.path.cache.local = None
                    assert await answered(a, question) == (200, "hit", first[2])
                await eventually(lambda: host.follower.live and host.follower.scans >= 2)
                assert host.follower.losses >= 1
                again = body(uuid.uuid4().hex)
                assert (await answered(a, again))[1] == "miss"
                assert a.path.cache.led_at_once == 1  # authoritative again (subscribed, rescanned)
        finally:
            await admin.aclose()
            await host.stop()
            provider.server.close()
    asyncio.run(scenario())


def test_a_full_index_only_costs_the_awaited_lookup(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        host = await Host(valkey_url, capacity=1024).start()
        forever = 1e12
        for bucket in range(host.index.buckets):  # every bucket full, and one key more in each
            for n in range(9):
                host.writer.note(KeyPlace(b"%07d" % n + b"\xff", bucket, 0), forever, 0.0)
        assert host.writer.dropped >= host.index.buckets  # (and the scan's keys took slots of their own)
        try:
            async with worker(tmp_path, provider, valkey_url, host) as a:
                a.path.cache.local = None
                question = body(uuid.uuid4().hex)
                first = await answered(a, question)
                assert first[1] == "miss" and a.path.cache.led_at_once == 0
                await settled()
                assert await answered(a, question) == (200, "hit", first[2])
                assert provider.served == 1
        finally:
            await host.stop()
            provider.server.close()
    asyncio.run(scenario())


def test_the_caches_valkey_down_is_a_bypass_with_the_index_authoritative(tmp_path, valkey_url):
    """The index follows a Valkey that works; the cache's own connection cannot reach its Valkey: the miss
    led at once still reaches its provider, and the failed claim turns the next requests into bypasses."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        host = await Host(valkey_url).start()
        try:
            async with worker(tmp_path, provider, valkey_url, host, cache={"backend": {"url": "valkey://127.0.0.1:1"}}) as a:
                first = await answered(a, body(uuid.uuid4().hex))
                assert first[:2] == (200, "miss")
                await settled()
                assert (await answered(a, body(uuid.uuid4().hex)))[:2] == (200, "bypass")
                assert a.path.cache.backend_errors >= 1 and provider.served == 2
        finally:
            await host.stop()
            provider.server.close()
    asyncio.run(scenario())


def test_a_real_gateways_index_is_authoritative_and_hears_its_workers_claims(gateway_factory, mock_provider,
                                                                            valkey_url):
    provider = mock_provider("p")
    gateway = gateway_factory({"p": [provider.address]}, envelope([candidate("m", "p")], "deterministic"),
                              workers=2, extra={"cache": {"enabled": True, "backend": {"url": valkey_url}, "index": {}}})
    wait_until(lambda: metric_value(gateway.admin_port, "gridgate_cache_index_authoritative") == 1, "authority")
    before = metric_value(gateway.admin_port, "gridgate_cache_index_announced_total")
    question = body(uuid.uuid4().hex)
    statuses = [request("127.0.0.1", gateway.port, "POST", CHAT, question) for _ in range(2)]
    assert [headers["x-gridgate-cache"] for _, headers, _ in statuses][0] == "miss"
    wait_until(lambda: metric_value(gateway.admin_port, "gridgate_cache_index_announced_total") >= before + 1,
               "the claim announced")
    _, _, page = admin_get(gateway.admin_port, "/metrics")
    assert re.search(rb"^gridgate_cache_index_dropped_total 0", page, re.M)


def test_a_stored_keys_cell_is_held_until_the_index_knows_it(tmp_path, valkey_url, monkeypatch):
    """An index that has not heard the announcement yet (authoritative, but nobody writes it here): the
    leader's cell stays taken after its store, so its repeat, on its own worker and on another, reads the
    entry instead of taking the key for unknown; past the hold the cell is free again."""
    monkeypatch.setattr("workers.response_cache._CELL_HOLD_S", 1.0)  # (50 ms: a loaded machine may take longer)

    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        index = CacheIndex.create(1024, 2)
        CacheIndexWriter(index).set_valid_until(asyncio.get_running_loop().time() + 60)  # CLOCK_MONOTONIC
        host = Host.__new__(Host)
        host.index, host.task = index, None
        try:
            async with worker(tmp_path, provider, valkey_url, host, slot=0) as a, \
                    worker(tmp_path, provider, valkey_url, host, slot=1) as b:
                a.path.cache.local = b.path.cache.local = None
                question = body(uuid.uuid4().hex)
                first = await answered(a, question)
                assert first[1] == "miss" and a.path.cache.led_at_once == 1
                assert await answered(a, question) == (200, "hit", first[2])
                assert await answered(b, question) == (200, "hit", first[2])
                assert provider.served == 1 and b.path.cache.led_at_once == 0
                slot = index.place(_digest_of(a)).slot
                assert index.leaders(slot) != index.no_leaders
                await eventually(lambda: index.leaders(slot) == index.no_leaders, timeout=3)
        finally:
            provider.server.close()
    asyncio.run(scenario())
