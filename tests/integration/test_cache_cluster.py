"""The response cache on a real 3-node Valkey Cluster (docs/cache.md; the bundled valkey-server, this
module's own cluster): tenants' entries in different slots on different nodes, each tenant reading only
its own (isolated) or all sharing one (``tenants: shared``), and coalescing claims made and released in
each key's own slot. Request paths in this process (tests/inprocess.py), real mock providers on loopback.

The questions are chosen so that their keys fall on the nodes the test needs (``gateway.cache.key``'s
``cache_key``, the gateway's own function): which node holds what is then known, not left to chance; the
cluster's keys are read back from each node to prove the entries are where the key says."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import valkey
from valkey.crc import key_slot

from gateway.cache.key import cache_key
from gateway.config.cache import Cache
from tests.harness import candidate, envelope
from tests.inprocess import InProcessGateway, Provider, start_provider
from tests.integration.test_quota_cluster import SLOT_RANGES, cluster_url  # noqa: F401  (a fixture: the cluster)
from tests.integration.test_response_cache import until_stored

FAST_RETRY = {"attempts": 1, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
CHAT = "/v1/chat/completions"
TENANTS = ("team-a", "team-b", "team-c")
ANONYMOUS = "anonymous"  # the tenant of a request without auth


def body(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}


def key_of(tenant: str | None, question: dict[str, Any], shared: bool = False) -> bytes:
    config = Cache(enabled=True, tenants="shared" if shared else "isolated")
    key = cache_key(config, "chat_completions", tenant, "m", json.dumps(question).encode(), {})
    assert key is not None
    return key.key


def node_of(key: bytes) -> int:
    """The index (0..2) of the node that serves ``key``'s slot (the fixture gives node i SLOT_RANGES[i])."""
    slot = key_slot(key)
    return next(index for index, (first, last) in enumerate(SLOT_RANGES) if first <= slot <= last)


def question_where(spread: Callable[[dict[str, Any]], Iterable[bytes]]) -> dict[str, Any]:
    """A question whose keys (``spread(question)``) each fall on a node of their own."""
    for _ in range(1000):
        question = body(uuid.uuid4().hex)
        nodes = [node_of(key) for key in spread(question)]
        if len(set(nodes)) == len(nodes):
            return question
    raise AssertionError("no question spreads its keys over the nodes")


def keys_on_nodes(url: str) -> dict[bytes, int]:
    """Every cache key of the cluster, with the index of the node that holds it (read from each node)."""
    seed = valkey.Valkey.from_url(url.replace("valkey+cluster://", "redis://"))
    try:
        nodes = sorted(((line.split()[1].split("@")[0], line) for line in
                        seed.execute_command("CLUSTER", "NODES").decode().splitlines()), key=lambda item: item[1])
    finally:
        seed.close()
    found: dict[bytes, int] = {}
    for address, _ in nodes:
        host, port = address.rsplit(":", 1)
        node = valkey.Valkey(host=host, port=int(port))
        try:
            for key in node.scan_iter(match=b"gridgate:cache:*", count=1000):
                found[key] = node_of(key)  # a node holds only its own slots' keys: the index is its own
        finally:
            node.close()
    return found


def auth_keys() -> tuple[dict[str, Any], dict[str, str]]:
    secrets = {tenant: f"sk-{tenant}-{uuid.uuid4().hex}" for tenant in TENANTS}
    return ({"keys": [{"tenant": tenant, "key": "sha256:" + hashlib.sha256(secret.encode()).hexdigest()}
                      for tenant, secret in secrets.items()]}, secrets)


async def gateway_on(directory: Path, provider: Provider, url: str, auth: dict[str, Any] | None = None,
                     **cache: Any) -> InProcessGateway:
    """A request path whose cache (``cache``: more of its block) lives on ``url``; ``auth``: its keys."""
    directory.mkdir(exist_ok=True)
    overlay = envelope([candidate("m", provider.name)], "deterministic")
    extra: dict[str, Any] = {"routing": {"retry": FAST_RETRY},
                             "cache": {"enabled": True, "backend": {"url": url}, **cache}}
    if auth is not None:
        extra["auth"] = auth
    return await InProcessGateway.start(directory, {provider.name: [provider.address]}, overlay, extra=extra)


def test_each_tenant_reads_only_its_own_entries_on_their_own_nodes(tmp_path, cluster_url):  # noqa: F811
    """Isolated (the default): one question asked by three tenants makes three entries, one on each node;
    each tenant's repeat is a hit with its own answer's bytes (the mock's answers differ by their id), and
    no tenant's first ask reads another's entry."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        auth, secrets = auth_keys()
        gateway = await gateway_on(tmp_path / "g", provider, cluster_url, auth=auth, local=None)
        try:
            question = question_where(lambda q: [key_of(tenant, q) for tenant in TENANTS])
            firsts: dict[str, bytes] = {}
            for stored, tenant in enumerate(TENANTS, 1):
                answer = await gateway.request("POST", CHAT, question, [("authorization", f"Bearer {secrets[tenant]}")])
                assert (answer.status, answer.headers["x-gridgate-cache"]) == (200, "miss"), tenant
                firsts[tenant] = answer.body
                await until_stored(gateway, stored)
            assert len(set(firsts.values())) == len(TENANTS)  # three answers, told apart by their bytes
            for tenant in TENANTS:
                answer = await gateway.request("POST", CHAT, question, [("authorization", f"Bearer {secrets[tenant]}")])
                assert (answer.headers["x-gridgate-cache"], answer.body) == ("hit", firsts[tenant]), tenant
            assert provider.served == len(TENANTS)
            expected = {key_of(tenant, question): node_of(key_of(tenant, question)) for tenant in TENANTS}
            held = keys_on_nodes(cluster_url)
            assert {key: held.get(key) for key in expected} == expected
            assert sorted(expected.values()) == [0, 1, 2]  # one entry on each node
            assert gateway.path.cache.backend_errors == 0
        finally:
            await gateway.close()
            provider.server.close()
    asyncio.run(scenario())


def test_shared_tenants_share_one_entry_on_a_cluster(tmp_path, cluster_url):  # noqa: F811
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        auth, secrets = auth_keys()
        gateway = await gateway_on(tmp_path / "g", provider, cluster_url, auth=auth, local=None, tenants="shared")
        try:
            question = body(uuid.uuid4().hex)
            answers = []
            for tenant in TENANTS:
                answers.append(await gateway.request("POST", CHAT, question,
                                                     [("authorization", f"Bearer {secrets[tenant]}")]))
                await until_stored(gateway, 1)
            assert [answer.headers["x-gridgate-cache"] for answer in answers] == ["miss", "hit", "hit"]
            assert len({answer.body for answer in answers}) == 1 and provider.served == 1
            assert key_of(None, question, shared=True) in keys_on_nodes(cluster_url)
        finally:
            await gateway.close()
            provider.server.close()
    asyncio.run(scenario())


async def until_claimed(url: str, keys: list[bytes], timeout_s: float = 10.0) -> None:
    """Until each of ``keys`` is on the cluster (a leader's claim marker): a fixed sleep after the leaders
    started was not always enough on a loaded machine, and a request of host b that came before the
    marker led itself (its twin then coalesced on it within b), which is not what the test is about."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not set(keys) <= set(await asyncio.to_thread(keys_on_nodes, url)):  # a thread: the leaders run here
        assert asyncio.get_running_loop().time() < deadline, "the leaders' claims never reached the cluster"
        await asyncio.sleep(0.02)


async def two_hosts(tmp_path: Path, provider: Provider, url: str, **cache: Any) -> tuple[InProcessGateway, ...]:
    """Two request paths (two workers, or two hosts) whose only shared state is the cluster."""
    return (await gateway_on(tmp_path / "a", provider, url, local=None, **cache),
            await gateway_on(tmp_path / "b", provider, url, local=None, **cache))


def three_questions() -> list[dict[str, Any]]:
    """Three questions whose keys (tenant ``anonymous``) fall on the three nodes, one each."""
    questions: list[dict[str, Any]] = []
    while len(questions) < 3:
        question = body(uuid.uuid4().hex)
        if node_of(key_of(ANONYMOUS, question)) not in {node_of(key_of(ANONYMOUS, q)) for q in questions}:
            questions.append(question)
    return questions


def test_coalescing_claims_work_in_each_keys_slot(tmp_path, cluster_url):  # noqa: F811
    """Three leaders on host a, one key on each node; host b's identical requests find each leader's marker
    in its key's slot and wait for its entry: three upstream calls for nine requests, b's answered as hits
    with a's bytes."""
    async def scenario() -> None:
        # The leaders' answers take 1.5 s: b's six requests (0.1 s later) must all still find the markers,
        # even on a machine loaded by the whole suite (at 300 ms some found the entries already stored).
        provider = await start_provider("p", tokens=5, latency_ms=1500)
        a, b = await two_hosts(tmp_path, provider, cluster_url)
        try:
            questions = three_questions()
            leaders = [asyncio.ensure_future(a.request("POST", CHAT, question)) for question in questions]
            await until_claimed(cluster_url, [key_of(ANONYMOUS, question) for question in questions])
            waiters = await asyncio.gather(*(b.request("POST", CHAT, question)
                                             for question in questions for _ in range(2)))
            firsts = [await leader for leader in leaders]
            assert [answer.headers["x-gridgate-cache"] for answer in firsts] == ["miss"] * 3
            assert [answer.headers["x-gridgate-cache"] for answer in waiters] == ["hit"] * 6
            assert [answer.body for answer in waiters] == [first.body for first in firsts for _ in range(2)]
            assert provider.served == 3 and b.path.cache.coalesced == 6
            assert (a.path.cache.backend_errors, b.path.cache.backend_errors) == (0, 0)
        finally:
            await a.close()
            await b.close()
            provider.server.close()
    asyncio.run(scenario())


def test_a_failed_leader_releases_its_claim_in_its_keys_slot(tmp_path, cluster_url):  # noqa: F811
    """The leader's answer is an error: its release (an EVAL routed to its key's node) removes the claim at
    once, so b's waiters go upstream on their own long before the claim's 20 s expiry, none with an error."""
    async def scenario() -> None:
        # The leader fails after 1 s: b's requests must all find its marker first, even on a loaded machine.
        provider = await start_provider("p", tokens=5, latency_ms=1000)
        a, b = await two_hosts(tmp_path, provider, cluster_url, coalesce={"wait": "20s"})
        try:
            provider.state.settings.fail_next = 1
            question = body(uuid.uuid4().hex)
            leader = asyncio.ensure_future(a.request("POST", CHAT, question))
            await until_claimed(cluster_url, [key_of(ANONYMOUS, question)])
            started = asyncio.get_running_loop().time()
            waiters = await asyncio.gather(*(b.request("POST", CHAT, question) for _ in range(3)))
            assert (await leader).status == 503
            assert [answer.status for answer in waiters] == [200] * 3
            assert asyncio.get_running_loop().time() - started < 5
            assert provider.served == 4
            assert key_of(ANONYMOUS, question) not in keys_on_nodes(cluster_url)  # no marker left behind
        finally:
            await a.close()
            await b.close()
            provider.server.close()
    asyncio.run(scenario())
