"""The quota on a Valkey Cluster whose node fails (docs/limits.md, the backend breaker): an admit whose
tenant's slot is on the dead node is answered by the backend policy (here ``reject``) within a fraction
of a second, not after valkey-py's own retries (0.85 s a batch with its default of three). Its own module,
so its own 3-node cluster (the fixture is per module): the test shuts one node down for good."""

from __future__ import annotations

import asyncio
import time
import uuid

from gateway.quota.ledger import key_prefix
from tests.integration.test_cache_cluster import node_of
from tests.integration.test_cache_cluster_outage import node_addresses, shut_down
from tests.integration.test_quota_cluster import _gate, _rule, cluster_url  # noqa: F401  (the fixture)
from tests.integration.test_quota_ledger import admit


def test_admits_to_a_dead_node_fail_fast(cluster_url):  # noqa: F811
    tenant = next(name for name in (f"t-{uuid.uuid4().hex[:8]}" for _ in range(1000))
                  if node_of(key_prefix(name).encode()) == 1)  # its slot on node 1 (not the seed node)

    async def scenario() -> None:
        gate = await _gate(cluster_url, [_rule(tenant, 1_000_000)])
        try:
            assert (await admit(gate, tenant, 10)).allowed
            host, port = node_addresses(cluster_url)[1]
            shut_down(host, port)
            took = []
            for _ in range(5):
                started = time.monotonic()
                admission = await admit(gate, tenant, 10)
                took.append(time.monotonic() - started)
                assert not admission.allowed and admission.reason == "backend_error_rejected"
                await asyncio.sleep(0.2)
            assert max(took) < 0.6, took  # one attempt (and valkey-py's one 0.25 s pause), then the breaker
        finally:
            await gate.close()
    asyncio.run(scenario())
