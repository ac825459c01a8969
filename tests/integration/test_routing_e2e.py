"""The intelligent route end to end: real gateway, real providers, overlay reloads."""

from __future__ import annotations

import json
import signal
import time

from tests.harness import Client, admin_get, candidate, chat, envelope, request, write_json_atomic

CLUSTERS = ("provider-a", "provider-b", "provider-c")


def _clusters(providers) -> dict[str, list[str]]:
    return {name: [providers[name].address] for name in CLUSTERS}


# The mock's echo page, which these tests read back: a route beyond the defaults (docs/security.md).
ECHO_ROUTE = {"allowed_routes": ["POST /debug/echo"]}


def _wait_revision(gateway, revision: str, timeout: float = 3.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        _, _, body = admin_get(gateway.admin_port, "/admin/overlay")
        if body:
            data = json.loads(body)
            if data["workers"] and all(w["serving_revision"] == revision for w in data["workers"]):
                return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"workers did not converge on {revision}: {body!r}")


def _rejected_reloads(gateway) -> float:
    """``gridgate_overlay_reloads_total{result="rejected"}``: overlay re-reads the workers refused."""
    _, _, body = admin_get(gateway.admin_port, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith('gridgate_overlay_reloads_total{result="rejected"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_every_worker_refused(gateway, reason: str, timeout: float = 3.0) -> None:
    """Until each worker logged that it read the overlay and refused it for ``reason``: the positive sign
    that the reload ran everywhere, before anything is said about what did not change."""
    deadline = time.monotonic() + timeout
    for pid in gateway.worker_pids():
        while f"[{pid}]: overlay rejected ({reason}" not in gateway.log():
            assert time.monotonic() < deadline, f"worker {pid} never refused the overlay: {gateway.log()[-2000:]}"
            time.sleep(0.02)


def test_round_robin_over_one_connection_is_exact_and_repeating(providers, gateway_factory):
    overlay = envelope([candidate("m", name) for name in CLUSTERS], mode="roundRobin")
    gateway = gateway_factory(_clusters(providers), overlay, workers=1)
    client = Client(gateway.port)
    order = [client.request("POST", "/v1/chat/completions", {"model": "m"}).headers["x-mock-provider"]
             for _ in range(60)]
    client.close()
    assert {name: order.count(name) for name in CLUSTERS} == {name: 20 for name in CLUSTERS}
    assert order == order[:3] * 20
    assert sorted(order[:3]) == sorted(CLUSTERS)


def test_route_evidence_headers(providers, loopback_gateway_factory):
    overlay = envelope([candidate("m", "provider-a", group=0), candidate("m", "provider-b", group=1)],
                       mode="deterministic")
    gateway = loopback_gateway_factory(_clusters(providers), overlay)
    response = chat(gateway.port, "m", headers=[("X-Gridgate-Affinity", "spoofed")])
    assert response.status == 200
    headers = response.headers
    assert headers["x-gridgate-provider"] == "provider-a"
    assert headers["x-gridgate-stable-id"] == "provider-a-m"
    assert headers["x-gridgate-selection-group"] == "0"
    assert headers["x-gridgate-selection-mode"] == "deterministic"
    assert headers["x-gridgate-overlay-revision"] == overlay["revision"]["value"]
    assert headers["x-gridgate-affinity"] == "none"
    assert float(headers["x-gridgate-overhead-ms"]) > 0
    assert headers["x-request-id"]


def test_unavailable_best_group_falls_through_and_nothing_admissible_is_503(providers, loopback_gateway_factory):
    overlay = envelope([
        candidate("m", "provider-a", group=0, admission="none"),
        candidate("m", "provider-b", group=1),
        candidate("closed", "provider-c", group=0, admission="existing_only"),
    ])
    gateway = loopback_gateway_factory(_clusters(providers), overlay)
    assert chat(gateway.port, "m").headers["x-mock-provider"] == "provider-b"
    response = chat(gateway.port, "closed")
    assert response.status == 503
    assert response.json()["error"]["code"] == "no_admissible"


def test_provider_hop_headers_only_for_listed_clusters(providers, loopback_gateway_factory):
    overlay = envelope([candidate("m", "provider-a"), candidate("n", "provider-b")])
    gateway = loopback_gateway_factory(_clusters(providers), overlay, extra={"routing": {"provider_hop_clusters": ["provider-a"]}},
                              cluster_options=ECHO_ROUTE)
    status, _, body = request("127.0.0.1", gateway.port, "POST", "/debug/echo", b"{}",
                              headers=[("X-Model", "m"), ("X-Request-Id", "hop-1"),
                                       ("X-Ai-Routing-Revision", "spoofed")])
    assert status == 200
    echoed = {k.lower(): v for k, v in json.loads(body)["headers"]}
    assert echoed["x-ai-routing-candidate"] == "provider-a-m"
    assert echoed["x-ai-routing-request-id"] == "hop-1"
    assert echoed["x-ai-routing-revision"] == overlay["revision"]["value"]
    status, _, body = request("127.0.0.1", gateway.port, "POST", "/debug/echo", b"{}",
                              headers=[("X-Model", "n"), ("X-Ai-Routing-Candidate", "spoofed")])
    echoed = {k.lower(): v for k, v in json.loads(body)["headers"]}
    assert not any(name.startswith("x-ai-routing-") for name in echoed)


def test_mcp_tools_call_routes_by_tool_name(providers, loopback_gateway_factory):
    overlay = envelope([
        candidate("search", "provider-b", kind="mcp_tool"),
        candidate("m", "provider-a"),
    ])
    gateway = loopback_gateway_factory(_clusters(providers), overlay, cluster_options=ECHO_ROUTE)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search", "arguments": {}}}
    status, headers, _ = request("127.0.0.1", gateway.port, "POST", "/debug/echo", body,
                                 headers=[("Content-Type", "application/json"), ("X-Model", "m")])
    assert status == 200
    assert headers["x-gridgate-provider"] == "provider-b"


def test_affinity_holds_across_workers_and_new_connections(providers, gateway_factory):
    overlay = envelope([candidate("m", name) for name in CLUSTERS], mode="roundRobin")
    gateway = gateway_factory(_clusters(providers), overlay, workers=2,
                              extra={"routing": {"session_affinity": {"enabled": True, "header": "X-Session-Id"}}})
    assert len(gateway.worker_pids()) == 2
    for session in ("alpha", "beta", "gamma", "delta"):
        outcomes, providers_seen = [], set()
        for _ in range(12):  # a new connection each time: SO_REUSEPORT spreads them over workers
            response = chat(gateway.port, "m", headers=[("X-Session-Id", session)])
            outcomes.append(response.headers["x-gridgate-affinity"])
            providers_seen.add(response.headers["x-mock-provider"])
        assert outcomes[0] == "new" and set(outcomes[1:]) == {"reused"}, outcomes
        assert len(providers_seen) == 1
    without = chat(gateway.port, "m")
    assert without.headers["x-gridgate-affinity"] == "none"


def test_existing_only_keeps_sessions_and_gets_no_new_ones(providers, gateway_factory):
    members = [candidate("m", name) for name in CLUSTERS]
    overlay = envelope(members, mode="roundRobin")
    gateway = gateway_factory(_clusters(providers), overlay, workers=2,
                              extra={"routing": {"session_affinity": {"enabled": True, "header": "X-Session-Id"},
                                                 "reload_debounce": "100ms"}})
    bound = {}
    for index in range(9):
        session = f"s{index}"
        bound[session] = chat(gateway.port, "m", headers=[("X-Session-Id", session)]).headers["x-mock-provider"]
    drained = bound["s0"]
    # Move the drained provider to its own group 0 with existing_only; the others form group 1.
    regrouped = [candidate("m", drained, group=0, admission="existing_only")] + [
        candidate("m", name, group=1) for name in CLUSTERS if name != drained
    ]
    new_overlay = envelope(regrouped, mode="roundRobin", generation=2)
    write_json_atomic(gateway.overlay_path, new_overlay)
    _wait_revision(gateway, new_overlay["revision"]["value"])
    for session, provider in bound.items():
        response = chat(gateway.port, "m", headers=[("X-Session-Id", session)])
        assert response.headers["x-mock-provider"] == provider
        assert response.headers["x-gridgate-affinity"] == "reused"
    for index in range(12):
        response = chat(gateway.port, "m", headers=[("X-Session-Id", f"new{index}")])
        assert response.headers["x-mock-provider"] != drained
        assert response.headers["x-gridgate-affinity"] == "new"


def test_reload_converges_and_invalid_overlay_keeps_last_known_good(providers, gateway_factory):
    overlay = envelope([candidate("m", "provider-a")])
    gateway = gateway_factory(_clusters(providers), overlay, workers=2,
                              extra={"routing": {"reload_debounce": "100ms"}})
    first = overlay["revision"]["value"]
    _wait_revision(gateway, first)
    updated = envelope([candidate("m", "provider-b")], generation=2)
    write_json_atomic(gateway.overlay_path, updated)
    elapsed = _wait_revision(gateway, updated["revision"]["value"])
    assert elapsed < 1.5
    assert chat(gateway.port, "m").headers["x-mock-provider"] == "provider-b"

    # Invalid overlays: each worker reads and refuses it (logged, counted), then keeps the last good one.
    assert _rejected_reloads(gateway) == 0
    broken = envelope([candidate("m", "provider-c")], generation=3)
    broken["content_digest"]["value"] = "0" * 64
    write_json_atomic(gateway.overlay_path, broken)
    _wait_every_worker_refused(gateway, "digest_mismatch")
    _wait_revision(gateway, updated["revision"]["value"])
    assert chat(gateway.port, "m").headers["x-mock-provider"] == "provider-b"
    with open(gateway.overlay_path, "w") as handle:
        handle.write("{ not json")
    gateway.signal(signal.SIGHUP)
    _wait_every_worker_refused(gateway, "malformed_structure")
    _wait_revision(gateway, updated["revision"]["value"])
    assert chat(gateway.port, "m").headers["x-mock-provider"] == "provider-b"
    assert _rejected_reloads(gateway) >= 4  # two refusals by each of the two workers


def test_symlink_swap_is_followed(providers, gateway_factory, tmp_path):
    import os

    first = envelope([candidate("m", "provider-a")])
    second = envelope([candidate("m", "provider-c")], generation=2)
    gateway = gateway_factory(_clusters(providers), first, start=False,
                              extra={"routing": {"reload_debounce": "100ms"}})
    directory = os.path.dirname(gateway.overlay_path)
    write_json_atomic(os.path.join(directory, "v1.json"), first)
    write_json_atomic(os.path.join(directory, "v2.json"), second)
    os.remove(gateway.overlay_path)
    os.symlink("v1.json", gateway.overlay_path)
    gateway.start()
    assert chat(gateway.port, "m").headers["x-mock-provider"] == "provider-a"
    os.symlink("v2.json", gateway.overlay_path + ".new")
    os.replace(gateway.overlay_path + ".new", gateway.overlay_path)
    _wait_revision(gateway, second["revision"]["value"])
    assert chat(gateway.port, "m").headers["x-mock-provider"] == "provider-c"


def test_admin_overlay_reports_every_worker(providers, gateway_factory):
    overlay = envelope([candidate("m", "provider-a"), candidate("n", "provider-b")])
    gateway = gateway_factory(_clusters(providers), overlay, workers=2)
    _, _, body = admin_get(gateway.admin_port, "/admin/overlay")
    data = json.loads(body)
    assert data["serving_revision"] == overlay["revision"]["value"]
    assert data["mode"] == "roundRobin"
    assert len(data["workers"]) == 2
    assert all(w["serving_revision"] == data["serving_revision"] and w["pid"] > 0 for w in data["workers"])


def test_replacement_worker_serves_last_known_good_while_the_file_is_invalid(providers, gateway_factory):
    import os

    overlay = envelope([candidate("m", "provider-a")])
    gateway = gateway_factory(_clusters(providers), overlay, workers=1,
                              extra={"routing": {"reload_debounce": "100ms"}})
    with open(gateway.overlay_path, "w") as handle:
        handle.write("{ not json")
    time.sleep(0.5)
    (pid,) = gateway.worker_pids()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # Pids first, readiness second: a /readyz 200 read before the supervisor noticed the kill
        # would otherwise vouch for the dead worker while the pids already show its replacement.
        pids = gateway.worker_pids()
        if pids and pids != [pid] and admin_get(gateway.admin_port, "/readyz")[0] == 200:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"no replacement worker became ready:\n{gateway.log()}")
    response = chat(gateway.port, "m")
    assert response.status == 200
    assert response.headers["x-gridgate-overlay-revision"] == overlay["revision"]["value"]
    assert "last-known-good" in gateway.log()


def test_inline_candidates_route_without_an_overlay_file(providers, gateway_factory):
    gateway = gateway_factory(_clusters(providers), envelope([candidate("unused", "provider-a")]), start=False)
    del gateway.config["routing"]["overlay_file"]
    gateway.config["routing"]["candidates"] = [candidate("inline-model", "provider-c", group=None)]
    gateway.write_config()
    gateway.start()
    response = chat(gateway.port, "inline-model")
    assert response.status == 200
    assert response.headers["x-mock-provider"] == "provider-c"
    assert response.headers["x-gridgate-selection-mode"] == "deterministic"
    assert chat(gateway.port, "unused").status == 404
