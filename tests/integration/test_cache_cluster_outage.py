"""A node of the cache's Valkey Cluster fails (docs/cache.md, "When Valkey is down"): every request is still
answered, by its provider, never with an error. Its own module, so its own 3-node cluster (the fixture is
per module): the test shuts one node down for good."""

from __future__ import annotations

import asyncio
import time

import valkey

from tests.inprocess import start_provider
from tests.integration.test_cache_cluster import ANONYMOUS, CHAT, gateway_on, key_of, node_of, three_questions
from tests.integration.test_cache_cluster import until_stored as stored
from tests.integration.test_quota_cluster import cluster_url  # noqa: F401  (a fixture: this module's cluster)


def node_addresses(url: str) -> list[tuple[str, int]]:
    """The nodes' addresses, in the order of the slot ranges they serve (node i: SLOT_RANGES[i])."""
    seed = valkey.Valkey.from_url(url.replace("valkey+cluster://", "redis://"))
    try:
        lines = seed.execute_command("CLUSTER", "NODES").decode().splitlines()
    finally:
        seed.close()
    by_first_slot = {}
    for line in lines:
        parts = line.split()
        host, port = parts[1].split("@")[0].rsplit(":", 1)
        by_first_slot[int(parts[8].split("-")[0])] = (host, int(port))
    return [by_first_slot[first] for first in sorted(by_first_slot)]


def shut_down(host: str, port: int) -> None:
    """Stop one cluster node for good (SHUTDOWN NOSAVE): the outage the tests that import this meet."""
    node = valkey.Valkey(host=host, port=port)
    try:
        node.execute_command("SHUTDOWN", "NOSAVE")
    except valkey.ConnectionError:
        pass  # the node went away before it could answer: as asked
    finally:
        node.close()


def test_a_failed_node_never_errors_a_request(tmp_path, cluster_url):  # noqa: F811
    """Entries on all three nodes; one node shut down: its key's request and every other one are answered
    200 by the provider (bypass, or a hit from a node still up before the cluster marks itself failed), each
    within a second (no hang on the dead node), for 4 s; then, the live nodes calling the cluster down, a
    request for a key of theirs is a bypass within 0.6 s (valkey-py's own three retries made it 1.1 s)."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_on(tmp_path / "g", provider, cluster_url, local=None)
        try:
            questions = three_questions()
            for count, question in enumerate(questions, 1):
                assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "miss"
                await stored(gateway, count)
            for question in questions:
                assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "hit"
            served = provider.served
            victim = next(q for q in questions if node_of(key_of(ANONYMOUS, q)) == 1)  # not the seed node (0)
            node_addresses_seen = node_addresses(cluster_url)
            host, port = node_addresses_seen[1]
            shut_down(host, port)
            states: list[str] = []
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                for question in (victim, *questions):
                    started = time.monotonic()
                    answer = await gateway.request("POST", CHAT, question)
                    assert answer.status == 200, answer
                    assert time.monotonic() - started < 1.0
                    states.append(answer.headers["x-gridgate-cache"])
                await asyncio.sleep(0.05)
            assert "bypass" in states and set(states) <= {"bypass", "hit", "miss"}
            assert provider.served - served == states.count("bypass") + states.count("miss")
            assert gateway.path.cache.backend_errors >= 1
            # Once the live nodes call the cluster down, a key of theirs is refused CLUSTERDOWN: one attempt
            # (valkey-py's 0.25 s pause before it raises), not its default three retries (about 1 s).
            live = valkey.Valkey(host=node_addresses_seen[0][0], port=node_addresses_seen[0][1])
            try:
                deadline = time.monotonic() + 15
                while b"cluster_state:fail" not in live.execute_command("CLUSTER", "INFO"):
                    assert time.monotonic() < deadline, "the cluster never marked itself failed"
                    await asyncio.sleep(0.1)
            finally:
                live.close()
            await asyncio.sleep(1.1)  # past the cache's bypass after the last failure
            elsewhere = next(q for q in questions if node_of(key_of(ANONYMOUS, q)) == 0)
            started = time.monotonic()
            answer = await gateway.request("POST", CHAT, elsewhere)
            assert (answer.status, answer.headers["x-gridgate-cache"]) == (200, "bypass")
            assert time.monotonic() - started < 0.6
        finally:
            await gateway.close()
            provider.server.close()
    asyncio.run(scenario())
