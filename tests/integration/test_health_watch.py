"""The supervisor watches the health process's heartbeat (docs/operations.md, "The health process"): a
real gateway with active checks, whose real health process is made to hang with SIGSTOP."""

from __future__ import annotations

import json
import os
import signal

from gateway.health.watch import HUNG_AFTER_S, VERDICT_MAX_AGE_S
from tests.harness import (
    admin_get,
    alive,
    candidate,
    chat,
    envelope,
    metric_value,
    mock_served,
    request,
    wait_until,
)

CHECKS = {"health_check": {"type": "http", "path": "/health", "interval": "200ms", "timeout": "150ms",
                           "healthy_threshold": 1, "unhealthy_threshold": 1}}


def endpoints_report(gateway) -> dict:
    status, _, body = admin_get(gateway.admin_port, "/admin/endpoints")
    assert status == 200, body
    return json.loads(body)


def health_words(gateway) -> dict[str, str]:
    return {e["address"]: e["health"] for e in endpoints_report(gateway)["clusters"][0]["endpoints"]}


def to_down(gateway, down, requests: int = 10) -> int:
    """Requests (each on a fresh connection: both workers answer) that reached the unhealthy endpoint."""
    before = mock_served(down)
    for _ in range(requests):
        assert chat(gateway.port, "m").status == 200
    return mock_served(down) - before


def test_a_hung_health_process_has_its_verdicts_read_as_unknown_and_is_replaced(mock_provider, gateway_factory):
    up, down = mock_provider("up"), mock_provider("down")
    status, _, _ = request("127.0.0.1", down.port, "POST", "/admin/health", {"status": 503})
    assert status == 200
    gateway = gateway_factory({"provider": [up.address, down.address]}, envelope([candidate("m", "provider")]),
                              workers=2, cluster_options=CHECKS)
    wait_until(lambda: health_words(gateway)[down.address] == "unhealthy", "the failing endpoint taken out")
    assert to_down(gateway, down) == 0
    prober = endpoints_report(gateway)["health_process"]["pid"]
    os.kill(prober, signal.SIGSTOP)  # hung: alive, but its loop no longer runs
    try:
        # Past VERDICT_MAX_AGE_S its verdicts are not trusted: both endpoints are routable, as without checks.
        wait_until(lambda: metric_value(gateway.admin_port, "gridgate_health_verdicts_stale") == 1,
                   "the verdicts marked stale", timeout=VERDICT_MAX_AGE_S + 5)
        assert metric_value(gateway.admin_port, "gridgate_health_verdict_age_seconds") > VERDICT_MAX_AGE_S
        assert endpoints_report(gateway)["health_process"]["verdicts_stale"] is True
        assert to_down(gateway, down) > 0
        # Past HUNG_AFTER_S the supervisor kills it; the replacement adopts the records and beats.
        wait_until(lambda: endpoints_report(gateway)["health_process"]["pid"] != prober, "a new health process",
                   timeout=HUNG_AFTER_S + 10)
        wait_until(lambda: not alive(prober), "the hung one gone")
        wait_until(lambda: metric_value(gateway.admin_port, "gridgate_health_verdicts_stale") == 0,
                   "fresh verdicts again")
        assert metric_value(gateway.admin_port, "gridgate_health_verdict_age_seconds") < 1.0
        assert metric_value(gateway.admin_port, "gridgate_health_process_hangs_total") == 1
        assert health_words(gateway)[down.address] == "unhealthy"  # adopted: still out
        assert to_down(gateway, down) == 0
        assert "sent no heartbeat for" in gateway.log()
    finally:
        if alive(prober):
            os.kill(prober, signal.SIGCONT)
