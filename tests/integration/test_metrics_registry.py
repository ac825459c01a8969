"""/metrics keeps every provider's counts under its own label for the life of the supervisor."""

from __future__ import annotations

import re
import signal
import time

from tests.harness import admin_get, candidate, chat, envelope

OVERLAY = envelope([candidate("model-a", "provider-a"), candidate("model-b", "provider-b")])


def served_2xx(admin_port: int) -> dict[str, float]:
    _, _, body = admin_get(admin_port, "/metrics")
    found = re.findall(rb'^gridgate_requests_total\{cluster="([^"]+)",code="2xx"\} (\S+)$', body, re.M)
    return {cluster.decode(): float(value) for cluster, value in found}


def send(port: int, model: str, count: int) -> None:
    for _ in range(count):
        response = chat(port, model)
        assert response.status == 200 and response.headers["x-gridgate-provider"] == model.replace("model", "provider")


def test_a_reload_that_reorders_clusters_keeps_each_providers_counts_under_its_label(gateway_factory, providers):
    clusters = {name: [providers[name].address] for name in ("provider-a", "provider-b")}
    gateway = gateway_factory(clusters, OVERLAY, workers=1, extra={"timeouts": {"graceful_shutdown": "2s"}})
    send(gateway.port, "model-a", 3)
    send(gateway.port, "model-b", 1)
    assert served_2xx(gateway.admin_port) == {"provider-a": 3.0, "provider-b": 1.0}
    old_workers = gateway.worker_pids()

    gateway.config["clusters"].reverse()  # provider-b first: a change the workers need, so a new generation
    gateway.write_config()
    gateway.signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while gateway.worker_pids() == old_workers or admin_get(gateway.admin_port, "/readyz")[0] != 200:
        assert time.monotonic() < deadline, "the new generation did not take over"
        time.sleep(0.05)

    send(gateway.port, "model-a", 2)
    send(gateway.port, "model-b", 5)
    assert served_2xx(gateway.admin_port) == {"provider-a": 5.0, "provider-b": 6.0}
