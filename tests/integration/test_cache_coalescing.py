"""Coalescing across workers and hosts (docs/cache.md, "Coalescing"): the miss's one lookup command
(``SET key marker NX PX <wait> GET``) claims the key, so identical requests on other workers and hosts wait
for the leader's entry instead of each reaching a provider. A real two-worker gateway with a slow mock
provider in its own process; and two request paths in one process on the same real Valkey (two workers or
hosts, deterministically: which one leads is known) for a failed leader and the bound of waiters."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.harness import admin_get, candidate, envelope, request
from tests.inprocess import InProcessGateway, Provider, start_provider
from tests.integration.test_quota_cluster import cluster_url  # noqa: F401  (a fixture: a real Valkey Cluster)

FAST_RETRY = {"attempts": 1, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
CHAT = "/v1/chat/completions"


def body(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}


def served_chats(port: int) -> int:
    _, _, page = admin_get(port, "/metrics")
    found = re.search(rb'^mock_requests_served_total\{[^}]*endpoint="chat"\} (\S+)', page, re.M)
    return 0 if found is None else int(float(found.group(1)))


def test_identical_requests_on_two_workers_share_one_upstream_call(gateway_factory, mock_provider, valkey_url):
    """N identical requests at once on a two-worker gateway, each on its own connection (the kernel spreads
    them over both workers): one reaches the provider, every answer is the same bytes."""
    provider = mock_provider("slow", latency_ms=600)
    cache = {"enabled": True, "backend": {"url": valkey_url}}
    gateway = gateway_factory({"slow": [provider.address]}, envelope([candidate("m", "slow")], "deterministic"),
                              workers=2, extra={"cache": cache, "routing": {"retry": FAST_RETRY}})
    question = body(uuid.uuid4().hex)
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: request("127.0.0.1", gateway.port, "POST", CHAT, question), range(12)))
    assert [status for status, _, _ in answers] == [200] * 12
    assert len({payload for _, _, payload in answers}) == 1
    assert sorted(headers["x-gridgate-cache"] for _, headers, _ in answers) == ["hit"] * 11 + ["miss"]
    assert served_chats(provider.port) == 1


async def two_paths(tmp_path: Path, provider: Provider, valkey_url: str,
                    coalesce: dict[str, Any] | None = None) -> tuple[InProcessGateway, InProcessGateway]:
    """Two workers' request paths (or two hosts') on one Valkey: the cache's only shared state."""
    overlay = envelope([candidate("m", provider.name)], "deterministic")
    config = {"routing": {"retry": FAST_RETRY},
              "cache": {"enabled": True, "backend": {"url": valkey_url}, "coalesce": coalesce or {}}}
    paths = []
    for name in ("a", "b"):
        directory = tmp_path / name
        directory.mkdir()
        paths.append(await InProcessGateway.start(directory, {provider.name: [provider.address]}, overlay,
                                                  extra=config))
    return paths[0], paths[1]


def test_a_failed_leader_on_another_worker_releases_the_waiters_at_once(tmp_path, valkey_url):
    """The leader (worker a) gets an error: it removes its claim, so worker b's waiters go upstream on their
    own at once (no client error on b, no wait for the claim's expiry)."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5, latency_ms=300)
        a, b = await two_paths(tmp_path, provider, valkey_url, {"wait": "20s"})
        try:
            provider.state.settings.fail_next = 1
            question = body(uuid.uuid4().hex)
            leader = asyncio.ensure_future(a.request("POST", CHAT, question))
            await asyncio.sleep(0.1)  # a has claimed the key
            started = time.monotonic()
            waiters = await asyncio.gather(*(b.request("POST", CHAT, question) for _ in range(3)))
            assert (await leader).status == 503
            assert [answer.status for answer in waiters] == [200] * 3
            assert time.monotonic() - started < 5  # released by the leader, not by the 20 s claim
            assert provider.served == 4 and b.path.cache.stored == 0
        finally:
            await a.close()
            await b.close()
            provider.server.close()
    asyncio.run(scenario())


def test_waiters_on_another_worker_get_the_leaders_answer_within_their_bound(tmp_path, valkey_url):
    """Worker b's waiters of worker a's leader: at most max_waiters wait (answered as hits with the leader's
    bytes); the ones beyond go upstream on their own."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5, latency_ms=300)
        a, b = await two_paths(tmp_path, provider, valkey_url, {"max_waiters": 2})
        try:
            question = body(uuid.uuid4().hex)
            leader = asyncio.ensure_future(a.request("POST", CHAT, question))
            await asyncio.sleep(0.1)
            others = await asyncio.gather(*(b.request("POST", CHAT, question) for _ in range(4)))
            first = await leader
            assert first.headers["x-gridgate-cache"] == "miss"
            assert sorted(answer.headers["x-gridgate-cache"] for answer in others) == ["hit", "hit", "miss", "miss"]
            assert all(answer.body == first.body for answer in others
                       if answer.headers["x-gridgate-cache"] == "hit")
            assert provider.served == 3  # the leader and the two beyond the bound
        finally:
            await a.close()
            await b.close()
            provider.server.close()
    asyncio.run(scenario())


def test_the_claim_and_its_release_work_on_a_valkey_cluster(cluster_url):  # noqa: F811
    """On Valkey Cluster (valkey-py routes each command by its key; no SET reply callback turns the claim's
    reply into a bool): the first claim leads, the second finds the marker, the stored entry is read back
    by a claim, and a release removes only its own marker."""
    from gateway.valkey.client import create_client
    from gateway.valkey.tick_batch import TickBatch
    from workers.response_cache import _RELEASE, PENDING

    async def scenario() -> None:
        client = create_client(cluster_url)
        batch = TickBatch(client)
        try:
            for key in (b"gridgate:cache:%d" % n for n in range(4)):  # a few slots, so more than one node
                marker = PENDING + b"1:1"

                def claim(value: bytes, name: bytes = key) -> Any:
                    return batch.call(b"SET", name, value, b"NX", b"PX", b"5000", b"GET")

                assert await claim(marker) is None
                assert await claim(PENDING + b"2:1") == marker
                assert await batch.call(b"EVAL", _RELEASE, 1, key, PENDING + b"2:1") == 0  # not its own
                assert await batch.call(b"EVAL", _RELEASE, 1, key, marker) == 1
                assert await claim(marker) is None
                await batch.call(b"SET", key, b"\x99entry", b"PX", b"5000")
                assert await claim(marker) == b"\x99entry"
                await batch.call(b"DEL", key)
        finally:
            await client.aclose()
    asyncio.run(scenario())
