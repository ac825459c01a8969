"""`gridgate control` with `conformance`: the control plane runs the conformance checks off its rounds,
publishes a provider that failed one as excluded (`admission_state: none`, `excluded_reason:
nonconformant`), and a gateway following its overlay sends that provider nothing, with the reason in
route evidence; repaired, a recheck brings it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from gateway.overlay.reasons import OverlayRejected
from gateway.overlay.snapshot import snapshot_from_bytes
from tests.harness import candidate, chat, envelope, free_port, mock_served, request, wait_until
from tests.integration.test_route_evidence import line_of

SCOPE = {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "east"}


def set_faults(mock, faults: str) -> None:
    request = urllib.request.Request(f"{mock.base_url}/admin/config", json.dumps({"nonconformance": faults}).encode(),
                                     method="POST")
    urllib.request.urlopen(request, timeout=5).close()


def candidates(path: str) -> dict[str, dict]:
    try:
        data = Path(path).read_bytes()
        snapshot_from_bytes(data, SCOPE)  # the data plane's own validator accepts it
        document = json.loads(data)
    except (OSError, ValueError, OverlayRejected):
        return {}
    if document.get("provenance", {}).get("producer") != "gridgate-control":
        return {}
    return {c["cluster"]: c for c in document["overlay"]["candidates"]}


def test_control_plane_excludes_a_nonconformant_provider_until_it_passes(mock_provider, gateway_factory,
                                                                          tmp_path) -> None:
    good = mock_provider("good", models="m")
    faulty = mock_provider("faulty", models="m", nonconformance="no_done")
    gateway = gateway_factory({"good": [good.address], "faulty": [faulty.address]},
                              envelope([candidate("m", "good")], network="net", local_site="east"), start=False,
                              extra={"access_log": {"path": "access.log", "evidence_sample": 1.0}})
    spec = {"output": gateway.overlay_path, "scope": SCOPE, "interval": "200ms", "probe_timeout": "200ms",
            "scoringPolicy": {"strategy": "noMetrics"}, "selectionPolicy": {"mode": "roundRobin"},
            "providers": [{"name": h.name, "site": "east", "models": ["m"], "health_url": f"{h.base_url}/health"}
                          for h in (good, faulty)],
            "conformance": {"gateway_config": gateway.config_path, "recheck": "1s", "timeout": "5s"},
            "metrics_listen": f"127.0.0.1:{free_port()}"}
    spec_path = tmp_path / "control.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    log = open(tmp_path / "control.log", "w")
    control = subprocess.Popen([sys.executable, "-m", "gateway", "control", "-c", str(spec_path)], stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        published = wait_until(lambda: (found := candidates(gateway.overlay_path)).get("faulty", {}).get(
            "excluded_reason") and found, "the faulty provider published excluded", timeout=20)
        assert published["faulty"]["admission_state"] == "none"
        assert published["good"]["admission_state"] == "new_and_existing" and "excluded_reason" not in published["good"]
        gateway.start()
        before = mock_served(faulty)
        served = [chat(gateway.port, "m", headers=[("X-Request-Id", f"r{i}")]) for i in range(6)]
        assert [(r.status, r.headers["x-gridgate-provider"]) for r in served] == [(200, "good")] * 6
        assert mock_served(faulty) == before  # zero requests reached it
        line = line_of(os.path.join(gateway.directory, "access.log"), "r0")
        assert line["excluded"] == {"nonconformant": 1}
        host, port = spec["metrics_listen"].split(":")
        page = request(host, int(port), "GET", "/metrics")[2].decode()
        assert 'gridgate_control_provider_nonconformant{provider="faulty"} 1.0' in page
        assert 'gridgate_control_provider_nonconformant{provider="good"} 0.0' in page

        set_faults(faulty, "")  # repaired: the next recheck (1 s) finds it conformant
        wait_until(lambda: candidates(gateway.overlay_path).get("faulty", {}).get("admission_state")
                   == "new_and_existing", "the repaired provider published admitted again", timeout=20)
        assert "excluded_reason" not in candidates(gateway.overlay_path)["faulty"]
        wait_until(lambda: {chat(gateway.port, "m").headers["x-gridgate-provider"] for _ in range(6)}
                   == {"good", "faulty"}, "the repaired provider back in selection", timeout=10)
    finally:
        control.terminate()
        control.wait(10)
        log.close()
    text = (tmp_path / "control.log").read_text()
    assert "faulty is nonconformant (failed chat_stream)" in text and "faulty is conformant again" in text
