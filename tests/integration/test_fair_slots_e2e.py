"""Fair upstream slots end to end (docs/configuration.md#tenants): a batch tenant's burst against a
provider with two connection slots does not hold back an interactive tenant's request, nor another
batch tenant's first request, by more than one slot's turn."""

from __future__ import annotations

import json
import threading
import time

from gateway.identity.auth import hash_api_key
from tests.harness import admin_get, candidate, chat, envelope

LATENCY_MS = 300  # one slot's turn: long beside the gateway's own work, short enough for a quick test
KEYS = {"bulk": "sk-bulk", "bulk-2": "sk-bulk-2", "app": "sk-app"}


def _in_flight(gateway) -> int:
    """Requests the gateway holds for the provider, those waiting for a connection slot included."""
    report = json.loads(admin_get(gateway.admin_port, "/admin/endpoints")[2])
    return sum(endpoint["in_flight"] for cluster in report["clusters"] for endpoint in cluster["endpoints"])


def _wait_in_flight(gateway, count: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _in_flight(gateway) < count:
        assert time.monotonic() < deadline, f"never {count} requests in flight"
        time.sleep(0.005)


def test_batch_burst_delays_interactive_and_other_tenants_by_at_most_one_slot_turn(mock_provider, gateway_factory):
    slow = mock_provider("slow", latency_ms=LATENCY_MS)
    gateway = gateway_factory(
        {"p": [slow.address]}, envelope([candidate("m", "p")]), workers=1,  # slots are fair per worker
        cluster_options={"max_connections": 2, "connect_timeout": "10s"},  # the whole burst may wait
        extra={
            "auth": {"keys": [{"tenant": tenant, "key": hash_api_key(key)} for tenant, key in KEYS.items()]},
            "tenants": [{"tenant": "bulk", "priority": "batch"}, {"tenant": "bulk-2", "priority": "batch"}],
        },
    )
    finished: list[tuple[str, int]] = []  # (tenant, status) in the order the answers arrived

    def send(tenant: str) -> threading.Thread:
        def run() -> None:
            status = chat(gateway.port, "m", headers=[("Authorization", f"Bearer {KEYS[tenant]}")]).status
            finished.append((tenant, status))

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    threads = [send("bulk") for _ in range(16)]
    _wait_in_flight(gateway, 16)  # two on the provider, fourteen waiting for a slot
    threads.append(send("app"))
    _wait_in_flight(gateway, 17)
    threads.append(send("bulk-2"))
    for thread in threads:
        thread.join(timeout=20)
    assert len(finished) == 18 and all(status == 200 for _, status in finished), finished

    order = [tenant for tenant, _ in finished]
    # The interactive request takes the first slot that frees: only the two burst requests on the provider
    # when it arrived, and the one taking the other slot of that turn, may answer before it (FIFO: 16).
    assert order.index("app") <= 3, order
    # The other batch tenant's first request waits behind the interactive one and one turn of the burst.
    assert order.index("bulk-2") <= 5, order
