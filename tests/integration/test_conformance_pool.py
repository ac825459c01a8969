"""``routing.conformance`` through a real gateway: the supervisor's checks find the provider that breaks a
promise, the workers leave it out of selection (reason ``nonconformant`` in the route evidence,
``/admin/providers`` and a metric) until a recheck finds it conformant again."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from typing import Any

from tests.harness import admin_get, candidate, chat, envelope, metric_value, wait_until
from tests.integration.test_route_evidence import line_of


def providers_report(gateway) -> dict[str, dict[str, Any]]:
    status, _, body = admin_get(gateway.admin_port, "/admin/providers")
    return {p["cluster"]: p for p in json.loads(body)["providers"]} if status == 200 else {}


def set_faults(mock, faults: str) -> None:
    request = urllib.request.Request(f"{mock.base_url}/admin/config", json.dumps({"nonconformance": faults}).encode(),
                                     method="POST")
    urllib.request.urlopen(request, timeout=5).close()


def test_a_nonconformant_provider_is_left_out_until_it_passes(mock_provider, gateway_factory):
    good = mock_provider("good", models="m")
    faulty = mock_provider("faulty", models="m", nonconformance="no_done")
    overlay = envelope([candidate("m", "good"), candidate("m", "faulty")], "roundRobin")
    gateway = gateway_factory({"good": [good.address], "faulty": [faulty.address]}, overlay, extra={
        "access_log": {"path": "access.log", "evidence_sample": 1.0},
        "routing": {"conformance": {"recheck": "1h", "timeout": "5s"}},
    })
    wait_until(lambda: providers_report(gateway).get("faulty", {}).get("excluded"), "the faulty provider left out")
    report = providers_report(gateway)
    assert report["good"]["status"] == "conformant" and not report["good"]["excluded"]
    assert report["faulty"]["status"] == "nonconformant"
    assert report["faulty"]["failed_checks"] == ["chat_stream"]
    assert metric_value(gateway.admin_port, 'gridgate_provider_nonconformant{cluster="faulty"}') == 1.0

    # The workers refresh their provider view a few times a second: after that, only "good" serves.
    wait_until(lambda: all(chat(gateway.port, "m").headers["x-gridgate-provider"] == "good" for _ in range(4)),
               "every request on the conformant provider")
    served = [chat(gateway.port, "m", headers=[("X-Request-Id", f"r{i}")]) for i in range(6)]
    assert [(r.status, r.headers["x-gridgate-provider"]) for r in served] == [(200, "good")] * 6
    line = line_of(os.path.join(gateway.directory, "access.log"), "r0")
    assert line["excluded"] == {"nonconformant": 1}

    set_faults(faulty, "")  # repaired; a reload checks again at once (as the recheck would, later)
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: providers_report(gateway).get("faulty", {}).get("status") == "conformant",
               "the repaired provider found conformant")
    assert not providers_report(gateway)["faulty"]["excluded"]
    wait_until(lambda: {chat(gateway.port, "m").headers["x-gridgate-provider"] for _ in range(6)} == {"good", "faulty"},
               "the repaired provider back in selection")
    assert metric_value(gateway.admin_port, 'gridgate_provider_nonconformant{cluster="faulty"}') == 0.0


def test_required_false_reports_without_acting(mock_provider, gateway_factory):
    good = mock_provider("good", models="m")
    faulty = mock_provider("faulty", models="m", nonconformance="no_stream_usage")
    overlay = envelope([candidate("m", "good"), candidate("m", "faulty")], "roundRobin")
    gateway = gateway_factory({"good": [good.address], "faulty": [faulty.address]}, overlay, extra={
        "routing": {"conformance": {"required": False, "timeout": "5s"}},
    })
    wait_until(lambda: providers_report(gateway).get("faulty", {}).get("status") == "nonconformant",
               "the faulty provider checked")
    assert providers_report(gateway)["faulty"]["excluded"] is False
    assert {chat(gateway.port, "m").headers["x-gridgate-provider"] for _ in range(6)} == {"good", "faulty"}


def test_without_conformance_nothing_is_checked(providers, gateway_factory):
    overlay = envelope([candidate("m", "provider-a")], "roundRobin")
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay)
    status, _, body = admin_get(gateway.admin_port, "/admin/providers")
    assert status == 200
    answer = json.loads(body)
    assert answer["conformance"] is None and answer["providers"][0]["status"] == "unchecked"
    assert b"gridgate_provider_nonconformant" not in admin_get(gateway.admin_port, "/metrics")[2]
