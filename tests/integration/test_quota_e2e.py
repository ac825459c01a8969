"""Auth and token quota through real gateways, real providers and the bundled Valkey."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

from gateway.identity.auth import hash_api_key
from gateway.valkey.embedded import EmbeddedValkey
from tests.harness import (
    Client,
    admin_get,
    candidate,
    chat,
    envelope,
    mock_in_flight,
    mock_served,
    wait_until,
)


def _auth(tenants: dict[str, str]) -> dict:
    return {"keys": [{"tenant": tenant, "key": hash_api_key(key)} for tenant, key in tenants.items()]}


def _quota(url: str, tokens: int, window: str = "1h", lease: dict | None | str = "default", **extra) -> dict:
    return {
        "backend": {"kind": "valkey", "url": url},
        "reservation_timeout": "2s",
        **({} if lease == "default" else {"lease": lease}),
        "rules": [{"name": f"r-{uuid.uuid4().hex[:8]}", "budgets": [{"window": window, "tokens": tokens}],
                   "estimate": {"default_max_tokens": 10}, **extra}],
    }


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}")]


def _wait_reconciled(gateway, tenant: str, timeout: float = 5.0) -> dict:
    """Poll /admin/quota until nothing is reserved for the tenant (reconciliation is off the response path)."""
    deadline = time.monotonic() + timeout
    while True:
        report = json.loads(admin_get(gateway.admin_port, f"/admin/quota?tenant={tenant}")[2])
        reserved = [window["reserved"] for rule in report["rules"] for window in rule["windows"]]
        if not any(reserved) or time.monotonic() > deadline:
            return report
        time.sleep(0.02)


def test_auth_rejects_missing_and_unknown_keys(mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"team-a": "sk-a"})})
    before = mock_served(handle)
    missing = chat(gateway.port, "m")
    assert missing.status == 401 and missing.json()["error"]["type"] == "authentication_error"
    unknown = chat(gateway.port, "m", headers=_bearer("sk-wrong"))
    assert unknown.status == 401
    assert mock_served(handle) == before
    assert chat(gateway.port, "m", headers=_bearer("sk-a")).status == 200
    assert chat(gateway.port, "m", headers=[("X-Api-Key", "sk-a")]).status == 200


def test_each_request_on_a_keep_alive_connection_is_authenticated_by_its_own_key(mock_provider, gateway_factory):
    # The connection remembers the key its last request was admitted with: another key, a wrong one or
    # none on the same connection must still get its own answer. A 401 is decided on the head and
    # closes the connection (its body is never read), so each one ends a connection that had admitted sk-a.
    handle = mock_provider("p")
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"team-a": "sk-a", "team-b": "sk-b"}),
                                     "tenants": [{"tenant": "team-b", "allowed_capabilities": ["other"]}]})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    client = Client(gateway.port)
    try:
        def status(headers: list[tuple[str, str]]) -> int:
            return client.request("POST", "/v1/chat/completions", body, headers).status
        assert status(_bearer("sk-a")) == 200
        assert status(_bearer("sk-a")) == 200
        assert status(_bearer("sk-b")) == 403  # team-b may not use m
        assert status(_bearer("sk-a") + [("X-Api-Key", "sk-b")]) == 200  # Bearer wins
        assert status([("X-Api-Key", "sk-b")]) == 403
        assert status([("X-Api-Key", "sk-a")]) == 200
    finally:
        client.close()
    for refused in (_bearer("sk-a-"), [], [("Authorization", "Basic c2stYQ==")]):
        client = Client(gateway.port)
        try:
            assert status(_bearer("sk-a")) == 200  # the connection now remembers sk-a
            response = client.request("POST", "/v1/chat/completions", body, refused)
            assert response.status == 401 and response.headers["connection"] == "close"
        finally:
            client.close()


def test_admits_within_budget_and_denies_over_it(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    # Each request reserves ceil(body/4) + max_tokens; the mock reports usage, which is reconciled.
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"t-budget": "sk-b"}), "quota": _quota(valkey_url, 300)})
    first = chat(gateway.port, "m", headers=_bearer("sk-b"), max_tokens=10)
    assert first.status == 200
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 300
    # A provider error is charged at the estimate (~220): what is left is at most 80 from now on.
    assert chat(gateway.port, "m", headers=[*_bearer("sk-b"), ("X-Mock-Status", "500")], max_tokens=200).status == 500
    served = mock_served(handle)
    denied = chat(gateway.port, "m", headers=_bearer("sk-b"), max_tokens=200)  # fits 300, not what is left
    assert denied.status == 429
    assert denied.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(denied.headers["retry-after"]) >= 1
    assert denied.headers["x-ratelimit-limit-tokens"] == "300"
    assert "x-ratelimit-remaining-tokens" in denied.headers and "x-ratelimit-reset-tokens" in denied.headers
    # Larger than the whole window: never admitted, so not retryable, and the answer says why.
    never = chat(gateway.port, "m", headers=_bearer("sk-b"), max_tokens=5000)
    assert never.status == 429 and "retry-after" not in never.headers
    error = never.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert "the budget is 300 tokens per 1h" in error["message"] and "never be admitted" in error["message"]
    assert never.headers["x-ratelimit-limit-tokens"] == "300"
    assert mock_served(handle) == served  # a denied request never reaches a provider


def test_reconciliation_refunds_unused_reservation(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=5)
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"t-refund": "sk-r"}), "quota": _quota(valkey_url, 1000)})
    # Reserves ~900 but uses ~20: after reconciliation a second large request fits.
    for _ in range(3):
        response = chat(gateway.port, "m", headers=_bearer("sk-r"), max_tokens=900)
        assert response.status == 200, response.body
        _wait_reconciled(gateway, "t-refund")


def test_streamed_usage_is_charged_and_client_sees_no_usage_chunk(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=7)
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"t-stream": "sk-s"}), "quota": _quota(valkey_url, 100000)})
    response = chat(gateway.port, "m", headers=_bearer("sk-s"), stream=True, max_tokens=5000)
    assert response.status == 200
    assert b"[DONE]" in response.body
    assert b'"usage"' not in response.body  # the client did not ask for usage: none is shown
    report = _wait_reconciled(gateway, "t-stream")
    used = [window["used"] for rule in report["rules"] for window in rule["windows"]]
    assert used and 0 < used[0] < 100, report  # the actual usage (a few tokens), not the 5000+ estimate


def test_two_gateways_share_one_budget_exactly(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", latency_ms=50)
    body = b'{"model": "m"}'  # 14 bytes: a prompt estimate of 4 tokens, plus 32 = 36 per request
    quota = _quota(valkey_url, 10 * 36)
    quota["rules"][0]["estimate"]["default_max_tokens"] = 32
    options = {"auth": _auth({"t-shared": "sk-x"}), "quota": quota}
    gateways = [gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2, extra=options)
                for _ in range(2)]
    statuses: list[int] = []
    lock = threading.Lock()
    # The provider answers 500, which is charged at the estimate: no refund can make room mid-test.
    headers = [*_bearer("sk-x"), ("X-Mock-Status", "500")]

    def fire(port: int) -> None:
        client = Client(port)
        try:
            status = client.request("POST", "/v1/chat/completions", body, headers).status
        finally:
            client.close()
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=fire, args=(gateways[i % 2].port,)) for i in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses.count(500) == 10, statuses
    assert statuses.count(429) == 20


def test_backend_down_reject_and_allow_policies_then_recovery(tmp_path, mock_provider, gateway_factory):
    server = EmbeddedValkey(tmp_path / "valkey")
    url = server.start()
    handle = mock_provider("p")
    # Every request decided in Valkey (lease: null): an open block would keep admitting through the outage.
    reject = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                             extra={"auth": _auth({"t-down": "sk-d"}), "quota": _quota(url, 100000, lease=None)})
    allow_quota = _quota(url, 100000, lease=None)
    allow_quota["on_backend_error"] = "allow"
    allow = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                            extra={"auth": _auth({"t-down": "sk-d"}), "quota": allow_quota})
    assert chat(reject.port, "m", headers=_bearer("sk-d")).status == 200
    server.stop()
    try:
        down = chat(reject.port, "m", headers=_bearer("sk-d"))
        assert down.status == 503
        assert down.json()["error"]["type"]
        assert chat(allow.port, "m", headers=_bearer("sk-d")).status == 200
        started = time.monotonic()
        for _ in range(5):  # the breaker is open: no per-request latency for the dead backend
            assert chat(reject.port, "m", headers=_bearer("sk-d")).status == 503
        assert time.monotonic() - started < 1.0
    finally:
        restarted = EmbeddedValkey(tmp_path / "valkey")  # same data dir: same socket, same URL
    assert restarted.start() == url
    try:
        deadline = time.monotonic() + 10
        status = 0
        while time.monotonic() < deadline:
            status = chat(reject.port, "m", headers=_bearer("sk-d")).status
            if status == 200:
                break
            time.sleep(0.3)
        assert status == 200
    finally:
        reject.stop()  # before their Valkey: stopping after it, each retried its last settlement for seconds
        allow.stop()
        restarted.stop()


def test_budget_survives_gateway_restart(tmp_path, mock_provider, gateway_factory):
    handle = mock_provider("p")
    data_dir = str(tmp_path / "state")
    quota = {"backend": {"kind": "embedded", "data_dir": data_dir}, "reservation_timeout": "2s",
             "rules": [{"name": "persist", "budgets": [{"window": "1h", "tokens": 60}],
                        "estimate": {"default_max_tokens": 40}}]}
    options = {"auth": _auth({"t-persist": "sk-p"}), "quota": quota}
    first = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    headers = _bearer("sk-p") + [("X-Mock-Status", "500")]  # non-2xx: charged at the estimate
    assert chat(first.port, "m", headers=headers).status == 500
    assert first.stop() == 0
    second = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    assert chat(second.port, "m", headers=_bearer("sk-p")).status == 429


def test_tenant_concurrency_cap_applies_across_workers(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", latency_ms=1500)
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2,
                              extra={"auth": _auth({"t-cap": "sk-c"}),
                                     "quota": _quota(valkey_url, 100000, max_in_flight=1)})
    slow: list[int] = []
    first = threading.Thread(target=lambda: slow.append(chat(gateway.port, "m", headers=_bearer("sk-c")).status))
    first.start()
    # Until the first request is admitted and at the provider (1.5 s there), not a fixed 0.4 s: on a slow
    # machine the second could be admitted first, and the first then refused.
    wait_until(lambda: mock_in_flight(handle) == 1, "the first request at the provider")
    second = chat(gateway.port, "m", headers=_bearer("sk-c"))
    assert second.status == 429
    assert second.headers["retry-after"] == "1"
    first.join()
    assert slow == [200]
    # The reservation is released by the off-path reconciliation, moments after the response ended.
    deadline, status = time.monotonic() + 3, 0
    while time.monotonic() < deadline and status != 200:
        status = chat(gateway.port, "m", headers=_bearer("sk-c")).status
    assert status == 200


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def test_embedded_valkey_that_dies_is_restarted(tmp_path, mock_provider, gateway_factory):
    handle = mock_provider("p")
    quota = {"backend": {"kind": "embedded", "data_dir": str(tmp_path / "state")},
             "rules": [{"name": "revive", "budgets": [{"window": "1h", "tokens": 100000}]}]}
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"t-revive": "sk-v"}), "quota": quota})
    assert chat(gateway.port, "m", headers=_bearer("sk-v")).status == 200
    (valkey,) = [pid for pid in _children(gateway.process.pid) if "valkey" in open(f"/proc/{pid}/comm").read()]
    os.kill(valkey, signal.SIGKILL)
    deadline, status = time.monotonic() + 15, 0
    while time.monotonic() < deadline and status != 200:
        time.sleep(0.3)
        status = chat(gateway.port, "m", headers=_bearer("sk-v")).status
    assert status == 200
    assert "embedded Valkey restarted" in gateway.log()
