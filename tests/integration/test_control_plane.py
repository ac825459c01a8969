"""`gridgate control` against real mock providers: observe, publish on change only, atomically
(docs/control-plane.md).

Each test starts its own three mock providers (they are cheap) so it may break them freely.
Every overlay read from disk is checked with the data plane's own validator.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.control.observe import observe_provider
from gateway.control.publish import Publisher
from gateway.control.runner import control_main, run_control
from gateway.control.spec import load_spec
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.digest import semantic_revision
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from gateway.overlay.watch import write_atomically
from loadtest.mock_provider import MockProviderHandle
from tests.harness import Client, Gateway, candidate, envelope, free_port, mock_served, refused_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCOPE = {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "east"}
INTERVAL_MS = 300
SITES = {"provider-a": "east", "provider-b": "east", "provider-c": "west"}


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def trio(mock_provider: Callable[..., MockProviderHandle]) -> dict[str, MockProviderHandle]:
    return {name: mock_provider(name) for name in SITES}


def provider_entry(handle: MockProviderHandle, site: str, **extra: Any) -> dict[str, Any]:
    return {"name": handle.name, "site": site, "models": ["m1", "m2"], "health_url": f"{handle.base_url}/health",
            "metrics_url": f"{handle.base_url}/metrics", **extra}


def write_spec(directory: Path, providers: list[dict[str, Any]], **overrides: Any) -> str:
    raw = {
        "output": "overlay.json",
        "scope": SCOPE,
        "interval": f"{INTERVAL_MS}ms",
        "probe_timeout": f"{INTERVAL_MS}ms",
        "routingPolicy": "geographyFirst",
        "scoringPolicy": {"strategy": "kvCachePressure", "kvCacheThreshold": 0.8},
        "selectionPolicy": {"mode": "roundRobin"},
        "providers": providers,
        **overrides,
    }
    path = directory / "control.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def trio_spec(directory: Path, trio: dict[str, MockProviderHandle], **overrides: Any) -> str:
    return write_spec(directory, [provider_entry(h, SITES[n]) for n, h in trio.items()], **overrides)


def admin(handle: MockProviderHandle, path: str, payload: dict[str, Any]) -> None:
    request = urllib.request.Request(f"{handle.base_url}{path}", data=json.dumps(payload).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


def wait_for(predicate: Callable[[], Any], timeout: float = 8.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (FileNotFoundError, OverlayRejected):
            value = None
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def load(path: str) -> tuple[dict[str, Any], Snapshot]:
    data = Path(path).read_bytes()
    return json.loads(data), snapshot_from_bytes(data, SCOPE)


def admissions(path: str, model: str = "m1") -> dict[str, str]:
    document, _ = load(path)
    return {c["cluster"]: c["admission_state"] for c in document["overlay"]["candidates"] if c["name"] == model}


def generation(path: str) -> int:
    return load(path)[0]["provenance"]["source_generation"]


def health_probes(trio: dict[str, MockProviderHandle]) -> dict[str, int]:
    """GET /health requests each provider answered: one per control-plane round."""
    return {name: mock_served(handle, ("health",)) for name, handle in trio.items()}


def wait_rounds(trio: dict[str, MockProviderHandle], rounds: int) -> None:
    """Until the control plane observed every provider ``rounds`` more times: the positive sign that it
    ran, before a test says that nothing it did changed the file."""
    before = health_probes(trio)
    wait_for(lambda: all(count >= before[name] + rounds for name, count in health_probes(trio).items()),
             timeout=rounds * INTERVAL_MS / 1000 * 4 + 5, what=f"{rounds} more observation rounds")


class PollingReader:
    """Reads the overlay in a tight loop; every read must be a complete, valid document."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reads = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = Path(self.path).read_bytes()
            except FileNotFoundError:
                continue  # before the first publish
            try:
                snapshot_from_bytes(data, SCOPE)
                self.reads += 1
            except OverlayRejected as exc:
                self.failures.append(f"{exc} ({len(data)} bytes)")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class ControlThread:
    """`run_control` on its own event loop in a thread, stopped through its stop event."""

    def __init__(self, spec_path: str) -> None:
        self.spec_path = spec_path
        self.error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(5)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            self._started.set()
            await run_control(self.spec_path, self.stop_event)

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
            self._started.set()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self._thread.join(5)
        assert not self._thread.is_alive(), "control loop did not stop"
        assert self.error is None, self.error


@pytest.fixture
def control_threads() -> Iterator[Callable[[str], ControlThread]]:
    running: list[ControlThread] = []

    def start(spec_path: str) -> ControlThread:
        running.append(ControlThread(spec_path))
        return running[-1]

    yield start
    for thread in running:
        if thread._thread.is_alive():
            thread.stop()


# --------------------------------------------------------------------------- the control process


def test_control_process_publishes_on_change_only_atomically_and_stops_on_sigterm(
    tmp_path: Path, trio: dict[str, MockProviderHandle]
) -> None:
    spec_path = trio_spec(tmp_path, trio)
    output = str(tmp_path / "overlay.json")
    reader = PollingReader(output)
    log_path = tmp_path / "control.log"
    code = "import sys; from gateway.control.runner import control_main; sys.exit(control_main(sys.argv[1]))"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-c", code, spec_path], cwd=ROOT, stdout=log_file,
                                   stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: os.path.exists(output), what="the first publish")
        first, snapshot = load(output)
        first_revision = first["revision"]["value"]
        assert first["provenance"]["source_generation"] == 1
        assert admissions(output) == {"provider-a": "new_and_existing", "provider-b": "new_and_existing",
                                      "provider-c": "new_and_existing"}
        capability = snapshot.capability("inference_model", "m1")
        assert capability is not None and [c.cluster for c in capability.serving] == ["provider-a", "provider-b"]

        # Nothing changes: five rounds later (each observed every provider) the file is untouched.
        mtime = os.stat(output).st_mtime_ns
        wait_rounds(trio, 5)
        assert os.stat(output).st_mtime_ns == mtime and generation(output) == 1

        admin(trio["provider-b"], "/admin/health", {"status": 503})
        wait_for(lambda: admissions(output)["provider-b"] == "none", what="provider-b -> none")
        second, snapshot = load(output)
        assert second["revision"]["value"] != first_revision and second["provenance"]["source_generation"] == 2
        capability = snapshot.capability("inference_model", "m1")
        assert capability is not None and [c.cluster for c in capability.serving] == ["provider-a"]

        admin(trio["provider-a"], "/admin/config", {"kv_cache_utilization": 0.95})
        wait_for(lambda: admissions(output)["provider-a"] == "existing_only", what="provider-a -> existing_only")
        assert generation(output) == 3
        _, snapshot = load(output)
        capability = snapshot.capability("inference_model", "m1")
        assert capability is not None and [c.cluster for c in capability.serving] == ["provider-c"]

        admin(trio["provider-b"], "/admin/health", {"status": 200})
        admin(trio["provider-a"], "/admin/config", {"kv_cache_utilization": None})
        wait_for(lambda: load(output)[0]["revision"]["value"] == first_revision, what="the first revision again")
        assert generation(output) in (4, 5)  # one or two rounds saw the two recoveries

        process.send_signal(signal.SIGTERM)
        assert process.wait(5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.stop()
    assert reader.failures == []
    assert reader.reads > 20
    log = log_path.read_text()
    assert log.count("published revision") == generation(output)
    assert "state provider-b: new_and_existing score=0 -> none score=null stale (health: HTTP 503)" in log
    assert "control plane stopped" in log
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_sigint_stops_the_control_process_with_exit_0(tmp_path: Path, trio: dict[str, MockProviderHandle]) -> None:
    spec_path = trio_spec(tmp_path, trio)
    code = "import sys; from gateway.control.runner import control_main; sys.exit(control_main(sys.argv[1]))"
    process = subprocess.Popen([sys.executable, "-c", code, spec_path], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: os.path.exists(tmp_path / "overlay.json"), what="the first publish")
        process.send_signal(signal.SIGINT)
        assert process.wait(5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_spec_error_at_start_is_exit_1_with_field_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump({"output": "overlay.json", "scope": SCOPE, "interval": "soon", "providers": []}))
    assert control_main(str(path)) == 1
    assert capsys.readouterr().err.splitlines() == [
        "interval: invalid duration 'soon' (integer with unit ms, s, m, h or d)"]
    path.write_text(yaml.safe_dump({"output": "overlay.json", "scope": SCOPE, "providers": []}))
    assert control_main(str(path)) == 1
    assert capsys.readouterr().err.splitlines() == ["providers: must list at least one provider"]
    assert not (tmp_path / "overlay.json").exists()


def test_a_metrics_listen_port_in_use_is_one_line_and_exit_1(tmp_path: Path, trio: dict[str, MockProviderHandle],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert control_main(trio_spec(tmp_path, trio, metrics_listen=f"127.0.0.1:{port}")) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"metrics_listen: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert not (tmp_path / "overlay.json").exists()


# --------------------------------------------------------------------------- the loop in-process


def test_unreachable_provider_and_broken_metrics_never_stop_the_loop(
    tmp_path: Path, trio: dict[str, MockProviderHandle], control_threads: Callable[[str], ControlThread]
) -> None:
    closed_port = refused_port()
    providers = [
        provider_entry(trio["provider-a"], "east"),
        provider_entry(trio["provider-b"], "east", metrics_url=f"{trio['provider-b'].base_url}/nope"),
        {"name": "ghost", "site": "east", "models": ["m1"], "health_url": f"http://127.0.0.1:{closed_port}/health",
         "metrics_url": f"http://127.0.0.1:{closed_port}/metrics"},
    ]
    output = str(tmp_path / "overlay.json")
    control = control_threads(write_spec(tmp_path, providers))
    wait_for(lambda: os.path.exists(output), what="the first publish")
    candidates = {c["cluster"]: c for c in load(output)[0]["overlay"]["candidates"] if c["name"] == "m1"}
    assert (candidates["ghost"]["admission_state"], candidates["ghost"]["fresh"]) == ("none", False)
    # Healthy without metrics: still admitted, but stale and ranked after the measured provider.
    assert (candidates["provider-b"]["admission_state"], candidates["provider-b"]["fresh"]) == ("new_and_existing", False)
    assert [c["cluster"] for c in candidates.values()] == ["provider-a", "provider-b", "ghost"]
    control.stop()


def test_restart_keeps_the_generation_and_does_not_republish_the_same_revision(
    tmp_path: Path, trio: dict[str, MockProviderHandle], control_threads: Callable[[str], ControlThread]
) -> None:
    spec_path = trio_spec(tmp_path, trio)
    output = str(tmp_path / "overlay.json")
    control = control_threads(spec_path)
    wait_for(lambda: os.path.exists(output), what="the first publish")
    admin(trio["provider-c"], "/admin/health", {"status": 500})
    wait_for(lambda: generation(output) == 2, what="generation 2")
    control.stop()

    mtime = os.stat(output).st_mtime_ns
    control = control_threads(spec_path)
    wait_rounds(trio, 4)  # the restarted control plane ran four rounds ...
    assert os.stat(output).st_mtime_ns == mtime, "a restart with an unchanged revision must not publish"

    admin(trio["provider-c"], "/admin/health", {"status": 200})
    wait_for(lambda: generation(output) == 3, what="generation 3 after the restart")
    assert admissions(output)["provider-c"] == "new_and_existing"

    os.unlink(output)  # someone removed it: republished, and the generation still moves forward
    wait_for(lambda: os.path.exists(output) and generation(output) == 4, what="republish after removal")
    control.stop()


def test_stabilized_admission_holds_a_flap_down(
    tmp_path: Path, trio: dict[str, MockProviderHandle], control_threads: Callable[[str], ControlThread]
) -> None:
    spec_path = trio_spec(tmp_path, trio, admission={"mode": "stabilized", "observations": 3})
    output = str(tmp_path / "overlay.json")
    control = control_threads(spec_path)
    wait_for(lambda: os.path.exists(output), what="the first publish")
    started = time.monotonic()
    admin(trio["provider-a"], "/admin/health", {"status": 503})
    wait_for(lambda: admissions(output)["provider-a"] == "none", what="provider-a -> none")
    # Three consecutive failing rounds: at least two intervals after the first one that saw it.
    assert time.monotonic() - started >= 2 * INTERVAL_MS / 1000
    assert generation(output) == 2
    control.stop()


# --------------------------------------------------------------------------- publish and observe


def test_timestamp_only_change_is_not_a_publish_and_identity_change_is(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path, [{"name": "p", "site": "east", "models": ["m"],
                                       "health_url": "http://127.0.0.1:1/health", "metrics_url": "http://x/m"}])
    spec = load_spec(spec_path)
    document = {"network": "net", "local_site": "east", "selection_policy": {"mode": "roundRobin"},
                "candidates": [{"kind": "inference_model", "name": "m", "site": "east", "cluster": "p",
                                "selection_group": 0, "admission_state": "new_and_existing"}]}
    now = datetime(2026, 1, 1, tzinfo=UTC)
    publisher = Publisher(spec)
    result = publisher.publish(document, now)
    assert result is not None and result.generation == 1
    data = Path(spec.output).read_bytes()
    assert publisher.publish(document, now + timedelta(hours=1)) is None
    assert Publisher(spec).publish(document, now + timedelta(hours=2)) is None  # after a restart, too
    assert Path(spec.output).read_bytes() == data
    assert oct(os.stat(spec.output).st_mode & 0o777) == "0o644"

    renamed = load_spec(write_spec(tmp_path, [{"name": "p", "site": "east", "models": ["m"],
                                               "health_url": "http://127.0.0.1:1/health",
                                               "metrics_url": "http://x/m"}],
                                   scope={**SCOPE, "gateway": "gw2"}))
    result = Publisher(renamed).publish(document, now)
    assert result is not None and result.generation == 2 and result.revision == result.previous_revision
    assert json.loads(Path(spec.output).read_bytes())["scope"]["gateway"] == "gw2"


def test_invalid_existing_file_is_replaced_keeping_its_generation(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, [{"name": "p", "site": "east", "models": ["m"],
                                            "health_url": "http://127.0.0.1:1/health", "metrics_url": "http://x/m"}]))
    write_atomically(spec.output, json.dumps({"schema_version": "1.0.0", "provenance": {"source_generation": 7}}).encode())
    document = {"network": "net", "local_site": "east", "candidates": [
        {"kind": "inference_model", "name": "m", "site": "east", "cluster": "p", "selection_group": 0}]}
    result = Publisher(spec).publish(document, datetime.now(UTC))
    assert result is not None and (result.generation, result.previous_revision) == (8, None)
    load(spec.output)


def test_observe_reads_health_and_gauges_of_a_real_provider(
    tmp_path: Path, mock_provider: Callable[..., MockProviderHandle]
) -> None:
    handle = mock_provider("observed")
    spec = load_spec(write_spec(tmp_path, [provider_entry(handle, "east")],
                                scoringPolicy={"strategy": "kvCachePressure", "queueDepthThreshold": 64}))
    entry, plan = spec.providers[0], spec.signal_plan(spec.providers[0])
    admin(handle, "/admin/config", {"queue_depth": 7, "kv_cache_utilization": 0.5})
    observation = asyncio.run(observe_provider(entry, 2.0, plan))
    assert (observation.healthy, observation.queue_depth, observation.kv_cache_utilization, observation.error) == (
        True, 7.0, 0.5, None)
    admin(handle, "/admin/health", {"status": 503})
    observation = asyncio.run(observe_provider(entry, 2.0, plan))
    assert (observation.healthy, observation.error) == (False, "health: HTTP 503")
    handle.stop()
    observation = asyncio.run(observe_provider(entry, 2.0, plan))
    assert (observation.healthy, observation.error) == (False, "health: connection refused")



def test_failed_publish_is_retried_and_never_stops_the_loop(
    tmp_path: Path, trio: dict[str, MockProviderHandle], control_threads: Callable[[str], ControlThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = str(out_dir / "overlay.json")
    control = control_threads(trio_spec(tmp_path, trio, output="out/overlay.json"))
    wait_for(lambda: os.path.exists(output), what="the first publish")
    os.rename(out_dir, tmp_path / "gone")  # the directory disappears: every write fails
    admin(trio["provider-c"], "/admin/health", {"status": 503})
    wait_for(lambda: "publish to" in caplog.text and "failed" in caplog.text, what="a logged publish failure")
    out_dir.mkdir()
    wait_for(lambda: os.path.exists(output) and admissions(output)["provider-c"] == "none", what="the retry")
    assert generation(output) == 2
    control.stop()


# --------------------------------------------------------------------------- grouping, end to end


def test_equivalent_providers_with_different_queue_depths_share_one_group_and_a_gateway_rotates_over_all(
    tmp_path: Path, mock_provider: Callable[..., MockProviderHandle],
    gateway_factory: Callable[..., Gateway], control_threads: Callable[[str], ControlThread],
) -> None:
    # Issue 11's reproduction: one site, queue depths 1, 9 and 20, threshold 32, scoreFirst, roundRobin.
    handles = [mock_provider(name) for name in ("provider-a", "provider-b", "provider-c")]
    for handle, depth in zip(handles, (20, 1, 9), strict=True):
        admin(handle, "/admin/config", {"queue_depth": depth})
    gateway = gateway_factory({h.name: [h.address] for h in handles},
                              envelope([candidate("m1", "provider-a")], local_site="east"), start=False)
    spec_path = write_spec(tmp_path, [provider_entry(h, "east") for h in handles], output=gateway.overlay_path,
                           routingPolicy="scoreFirst", scoringPolicy={"strategy": "queueDepth", "queueDepthThreshold": 32})
    control_threads(spec_path)
    wait_for(lambda: load(gateway.overlay_path)[0]["provenance"]["producer"] == "gridgate-control",
             what="the control plane's first publish")
    document, snapshot = load(gateway.overlay_path)
    m1 = [c for c in document["overlay"]["candidates"] if c["name"] == "m1"]
    assert [(c["cluster"], c["selection_group"], c["score"]) for c in m1] == [
        ("provider-b", 0, 0.0), ("provider-c", 0, 0.25), ("provider-a", 0, 0.5)]
    assert document["overlay"]["selection_policy"] == {"mode": "roundRobin"}

    gateway.start()
    client = Client(gateway.port)
    try:
        before = [mock_served(h) for h in handles]
        for _ in range(6):
            response = client.request("POST", "/v1/chat/completions", {"model": "m1", "messages": []})
            assert response.status == 200
            assert response.headers["x-gridgate-selection-group"] == "0"
    finally:
        client.close()
    assert [mock_served(h) - b for h, b in zip(handles, before, strict=True)] == [2, 2, 2]


def test_spec_without_selection_policy_publishes_none(tmp_path: Path, trio: dict[str, MockProviderHandle],
                                                      control_threads: Callable[[str], ControlThread]) -> None:
    raw = yaml.safe_load(Path(trio_spec(tmp_path, trio)).read_text())
    del raw["selectionPolicy"]
    (tmp_path / "control.yaml").write_text(yaml.safe_dump(raw))
    control_threads(str(tmp_path / "control.yaml"))
    output = str(tmp_path / "overlay.json")
    wait_for(lambda: os.path.exists(output), what="the first publish")
    document, snapshot = load(output)
    assert "selection_policy" not in document["overlay"]
    assert snapshot.mode == "deterministic"
    assert document["revision"]["value"] == semantic_revision(
        {k: v for k, v in document["overlay"].items() if k != "generated_at"})


def test_refresh_republishes_an_unchanged_revision_once_it_is_that_old(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, [{"name": "p", "site": "east", "models": ["m"],
                                            "health_url": "http://127.0.0.1:1/health", "metrics_url": "http://x/m"}],
                                refresh="1m"))
    document = {"network": "net", "local_site": "east", "candidates": [
        {"kind": "inference_model", "name": "m", "site": "east", "cluster": "p", "selection_group": 0}]}
    now = datetime(2026, 1, 1, tzinfo=UTC)
    first = Publisher(spec).publish(document, now)
    assert first is not None and first.generation == 1
    assert Publisher(spec).publish(document, now + timedelta(seconds=59)) is None
    again = Publisher(spec).publish(document, now + timedelta(seconds=61))
    assert again is not None and (again.generation, again.revision, again.previous_revision) == (
        2, first.revision, first.revision)
    assert load(spec.output)[0]["provenance"]["rendered_at"] == "2026-01-01T00:01:01.000Z"


# --------------------------------------------------------------------------- metric presets, end to end


class RecordedProvider:
    """An HTTP server answering /health 200 and /metrics with a recorded page (tests/fixtures/metrics)."""

    def __init__(self, page: str) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.page = page
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                body = owner.page.encode() if self.path == "/metrics" else b"ok"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_llm_d_epp_page_is_scored_and_a_page_lacking_the_gauge_is_reported(
    tmp_path: Path, control_threads: Callable[[str], ControlThread], caplog: pytest.LogCaptureFixture,
) -> None:
    recorded = (Path(ROOT) / "tests" / "fixtures" / "metrics" / "llm-d-epp.prom").read_text()
    epp = RecordedProvider(recorded)
    metrics_port = free_port()
    providers = [
        {"name": "epp-site", "site": "east", "models": ["m1"], "health_url": f"{epp.url}/health",
         "metrics_url": f"{epp.url}/metrics", "metrics": {"pool": "qwen3-pool"}},
        # The same EPP read as if it were a vLLM server: its page has none of vLLM's gauges.
        {"name": "misread", "site": "east", "models": ["m1"], "health_url": f"{epp.url}/health",
         "metrics_url": f"{epp.url}/metrics", "metrics": {"preset": "vllm"}},
    ]
    output = str(tmp_path / "overlay.json")
    caplog.set_level(logging.INFO, logger="gridgate.control")
    control = control_threads(write_spec(
        tmp_path, providers, metrics_listen=f"127.0.0.1:{metrics_port}",
        scoringPolicy={"strategy": "queueDepth", "queueDepthThreshold": 18, "metrics": {"preset": "llm-d-epp"}}))
    try:
        wait_for(lambda: os.path.exists(output), what="the first publish")
        candidates = {c["cluster"]: c for c in load(output)[0]["overlay"]["candidates"]}
        # Queue 4.5 of 18: a quarter of the way, so the first band; the page is fresh.
        assert (candidates["epp-site"]["fresh"], candidates["epp-site"]["score"]) == (True, 0.25)
        assert (candidates["misread"]["fresh"], candidates["misread"]["score"]) == (False, None)

        def scraped() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
                return response.read().decode()

        page = wait_for(lambda: (text := scraped()) and "gridgate_control_rounds_total" in text and text,
                        what="the control plane's metrics")
        assert 'gridgate_control_metric_missing{provider="misread",signal="queue depth"} 1.0' in page
        assert 'gridgate_control_metric_missing{provider="epp-site",signal="queue depth"} 0.0' in page
        assert any("misread: the metrics page lacks its queue depth gauge (preset vllm)" in r.getMessage()
                   for r in caplog.records)
        # The pool loses its last ready endpoint: the healthy picker in front of it is taken out.
        epp.page = recorded.replace('llm_d_epp_ready_endpoints{name="qwen3-pool"} 4',
                                    'llm_d_epp_ready_endpoints{name="qwen3-pool"} 0')
        wait_for(lambda: admissions(output)["epp-site"] == "none", what="epp-site taken out")
    finally:
        control.stop()
        epp.close()
