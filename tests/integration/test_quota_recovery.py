"""Quota faults through real gateways with the bundled Valkey the supervisor runs: a Valkey crash under
load costs no more than it lasts, and a worker killed mid-request leaves no reservation behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import h11
import pytest

from gateway.valkey.embedded import _answers_ping
from tests.harness import Client, admin_get, candidate, chat, envelope, metric_value
from tests.integration.test_quota_e2e import _auth, _bearer, _children


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A data dir short enough for the embedded Valkey's unix socket (the test pings it there)."""
    path = tempfile.mkdtemp(prefix="gg-q-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _embedded_quota(data_dir: str, **rule: object) -> dict:
    # Every request decided in Valkey (no worker-held blocks): these tests watch each admission meet the outage.
    return {"backend": {"kind": "embedded", "data_dir": data_dir}, "lease": None,
            "rules": [{"name": "faults", "budgets": [{"window": "1h", "tokens": 10**9}],
                       "estimate": {"default_max_tokens": 100}, **rule}]}


def _quota_page(admin_port: int, tenant: str) -> tuple[int, int, int]:
    """(in flight, reserved, used) of the tenant's first rule and window, or (-1, -1, -1)."""
    status, _, body = admin_get(admin_port, f"/admin/quota?tenant={tenant}")
    if status != 200:
        return -1, -1, -1
    rule = json.loads(body)["rules"][0]
    return rule["in_flight"], rule["windows"][0]["reserved"], rule["windows"][0]["used"]


def test_a_valkey_crash_under_load_costs_no_more_than_it_lasts(short_dir, mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2,
                              extra={"auth": _auth({"t-crash": "sk-c"}), "quota": _embedded_quota(short_dir)})
    socket_path = Path(short_dir, "valkey.sock")
    assert _answers_ping(socket_path, 0, None)
    results: list[tuple[float, int]] = []
    stop = threading.Event()

    def load() -> None:
        client = Client(gateway.port)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        while not stop.is_set():
            try:
                status = client.request("POST", "/v1/chat/completions", body, _bearer("sk-c")).status
            except OSError:
                client.close()
                client = Client(gateway.port)
                continue
            results.append((time.monotonic(), status))
            if client.conn.our_state is not h11.IDLE:  # the answer closed the connection (Connection: close)
                client.close()
                client = Client(gateway.port)
        client.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        (valkey,) = [pid for pid in _children(gateway.process.pid) if "valkey" in open(f"/proc/{pid}/comm").read()]
        os.kill(valkey, signal.SIGKILL)
        crashed = time.monotonic()
        while _answers_ping(socket_path, 0, None) and time.monotonic() - crashed < 2:
            time.sleep(0.002)  # the socket may answer for a moment while the process goes
        deadline = crashed + 10
        while not _answers_ping(socket_path, 0, None):  # the supervisor restarts it
            assert time.monotonic() < deadline, "the embedded Valkey was not restarted"
            time.sleep(0.002)
        first_pong = time.monotonic()
        while not any(t > first_pong and status == 200 for t, status in results):
            assert time.monotonic() - first_pong < 5, "no success after Valkey came back"
            time.sleep(0.005)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    first_success = min(t for t, status in results if t > first_pong and status == 200)
    assert first_success - first_pong < 0.5, f"first success {first_success - first_pong:.3f}s after the first PONG"
    during = {status for t, status in results if crashed < t < first_pong}
    assert during <= {200, 503}, during  # refused with 503 (reject policy) while down, nothing else
    assert 503 in {status for _, status in results}
    deadline = time.monotonic() + 5  # workers publish their counters once a second
    while metric_value(gateway.admin_port, 'gridgate_quota_breaker_transitions_total{to="closed"}') < 1:
        assert time.monotonic() < deadline, "breaker transitions not in /metrics"
        time.sleep(0.2)
    assert metric_value(gateway.admin_port, 'gridgate_quota_breaker_transitions_total{to="open"}') >= 1


def test_killed_workers_leave_no_reservation_behind(short_dir, mock_provider, gateway_factory):
    handle = mock_provider("p", latency_ms=8000)  # slower than the whole test
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2,
                              extra={"auth": _auth({"t-dead": "sk-d"}),
                                     "quota": _embedded_quota(short_dir, max_in_flight=4)})

    def slow_request() -> None:
        try:
            chat(gateway.port, "m", headers=_bearer("sk-d"))
        except (OSError, h11.ProtocolError):
            pass  # the worker serving it is killed: the client sees the connection close

    threads = [threading.Thread(target=slow_request) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while _quota_page(gateway.admin_port, "t-dead")[0] != 4:
        assert time.monotonic() < deadline, "the 4 slow requests were not admitted"
        time.sleep(0.05)
    in_flight, reserved, used = _quota_page(gateway.admin_port, "t-dead")
    assert reserved > 0 and used == 0
    assert chat(gateway.port, "m", headers=_bearer("sk-d")).status == 429  # max_in_flight 4 is full

    for pid in gateway.worker_pids():
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while _quota_page(gateway.admin_port, "t-dead")[:2] != (0, 0):
        assert time.monotonic() - killed < 5, f"still held: {_quota_page(gateway.admin_port, 't-dead')}"
        time.sleep(0.05)
    assert _quota_page(gateway.admin_port, "t-dead")[2] == reserved  # charged at the estimate, once
    for thread in threads:
        thread.join(10)
    gateway.wait_ready()
    swept = re.findall(r"quota: settled (\d+) reservation", gateway.log())
    assert sum(map(int, swept)) == 4, gateway.log()
