"""One overlay for a fleet through Valkey (CONTRACT §13): `gridgate control` publishing under a lease,
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
from loadtest.mock_provider import MockProviderHandle
from tests.harness import ROOT

SCOPE = {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "east"}
INTERVAL_MS = 200


def wait_for(predicate: Callable[[], Any], timeout: float = 8.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def key() -> str:
    return f"gridgate:overlay:test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(valkey_url: str) -> Iterator[valkey.Valkey]:
    client = valkey.Valkey.from_url(valkey_url)
    yield client
    client.close()


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

    wait_for(lambda: published(store, key), what="the first publish")
    leader_pid = wait_for(lambda: lease_holder_pid(store, key), what="a lease holder")
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
    wait_for(lambda: lease_holder_pid(store, key) == standby.pid, timeout=5, what="the standby taking over")
    assert time.monotonic() - killed < 3 * INTERVAL_MS / 1000 + 2 * INTERVAL_MS / 1000 + 1.0
    assert "acquired" in standby.log()

    # The new holder publishes what changes, continuing the generation from the key.
    from tests.integration.test_control_plane import admin
    admin(handle, "/admin/health", {"status": 503})
    wait_for(lambda: (published(store, key) or {}).get("provenance", {}).get("source_generation") == 2,
             what="the new holder's publish")
    document = published(store, key)
    assert document is not None
    assert document["overlay"]["candidates"][0]["admission_state"] == "none"
    assert drain(events) == [document["revision"]["value"]]

    assert standby.stop() == 0  # a clean exit releases the lease at once
    assert store.get(f"{key}:lease") is None
    assert "control plane stopped" in standby.log()
    events.close()
