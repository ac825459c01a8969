"""The supervisor as operators meet it: real `python -m gateway` processes, signals, admin pages, sd_notify."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gateway.interpreter import interpreter_build
from gateway.supervisor import CrashBackoff, SlotPool
from tests.contract_fixtures import OVERLAY_FIXTURES
from tests.harness import (
    ROOT,
    Gateway,
    admin_get,
    alive,
    candidate,
    envelope,
    free_port,
    raw_exchange,
    ready_with,
    request,
    status_of,
    wait_until,
)

FIXTURES = OVERLAY_FIXTURES
CLUSTERS = {"cluster-a": ["127.0.0.1:9"]}  # never contacted: these tests only use gateway-local answers
OVERLAY = envelope([candidate("m", "cluster-a")])
FAST_DRAIN = {"timeouts": {"graceful_shutdown": "2s"}}


# --------------------------------------------------------------------------- helpers


def admin_json(gateway: Gateway, path: str) -> tuple[int, Any]:
    status, _, body = admin_get(gateway.admin_port, path)
    return status, json.loads(body) if body else None


def metric(gateway: Gateway, name: str) -> float:
    _, _, body = admin_get(gateway.admin_port, "/metrics")
    match = re.search(rb"^" + name.encode() + rb" (\S+)$", body, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def gridgate(*argv: str, stdin: str = "", timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *argv], cwd=ROOT, input=stdin, capture_output=True, text=True,
        timeout=timeout,
    )


@pytest.fixture
def start_gateway(gateway_factory) -> Callable[..., Gateway]:
    def start(workers: int = 2, extra: dict[str, Any] | None = None, **kwargs: Any) -> Gateway:
        return gateway_factory(CLUSTERS, OVERLAY, workers=workers, extra={**FAST_DRAIN, **(extra or {})}, **kwargs)

    return start


# --------------------------------------------------------------------------- the command line, end to end


def test_check_exit_codes_and_field_names(tmp_path):
    (tmp_path / "overlay.json").write_text(json.dumps(OVERLAY))
    good = "clusters: [{name: cluster-a, endpoints: ['127.0.0.1:9']}]\nrouting: {overlay_file: overlay.json}\n"
    (tmp_path / "good.yaml").write_text(good)
    (tmp_path / "bad.yaml").write_text(good + "workers: 0\nmystery: 1\n")

    ok = gridgate("check", "-c", str(tmp_path / "good.yaml"))
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "ok\n", "")
    bad = gridgate("check", "-c", str(tmp_path / "bad.yaml"))
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr == "mystery: unknown key\n"
    assert gridgate("check").returncode == 2
    assert gridgate("frobnicate").returncode == 2


def test_keys_hash_and_overlay_digest():
    hashed = gridgate("keys", "hash", stdin="team-a-key\n")
    assert hashed.stdout == "sha256:" + hashlib.sha256(b"team-a-key").hexdigest() + "\n"
    digest = gridgate("overlay", "digest", str(FIXTURES / "valid-minimal.json"))
    manifest = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
    assert digest.stdout.strip() == manifest["valid-minimal.json"]["revision"]


@pytest.mark.parametrize("which", ["listen", "admin.listen"])
def test_port_in_use_is_a_one_line_error(tmp_path, which):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = f"127.0.0.1:{squatter.getsockname()[1]}"
        listen = taken if which == "listen" else f"127.0.0.1:{free_port()}"
        admin = taken if which == "admin.listen" else f"127.0.0.1:{free_port()}"
        (tmp_path / "overlay.json").write_text(json.dumps(OVERLAY))
        (tmp_path / "gw.yaml").write_text(
            f"listen: '{listen}'\nadmin: {{listen: '{admin}'}}\nworkers: 1\n"
            "clusters: [{name: cluster-a, endpoints: ['127.0.0.1:9']}]\nrouting: {overlay_file: overlay.json}\n"
        )
        result = gridgate("run", "-c", str(tmp_path / "gw.yaml"))
    assert result.returncode == 1
    assert result.stderr == f"{which}: cannot bind {taken}: address already in use\n"


def test_run_refuses_an_invalid_overlay(tmp_path):
    (tmp_path / "overlay.json").write_bytes((FIXTURES / "invalid-digest.json").read_bytes())
    (tmp_path / "gw.yaml").write_text(
        f"listen: '127.0.0.1:{free_port()}'\nclusters: [{{name: cluster-a, endpoints: ['127.0.0.1:9']}}]\n"
        "routing: {overlay_file: overlay.json}\n"
    )
    result = gridgate("run", "-c", str(tmp_path / "gw.yaml"))
    assert result.returncode == 1
    assert result.stderr.startswith("routing.overlay_file: ") and "digest_mismatch" in result.stderr
    assert result.stderr.count("\n") == 1


# --------------------------------------------------------------------------- admin listener


def test_admin_pages(start_gateway):
    gateway = start_gateway(workers=2)
    assert admin_json(gateway, "/healthz") == (200, {"status": "ok"})
    assert admin_json(gateway, "/readyz") == (200, {"status": "ready"})

    status, overlay = admin_json(gateway, "/admin/overlay")
    assert status == 200
    assert overlay["serving_revision"] == OVERLAY["revision"]["value"]
    assert overlay["mode"] == "roundRobin"
    assert "inference_model/m" in overlay["capabilities"]
    assert [w["serving_revision"] for w in overlay["workers"]] == [OVERLAY["revision"]["value"]] * 2

    status, missing = admin_json(gateway, "/nowhere")
    assert status == 404 and set(missing["error"]) == {"message", "type", "code"}
    assert admin_json(gateway, "/admin/quota?tenant=t")[0] == 404  # quota disabled
    status, _, _ = request("127.0.0.1", gateway.admin_port, "POST", "/healthz", b"{}")
    assert status == 405
    assert status_of(raw_exchange(gateway.admin_port, b"NOT HTTP\r\n\r\n")) == 400
    status, endpoints = admin_json(gateway, "/admin/endpoints")
    assert status == 200
    (cluster,) = endpoints["clusters"]
    assert cluster["name"] == "cluster-a" and [e["address"] for e in cluster["endpoints"]] == ["127.0.0.1:9"]
    assert cluster["endpoints"][0]["in_flight"] == 0 and cluster["endpoints"][0]["slot"] is not None

    status, headers, body = admin_get(gateway.admin_port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"gridgate_workers_live 2.0" in body and b"gridgate_worker_restarts_total 0.0" in body
    # The start-up warning about a slow interpreter build, exactly when this interpreter is one (the
    # gateway runs on the tests' own: docs/operations.md, "The interpreter").
    assert ("runs from a shared libpython" in gateway.log()) == bool(interpreter_build().shared_libpython)


def test_admin_listener_keeps_alive_pipelines_and_answers_head(start_gateway):
    gateway = start_gateway(workers=1)
    pipelined = raw_exchange(gateway.admin_port, (
        b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"
        b"HEAD /readyz HTTP/1.1\r\nHost: a\r\n\r\n"
        b"GET /nowhere HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    ))
    responses = pipelined.split(b"HTTP/1.1 ")[1:]
    assert [r[:3] for r in responses] == [b"200", b"200", b"404"]
    assert responses[0].endswith(b'{"status":"ok"}')
    assert responses[1].endswith(b"content-length: 18\r\n\r\n")  # HEAD: the GET's length, no body
    assert b"connection: close" in responses[2] and b'"code":"not_found"' in responses[2]
    http10 = raw_exchange(gateway.admin_port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert status_of(http10) == 200 and b"connection: close" in http10
    too_big = b"POST /healthz HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + (
        b"1000\r\n" + b"a" * 4096 + b"\r\n") * 20 + b"0\r\n\r\n"
    assert status_of(raw_exchange(gateway.admin_port, too_big)) == 413


def test_quota_page_reads_the_embedded_valkey(start_gateway):
    quota = {
        "backend": {"kind": "embedded"},
        "rules": [{"name": "team-a", "match": {"tenant": "team-a"}, "budgets": [{"window": "1m", "tokens": 1000}]}],
    }
    gateway = start_gateway(workers=1, extra={"quota": quota})
    assert admin_json(gateway, "/admin/quota")[0] == 400
    status, report = admin_json(gateway, "/admin/quota?tenant=team-a")
    assert status == 200, report
    assert report["rules"][0]["rule"] == "team-a"
    assert report["rules"][0]["windows"][0]["remaining"] == 1000
    assert gateway.stop() == 0


# --------------------------------------------------------------------------- lifecycle and signals


def test_killed_worker_is_replaced_and_readyz_recovers(start_gateway):
    gateway = start_gateway(workers=2)
    before = gateway.worker_pids()
    os.kill(before[0], signal.SIGKILL)
    after = wait_until(lambda: (p := ready_with(gateway, 2)) and before[0] not in p and p, "a replacement worker")
    assert before[1] in after
    assert metric(gateway, "gridgate_worker_restarts_total") == 1


def test_workers_that_never_start_end_the_supervisor_with_one_line(gateway_factory):
    gateway = gateway_factory(CLUSTERS, OVERLAY, start=False)
    # A worker entry that always crashes, injected in this test only (faster backoff, same policy).
    program = (
        "import sys\n"
        "import gateway.supervisor as supervisor\n"
        "import gateway.supervisor.arbiter as arbiter\n"
        "import gateway.supervisor.lifecycle as lifecycle\n"
        "from gateway.config import load_config\n"
        "lifecycle.RESTART_BACKOFF_BASE = 0.02\n"
        "def broken(ctx):\n"
        "    raise RuntimeError('cannot start')\n"
        f"config = load_config({gateway.config_path!r})\n"
        "try:\n"
        f"    sys.exit(arbiter.Arbiter({gateway.config_path!r}, config, worker_entry=broken).run())\n"
        "except supervisor.StartupError as exc:\n"
        "    print(exc, file=sys.stderr)\n"
        "    sys.exit(1)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == "workers fail to start (exit code 1, 5 times); see the log above"
    delays = [float(d) for d in re.findall(r"replacing it in ([\d.]+)s", result.stderr)]
    assert len(delays) >= 4 and delays[0] == 0.0 and delays == sorted(delays)  # immediate, then backing off


def test_sigterm_drains_and_exits_zero(start_gateway):
    gateway = start_gateway(workers=2)
    pids = gateway.worker_pids()
    assert gateway.stop(timeout=10) == 0
    assert not any(alive(pid) for pid in pids)
    assert "Traceback" not in gateway.log()


def test_workers_do_not_outlive_a_killed_supervisor(start_gateway):
    gateway = start_gateway(workers=2)
    pids = gateway.worker_pids()
    gateway.signal(signal.SIGKILL)
    gateway.process.wait(5)
    wait_until(lambda: not any(alive(pid) for pid in pids), "the orphaned workers to drain and exit", timeout=8)


def test_sighup_with_an_invalid_config_keeps_running(start_gateway):
    gateway = start_gateway(workers=2)
    pids = gateway.worker_pids()
    gateway.config["listen"] = "not-an-address"
    gateway.write_config()
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: metric(gateway, "gridgate_reload_failures_total") == 1, "the reload to be rejected")
    assert ready_with(gateway, 2) == pids
    assert "listen: invalid address" in gateway.log()


def test_sighup_with_an_unchanged_config_keeps_the_workers(start_gateway):
    gateway = start_gateway(workers=2)
    pids = gateway.worker_pids()
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: metric(gateway, "gridgate_reloads_total") == 1, "the reload to be counted")
    assert metric(gateway, "gridgate_reload_failures_total") == 0
    assert ready_with(gateway, 2) == pids


def test_sighup_with_a_changed_config_swaps_workers_without_refusing_or_resetting_connections(start_gateway):
    gateway = start_gateway(workers=2)
    old = gateway.worker_pids()
    failures: list[str] = []
    served = 0
    done = threading.Event()

    def hammer() -> None:  # one new connection per request, so every accept queue is exercised
        nonlocal served
        while not done.is_set():
            try:
                status, _, _ = request("127.0.0.1", gateway.port, "GET", "/v1/models", timeout=5)
            except OSError as exc:
                # Refused: no listener at all. Reset: a listener closed with connections in its accept
                # queue; the new generation inherits the old one's sockets, so none closes.
                failures.append(repr(exc))
                continue
            # A connection a draining worker had already accepted is still answered (Connection: close).
            if status != 200:
                failures.append(f"status {status}")
            served += 1

    client = threading.Thread(target=hammer)
    client.start()
    try:
        wait_until(lambda: served >= 5, "requests before the reload")
        gateway.config["timeouts"]["keepalive_idle"] = "30s"
        gateway.write_config()
        gateway.signal(signal.SIGHUP)
        new = wait_until(lambda: (p := ready_with(gateway, 2)) and not set(p) & set(old) and p, "the new generation")
        wait_until(lambda: not any(alive(pid) for pid in old), "the old generation to exit")
        after_swap = served
        wait_until(lambda: served >= after_swap + 5, "requests after the swap")
    finally:
        done.set()
        client.join(10)
    assert failures == []
    assert len(new) == 2 and metric(gateway, "gridgate_config_generation") == 2


def test_sighup_moves_the_listener_unless_the_new_port_is_taken(start_gateway):
    gateway = start_gateway(workers=1)
    old_port, pids = gateway.port, gateway.worker_pids()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        gateway.config["listen"] = f"127.0.0.1:{squatter.getsockname()[1]}"
        gateway.write_config()
        gateway.signal(signal.SIGHUP)
        wait_until(lambda: metric(gateway, "gridgate_reload_failures_total") == 1, "the reload to be rejected")
    assert ready_with(gateway, 1) == pids
    assert "address already in use" in gateway.log()

    new_port = free_port()
    gateway.config["listen"] = f"127.0.0.1:{new_port}"
    gateway.write_config()
    gateway.signal(signal.SIGHUP)
    wait_until(lambda: (p := ready_with(gateway, 1)) and p != pids, "the new generation")
    assert request("127.0.0.1", new_port, "GET", "/v1/models")[0] == 200
    wait_until(lambda: not alive(pids[0]), "the old worker to exit")
    with pytest.raises(ConnectionRefusedError):
        request("127.0.0.1", old_port, "GET", "/v1/models")


def test_one_health_process_is_kept_running(start_gateway):
    gateway = start_gateway(workers=2, cluster_options={"health_check": {"type": "tcp", "interval": "1s"}})

    def health_pid() -> int | None:
        status, report = admin_json(gateway, "/admin/endpoints")
        return status == 200 and report["health_process"] and report["health_process"]["pid"]

    first = wait_until(health_pid, "the health process")
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: health_pid() not in (None, False, first), "a new health process")
    assert ready_with(gateway, 2)


def test_sigttin_and_sigttou_change_the_worker_count(start_gateway):
    gateway = start_gateway(workers=1)
    # One at a time: a second identical signal sent while the first is pending merges with it (POSIX).
    gateway.signal(signal.SIGTTIN)
    wait_until(lambda: ready_with(gateway, 2), "two workers")
    gateway.signal(signal.SIGTTIN)
    wait_until(lambda: ready_with(gateway, 3), "three workers")
    gateway.signal(signal.SIGTTOU)
    wait_until(lambda: ready_with(gateway, 2), "two workers")
    assert metric(gateway, "gridgate_workers_target") == 2


def test_a_config_reload_keeps_the_sigttin_worker_count(start_gateway):
    gateway = start_gateway(workers=1)
    gateway.signal(signal.SIGTTIN)
    before = wait_until(lambda: ready_with(gateway, 2), "two workers")
    gateway.config["timeouts"]["keepalive_idle"] = "31s"  # a change the workers need: new generation
    gateway.write_config()
    gateway.signal(signal.SIGHUP)
    after = wait_until(lambda: (p := ready_with(gateway, 2)) and not set(p) & set(before) and p, "new generation")
    assert len(after) == 2 and metric(gateway, "gridgate_workers_target") == 2


# --------------------------------------------------------------------------- systemd notifications


class NotifyListener:
    """A stand-in for systemd's notification socket that records every datagram."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def count(self, key: str) -> int:
        return sum(1 for message in list(self.messages) if key in message)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self.sock.close()


def test_sd_notify_ready_watchdog_reloading_stopping(start_gateway, tmp_path):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    try:
        gateway = start_gateway(
            workers=2, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"}
        )
        wait_until(lambda: listener.count("READY") == 1, "READY=1")
        wait_until(lambda: listener.count("WATCHDOG") >= 3, "WATCHDOG=1 pings")

        # A hung worker (no heartbeats) makes the gateway unready and silences the watchdog.
        frozen = gateway.worker_pids()[0]
        os.kill(frozen, signal.SIGSTOP)
        try:
            status, body = wait_until(lambda: (r := admin_json(gateway, "/readyz"))[0] == 503 and r, "readyz 503")
            assert "heartbeat" in body["reason"]
            # The supervisor noticed and stopped feeding the watchdog (its own word for it), and then
            # sent no ping for five watchdog intervals.
            wait_until(lambda: "watchdog: not pinging systemd (worker pid" in gateway.log(), "the watchdog withheld")
            pings = listener.count("WATCHDOG")
            time.sleep(1.0)
            assert listener.count("WATCHDOG") == pings
        finally:
            os.kill(frozen, signal.SIGCONT)
        wait_until(lambda: listener.count("WATCHDOG") > pings, "WATCHDOG=1 to resume")
        assert "watchdog: every worker's heartbeat is fresh again" in gateway.log()
        wait_until(lambda: admin_json(gateway, "/readyz")[0] == 200, "readyz 200 again")

        gateway.signal(signal.SIGHUP)
        wait_until(lambda: listener.count("READY") == 2, "READY=1 after the reload")
        assert gateway.stop() == 0
        wait_until(lambda: listener.count("STOPPING") == 1, "STOPPING=1")
    finally:
        listener.close()
    kinds = [next(k for k in ("READY", "RELOADING", "STOPPING") if k in m) for m in listener.messages
             if {"READY", "RELOADING", "STOPPING"} & set(m)]
    assert kinds == ["READY", "RELOADING", "READY", "STOPPING"]
    reloading = next(m for m in listener.messages if "RELOADING" in m)
    assert int(reloading["MONOTONIC_USEC"]) > 0
    assert all(m.get("WATCHDOG") == "1" for m in listener.messages if "WATCHDOG" in m)


# --------------------------------------------------------------------------- pure parts


def test_crash_backoff_is_immediate_first_then_doubles_capped_and_resets():
    backoff = CrashBackoff(base=0.5, cap=4.0)
    assert [backoff.next_delay(lifetime=0.1) for _ in range(6)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.next_delay(lifetime=60.0) == 0.0  # the worker had been stable: a fresh streak


def test_slot_pool_hands_out_the_lowest_free_row():
    pool = SlotPool(3)
    assert [pool.acquire(), pool.acquire(), pool.acquire()] == [0, 1, 2]
    pool.release(1)
    assert pool.acquire() == 1
    with pytest.raises(RuntimeError):
        pool.acquire()
