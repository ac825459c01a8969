"""One overlay for a fleet through Valkey (docs/fleet.md): `gridgate control` publishing under a lease,
gateways following the key with one subscriber per host. Real processes and the bundled Valkey.

Every test uses its own key, so they share the session's Valkey without seeing each other.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import valkey
import yaml

from gateway.overlay.snapshot import snapshot_from_bytes
from gateway.valkey.embedded import EmbeddedValkey
from loadtest.mock_provider import MockProviderHandle
from tests.harness import ROOT, Gateway, admin_get, candidate, chat, envelope, refused_port, wait_until

SCOPE = {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "east"}
INTERVAL_MS = 200


@pytest.fixture
def key() -> str:
    return f"gridgate:overlay:test-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- the control plane


class ControlProcess:
    """`gridgate control -c SPEC` as a real process, its log in a file."""

    def __init__(self, spec_path: Path, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "gateway", "control", "-c", str(spec_path)],
                                        cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(10)
        finally:
            self._log.close()


@pytest.fixture
def control_processes() -> Iterator[Callable[[Path, str], ControlProcess]]:
    started: list[ControlProcess] = []

    def start(spec_path: Path, name: str) -> ControlProcess:
        started.append(ControlProcess(spec_path, spec_path.parent / f"{name}.log"))
        return started[-1]

    yield start
    for process in started:
        if process.process.poll() is None:
            process.stop(signal.SIGKILL)


def control_spec(directory: Path, providers: list[MockProviderHandle], url: str, key: str, **extra: Any) -> Path:
    raw = {
        "scope": SCOPE,
        "interval": f"{INTERVAL_MS}ms",
        "probe_timeout": f"{INTERVAL_MS}ms",
        "selectionPolicy": {"mode": "roundRobin"},
        "publish": {"valkey": {"url": url, "key": key}},
        "providers": [{"name": h.name, "site": "east", "models": ["m1"], "health_url": f"{h.base_url}/health"}
                      for h in providers],
        **extra,
    }
    path = directory / "control.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def published(store: valkey.Valkey, key: str) -> dict[str, Any] | None:
    data = store.get(key)
    if data is None:
        return None
    snapshot_from_bytes(data, SCOPE)  # whatever is published must be acceptable to a gateway
    return json.loads(data)


def drain(events: Any, seconds: float = 0.2) -> list[str]:
    """The payloads of the publish notices received until ``seconds`` pass without one."""
    payloads = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        message = events.get_message(timeout=0.02)
        if message is not None:
            payloads.append(message["data"].decode())
            deadline = time.monotonic() + seconds
    return payloads


def lease_holder_pid(store: valkey.Valkey, key: str) -> int | None:
    holder = store.get(f"{key}:lease")
    return None if holder is None else int(holder.decode().split(":")[1])


def test_two_control_planes_on_one_key_one_holds_the_lease_the_other_takes_over(
    tmp_path: Path, valkey_url: str, store: valkey.Valkey, key: str,
    mock_provider: Callable[..., MockProviderHandle], control_processes: Callable[[Path, str], ControlProcess],
) -> None:
    handle = mock_provider("provider-a")
    spec = control_spec(tmp_path, [handle], valkey_url, key)
    events = store.pubsub(ignore_subscribe_messages=True)
    events.subscribe(f"{key}:events")
    first, second = control_processes(spec, "first"), control_processes(spec, "second")

    wait_until(lambda: published(store, key), what="the first publish")
    leader_pid = wait_until(lambda: lease_holder_pid(store, key), what="a lease holder")
    leader, standby = (first, second) if leader_pid == first.pid else (second, first)
    assert leader_pid == leader.pid
    time.sleep(5 * INTERVAL_MS / 1000)  # rounds go by: nothing changes, nothing is republished
    document = published(store, key)
    assert document is not None and document["provenance"]["source_generation"] == 1
    assert drain(events) == [document["revision"]["value"]]  # one SET, one PUBLISH
    assert lease_holder_pid(store, key) == leader.pid
    assert "acquired" in leader.log() and "acquired" not in standby.log()
    assert "standing by: the lease" in standby.log()

    leader.stop(signal.SIGKILL)  # no clean exit: the standby must wait out the lease (3 intervals)
    killed = time.monotonic()
    wait_until(lambda: lease_holder_pid(store, key) == standby.pid, timeout=5, what="the standby taking over")
    assert time.monotonic() - killed < 3 * INTERVAL_MS / 1000 + 2 * INTERVAL_MS / 1000 + 1.0
    assert "acquired" in standby.log()

    # The new holder publishes what changes, continuing the generation from the key.
    from tests.integration.test_control_plane import admin
    admin(handle, "/admin/health", {"status": 503})
    wait_until(lambda: (published(store, key) or {}).get("provenance", {}).get("source_generation") == 2,
             what="the new holder's publish")
    document = published(store, key)
    assert document is not None
    assert document["overlay"]["candidates"][0]["admission_state"] == "none"
    assert drain(events) == [document["revision"]["value"]]

    assert standby.stop() == 0  # a clean exit releases the lease at once
    assert store.get(f"{key}:lease") is None
    assert "control plane stopped" in standby.log()
    events.close()


# --------------------------------------------------------------------------- gateways following a key


def fleet_overlay(cluster: str, generation: int = 1, **options: Any) -> dict[str, Any]:
    return envelope([candidate("m", cluster)], generation=generation, **options)


def put(store: valkey.Valkey, key: str, document: dict[str, Any] | bytes) -> float:
    """SET then PUBLISH as the control plane does; returns the monotonic time of the PUBLISH."""
    store.set(key, document if isinstance(document, bytes) else json.dumps(document))
    published_at = time.monotonic()
    store.publish(f"{key}:events", "new")
    return published_at


def source_gateway(factory: Callable[..., Gateway], providers: dict[str, MockProviderHandle], url: str, key: str,
                   *, workers: int = 1, fallback: dict[str, Any] | None = None, start: bool = True,
                   **source: Any) -> Gateway:
    gateway = factory({name: [h.address] for name, h in providers.items()}, fallback or fleet_overlay("provider-c"),
                      start=False, workers=workers)
    gateway.config["routing"]["overlay_source"] = {"kind": "valkey", "url": url, "key": key, **source}
    if fallback is None:
        del gateway.config["routing"]["overlay_file"]
    gateway.write_config()
    return gateway.start() if start else gateway


def serving(gateway: Gateway) -> set[str | None]:
    """The revisions the gateway's workers serve (one element once they agree)."""
    _, _, body = admin_get(gateway.admin_port, "/admin/overlay")
    return {w["serving_revision"] for w in json.loads(body)["workers"]} if body else {None}


def providers_of(gateway: Gateway, count: int = 6) -> set[str]:
    """Which providers serve ``count`` requests, each on a new connection (so any worker may take it)."""
    found = set()
    for _ in range(count):
        response = chat(gateway.port, model="m")
        assert response.status == 200, response.body
        found.add(response.headers["x-gridgate-provider"])
    return found


def metric(gateway: Gateway, name: str) -> float | None:
    _, _, body = admin_get(gateway.admin_port, "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_two_gateways_converge_on_a_publish_within_3s_and_keep_last_known_good_on_a_bad_one(
    valkey_url: str, store: valkey.Valkey, key: str, providers: dict[str, MockProviderHandle],
    gateway_factory: Callable[..., Gateway],
) -> None:
    first = fleet_overlay("provider-a")
    put(store, key, first)
    one = source_gateway(gateway_factory, providers, valkey_url, key)
    two = source_gateway(gateway_factory, providers, valkey_url, key, workers=2)
    for gateway in (one, two):
        assert serving(gateway) == {first["revision"]["value"]}
        assert providers_of(gateway) == {"provider-a"}
        assert metric(gateway, "gridgate_overlay_source_up") == 1.0

    second = fleet_overlay("provider-b", generation=2)
    published_at = put(store, key, second)
    for gateway in (one, two):
        wait_until(lambda gateway=gateway: serving(gateway) == {second["revision"]["value"]}, timeout=3.0,
                 what="convergence on the published revision")
    assert time.monotonic() - published_at < 3.0
    for gateway in (one, two):
        assert providers_of(gateway) == {"provider-b"}

    # Invalid documents: a digest that does not match, then one that is not JSON. Both gateways keep serving.
    tampered = fleet_overlay("provider-c", generation=3)
    tampered["content_digest"]["value"] = tampered["revision"]["value"] = "0" * 64
    for count, bad in enumerate((json.dumps(tampered).encode(), b"{half a docum"), start=1):
        put(store, key, bad)
        for gateway in (one, two):
            wait_until(lambda gateway=gateway, count=count: metric(
                gateway, 'gridgate_overlay_source_updates_total{outcome="rejected"}') == count, what="the rejection")
    time.sleep(1.0)  # long enough for a worker to have followed a cache file that changed
    for gateway in (one, two):
        assert serving(gateway) == {second["revision"]["value"]}
        assert providers_of(gateway) == {"provider-b"}
        assert "overlay source rejected the document (digest_mismatch" in gateway.log()
        assert "overlay source rejected the document (malformed_structure" in gateway.log()
    # One subscriber per host (the supervisor's), not one per worker: two hosts, three workers, two.
    assert store.pubsub_numsub(f"{key}:events") == [(f"{key}:events".encode(), 2)]


def test_valkey_outage_keeps_traffic_and_readiness_and_a_publish_after_recovery_is_picked_up(
    tmp_path: Path, key: str, providers: dict[str, MockProviderHandle], gateway_factory: Callable[..., Gateway],
) -> None:
    server = EmbeddedValkey(tmp_path / "valkey", unix_socket=False)
    url = server.start()
    store = valkey.Valkey.from_url(url)
    try:
        put(store, key, fleet_overlay("provider-a"))
        gateway = source_gateway(gateway_factory, providers, url, key, workers=2, poll_interval="1s")
        assert providers_of(gateway) == {"provider-a"}

        server.stop()
        wait_until(lambda: metric(gateway, "gridgate_overlay_source_up") == 0.0, what="the outage to be noticed")
        assert admin_get(gateway.admin_port, "/readyz")[0] == 200
        assert providers_of(gateway) == {"provider-a"}
        time.sleep(1.5)  # reconnect attempts fail: still one outage, still ready
        assert metric(gateway, "gridgate_overlay_source_outages_total") == 1.0
        assert admin_get(gateway.admin_port, "/readyz")[0] == 200
        assert gateway.log().count("unreachable (") == 1

        assert server.start() == url
        second = fleet_overlay("provider-b", generation=2)
        put(store, key, second)
        wait_until(lambda: serving(gateway) == {second["revision"]["value"]}, timeout=5.0,
                 what="the publish made after Valkey came back")
        assert providers_of(gateway) == {"provider-b"}
        assert metric(gateway, "gridgate_overlay_source_up") == 1.0
        assert "reachable again after" in gateway.log()
    finally:
        store.close()
        server.stop()


def test_start_without_valkey_fails_in_one_line_or_serves_the_cache_or_the_fallback_file(
    tmp_path: Path, key: str, providers: dict[str, MockProviderHandle], gateway_factory: Callable[..., Gateway],
    valkey_url: str, store: valkey.Valkey,
) -> None:
    dead = f"valkey://127.0.0.1:{refused_port()}/0"
    cache = str(tmp_path / "cache.json")
    gateway = source_gateway(gateway_factory, providers, dead, key, start=False, cache_file=cache)
    with pytest.raises(RuntimeError) as info:
        gateway.start(timeout=10)
    assert gateway.process.wait(5) == 1
    lines = [line for line in gateway.log().splitlines() if "routing.overlay_source" in line]
    assert len(lines) == 1 and "no overlay to serve" in lines[0] and "Valkey unreachable" in lines[0], info.value

    # A run with Valkey leaves its document in the cache; the next start without Valkey serves it.
    first = fleet_overlay("provider-b")
    put(store, key, first)
    with_valkey = source_gateway(gateway_factory, providers, valkey_url, key, cache_file=cache)
    assert providers_of(with_valkey) == {"provider-b"}
    with_valkey.stop()
    restarted = source_gateway(gateway_factory, providers, dead, key, cache_file=cache)
    assert serving(restarted) == {first["revision"]["value"]}
    assert "serving the cached revision" in restarted.log()
    restarted.stop()

    # No cache, but a local overlay_file beside the source: that file is served.
    fallback = fleet_overlay("provider-c")
    served = source_gateway(gateway_factory, providers, dead, key, fallback=fallback)
    assert providers_of(served) == {"provider-c"}
    assert "serving routing.overlay_file" in served.log()


def test_overlay_age_is_measured_and_a_stale_overlay_warned_about_once(
    providers: dict[str, MockProviderHandle], gateway_factory: Callable[..., Gateway],
) -> None:
    from datetime import UTC, datetime, timedelta

    def rendered(ago: timedelta, generation: int) -> dict[str, Any]:
        document = fleet_overlay("provider-a", generation=generation)
        stamp = (datetime.now(UTC) - ago).isoformat(timespec="seconds").replace("+00:00", "Z")
        document["provenance"]["rendered_at"] = document["overlay"]["generated_at"] = stamp
        return document

    gateway = gateway_factory({name: [h.address] for name, h in providers.items()}, rendered(timedelta(hours=2), 1),
                              extra={"routing": {"overlay_max_age": "1h"}})
    age = wait_until(lambda: metric(gateway, "gridgate_overlay_age_seconds"), what="the age metric")
    assert 7190 < age < 7300
    wait_until(lambda: "more than routing.overlay_max_age" in gateway.log(), what="the staleness warning")
    from tests.harness import write_json_atomic
    write_json_atomic(gateway.overlay_path, rendered(timedelta(0), 2))  # the control plane is back
    wait_until(lambda: (metric(gateway, "gridgate_overlay_age_seconds") or 1e9) < 60, what="a fresh age")
    wait_until(lambda: "is fresh again" in gateway.log(), what="the recovery line")
    assert gateway.log().count("more than routing.overlay_max_age") == 1


def test_reload_keeps_following_the_source_and_refuses_to_change_it(
    valkey_url: str, store: valkey.Valkey, key: str, providers: dict[str, MockProviderHandle],
    gateway_factory: Callable[..., Gateway],
) -> None:
    put(store, key, fleet_overlay("provider-a"))
    gateway = source_gateway(gateway_factory, providers, valkey_url, key)
    pids = gateway.worker_pids()
    gateway.signal(signal.SIGHUP)  # nothing changed: the same workers keep serving (no generation swap)
    wait_until(lambda: "forwarded SIGHUP" in gateway.log(), what="the in-place reload")
    assert gateway.worker_pids() == pids

    gateway.config["routing"]["overlay_source"]["key"] = key + ":other"
    gateway.write_config()
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: "routing.overlay_source: changed; restart the service to apply it" in gateway.log(),
             what="the refused reload")
    second = fleet_overlay("provider-b", generation=2)
    put(store, key, second)  # still following the key it started with
    wait_until(lambda: serving(gateway) == {second["revision"]["value"]}, timeout=3.0, what="the publish")
    assert providers_of(gateway) == {"provider-b"}
