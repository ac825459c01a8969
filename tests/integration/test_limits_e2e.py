"""Request rates, key limits and shadow limits through real gateways, real providers and the bundled Valkey
(docs/limits.md): exact under concurrency across gateways and workers, the 429 that names its limit, the
slot a request that never reached a provider gives back, the access log and /admin/quota."""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.identity.auth import hash_api_key
from tests.harness import (
    Client,
    Response,
    admin_get,
    candidate,
    chat,
    envelope,
    metric_value,
    mock_served,
    refused_port,
    wait_until,
)


def _tenant() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}")]


def _quota(url: str, *rules: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"backend": {"kind": "valkey", "url": url}, "reservation_timeout": "10s", "rules": list(rules), **extra}


def _keys(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"keys": [{**entry, "key": hash_api_key(entry["key"])} for entry in entries]}


def _together(count: int, send: Callable[[int], Response]) -> list[Response]:
    """``count`` requests sent at the same moment (a barrier releases them), each on its own connection."""
    barrier = threading.Barrier(count)

    def one(index: int) -> Response:
        barrier.wait()
        return send(index)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def _report(gateway: Any, tenant: str) -> dict[str, Any]:
    status, _, body = admin_get(gateway.admin_port, f"/admin/quota?tenant={tenant}")
    assert status == 200, body
    return json.loads(body)


def test_forty_concurrent_requests_on_two_gateways_of_two_workers_against_count_5_admit_exactly_5(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    options = {"auth": _keys({"tenant": tenant, "key": "sk-1"}),
               "quota": _quota(valkey_url, {"name": f"r-{tenant}", "match": {"tenant": tenant},
                                            "requests": [{"window": "1m", "count": 5}]})}
    gateways = [gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2, extra=options)
                for _ in range(2)]
    served = mock_served(handle)
    answers = _together(40, lambda i: chat(gateways[i % 2].port, "m", headers=_bearer("sk-1")))
    statuses = [a.status for a in answers]
    assert statuses.count(200) == 5 and statuses.count(429) == 35, statuses
    assert mock_served(handle) - served == 5  # refused requests never reached the provider
    refused = next(a for a in answers if a.status == 429)
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    assert f"rule r-{tenant} requests 5/1m" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 12  # the next slot: one interval (12 s) at most
    assert refused.headers["x-ratelimit-limit-requests"] == "5"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    admitted = next(a for a in answers if a.status == 200)
    assert admitted.headers["x-ratelimit-limit-requests"] == "5"


def test_a_burst_of_1000_across_four_workers_never_admits_more_than_the_limit(
        valkey_url, mock_provider, gateway_factory):
    # Production defaults: worker-held blocks on (sized from use), a token budget beside the request limit.
    handle = mock_provider("p")
    tenant = _tenant()
    rule = {"name": f"r-{tenant}", "match": {"tenant": tenant}, "requests": [{"window": "1d", "count": 300}],
            "budgets": [{"window": "1d", "tokens": 10_000_000}]}
    options = {"auth": _keys({"tenant": tenant, "key": "sk-1"}), "quota": _quota(valkey_url, rule)}
    gateways = [gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2, extra=options)
                for _ in range(2)]
    served = mock_served(handle)
    with ThreadPoolExecutor(48) as pool:
        answers = list(pool.map(lambda i: chat(gateways[i % 2].port, "m", headers=_bearer("sk-1")).status,
                                range(1000)))
    admitted = answers.count(200)
    assert admitted <= 300 and answers.count(429) == 1000 - admitted, set(answers)
    assert mock_served(handle) - served == admitted
    assert admitted >= 150  # blocks held elsewhere may refuse some near the limit, never most
    for gateway in gateways:
        gateway.stop()  # their blocks go back: the slots taken are exactly the requests admitted
    assert _limits_left(valkey_url, tenant, rule) == 300 - admitted


def _limits_left(url: str, tenant: str, rule: dict[str, Any]) -> int:
    import asyncio

    from gateway.identity.limits import RequestLimit, Scope
    from gateway.quota.ledger import QuotaLedger
    from gateway.quota.rules import QuotaRule
    from gateway.valkey.client import create_client

    limit = RequestLimit(86400, rule["requests"][0]["count"], rule["requests"][0]["count"])
    scope = QuotaRule(rule["name"], (), 0, requests=(limit,)).scope
    assert isinstance(scope, Scope)

    async def read() -> int:
        ledger = QuotaLedger(create_client(url), reservation_timeout_s=10)
        try:
            return (await ledger.report(tenant, [scope]))[1][0].requests[0].remaining
        finally:
            await ledger.close()

    return asyncio.run(read())


def test_a_key_limit_applies_on_top_of_its_rule_and_its_429_names_it(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    keys = _keys({"tenant": tenant, "key": "sk-bot", "alias": "ci-bot",
                  "limits": {"requests": [{"window": "1m", "count": 2}], "budgets": [{"window": "1h", "tokens": 900}]}},
                 {"tenant": tenant, "key": "sk-human", "alias": "alice"})
    # The bots' rule: 50 an hour, a slot back every 72 s. (At 50 a minute a slot came back every 1.2 s, and
    # a slow machine that took that long over the requests below read 49 left where 48 were due.)
    rules = [{"name": f"ci-{tenant}", "match": {"key": "ci-*"}, "requests": [{"window": "1h", "count": 50}]},
             {"name": f"r-{tenant}", "match": {"tenant": tenant}, "requests": [{"window": "1m", "count": 3}]}]
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": keys, "quota": _quota(valkey_url, *rules)})
    first = chat(gateway.port, "m", headers=_bearer("sk-bot"), max_tokens=10)
    assert first.status == 200
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"]) == ("2", "1")
    assert first.headers["x-ratelimit-limit-tokens"] == "900"  # the key's own budget
    assert chat(gateway.port, "m", headers=_bearer("sk-bot"), max_tokens=10).status == 200
    refused = chat(gateway.port, "m", headers=_bearer("sk-bot"), max_tokens=10)
    assert refused.status == 429
    assert "key requests 2/1m" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 30  # a slot every 30 s
    # alice is not matched by ci-*: the tenant's rule (3 a minute) applies to her alone
    assert [chat(gateway.port, "m", headers=_bearer("sk-human")).status for _ in range(4)] == [200, 200, 200, 429]
    report = _report(gateway, tenant)
    assert [r["rule"] for r in report["rules"]] == [f"ci-{tenant}", f"r-{tenant}"]
    assert report["rules"][0]["requests"][0] | {"full_in_s": 0} == {
        "window_s": 3600, "count": 50, "burst": 50, "remaining": 48, "full_in_s": 0}
    assert report["rules"][1]["requests"][0]["remaining"] == 0
    (bot,) = report["keys"]
    assert (bot["key"], bot["requests"][0]["remaining"], bot["windows"][0]["limit"]) == ("ci-bot", 0, 900)


def _slots_back(gateway: Any, tenant: str, remaining: int) -> None:
    """Until the tenant's first request limit has ``remaining`` slots: a request that never reached a provider
    gives its slot back off the response path, moments after its answer."""
    wait_until(lambda: _report(gateway, tenant)["rules"][0]["requests"][0]["remaining"] == remaining,
               f"{remaining} request slots left")


def test_a_request_that_never_reached_a_provider_gives_its_slot_back(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    options = {"auth": _keys({"tenant": tenant, "key": "sk-1"}),
               "quota": _quota(valkey_url, {"name": f"r-{tenant}", "requests": [{"window": "1d", "count": 2}]})}
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    # No provider serves "unknown": admitted, then answered 404 without reaching one; the slot goes back.
    for _ in range(3):
        assert chat(gateway.port, "unknown", headers=_bearer("sk-1")).status == 404
        _slots_back(gateway, tenant, 2)
    # A provider's 400 reached it: that slot is spent, though nothing is charged.
    assert chat(gateway.port, "m", headers=[*_bearer("sk-1"), ("X-Mock-Status", "400")]).status == 400
    assert chat(gateway.port, "m", headers=_bearer("sk-1")).status == 200
    assert chat(gateway.port, "m", headers=_bearer("sk-1")).status == 429


def test_requests_that_could_not_connect_to_their_provider_give_their_slots_back(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    options = {"auth": _keys({"tenant": tenant, "key": "sk-1"}),
               "quota": _quota(valkey_url, {"name": f"r-{tenant}", "requests": [{"window": "1m", "count": 2}]})}
    dead = f"127.0.0.1:{refused_port()}"  # nothing listens: every connection is refused
    gateway = gateway_factory({"p": [handle.address], "dead": [dead]},
                              envelope([candidate("m", "p"), candidate("down", "dead")]), extra=options)
    for _ in range(2):  # admitted, then no connection came: the request never reached a provider
        response = chat(gateway.port, "down", headers=_bearer("sk-1"))
        assert response.status == 502 and "connection refused" in response.json()["error"]["message"]
        _slots_back(gateway, tenant, 2)
    assert [chat(gateway.port, "m", headers=_bearer("sk-1")).status for _ in range(2)] == [200, 200]
    refused = chat(gateway.port, "m", headers=_bearer("sk-1"))
    assert refused.status == 429 and f"rule r-{tenant} requests 2/1m" in refused.json()["error"]["message"]
    assert mock_served(handle) == 2


class _OnceThenGone:
    """A provider that answers one request with keep-alive, then stops listening and drops that connection
    when the next request arrives on it: the gateway's pooled connection is stale and no fresh one comes."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(10)
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            self.listener.close()  # connections are refused from now on
            conn.recv(65536)  # the next request on the pooled connection: hang up without answering


def test_a_request_only_a_stale_pooled_connection_took_gives_its_slot_back(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    once = _OnceThenGone()
    tenant = _tenant()
    options = {"auth": _keys({"tenant": tenant, "key": "sk-1"}),
               "quota": _quota(valkey_url, {"name": f"r-{tenant}", "requests": [{"window": "1m", "count": 2}]})}
    gateway = gateway_factory({"p": [handle.address], "once": [once.address]},
                              envelope([candidate("m", "p"), candidate("gone", "once")]), extra=options)
    body = {"model": "gone", "messages": [{"role": "user", "content": "hi"}]}
    client = Client(gateway.port)
    try:
        assert client.request("POST", "/v1/chat/completions", body, _bearer("sk-1")).status == 200  # slot 1
        # Written on the stale pooled connection (never taken), then no fresh connection: not reached.
        assert client.request("POST", "/v1/chat/completions", body, _bearer("sk-1")).status == 502
    finally:
        client.close()
    _slots_back(gateway, tenant, 1)
    assert chat(gateway.port, "m", headers=_bearer("sk-1")).status == 200  # slot 2
    assert chat(gateway.port, "m", headers=_bearer("sk-1")).status == 429


def test_shadow_limits_never_refuse_and_are_named_in_the_access_log_and_counted(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    rule = {"name": f"r-{tenant}", "requests": [{"window": "1d", "count": 2, "shadow": True}],
            "budgets": [{"window": "1d", "tokens": 1_000_000}]}
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _keys({"tenant": tenant, "key": "sk-1"}), "quota": _quota(valkey_url, rule),
                                     "access_log": {"path": "access.log"}})
    assert [chat(gateway.port, "m", headers=_bearer("sk-1")).status for _ in range(4)] == [200] * 4
    log_path = os.path.join(gateway.directory, "access.log")

    def lines() -> list[dict[str, Any]]:
        with open(log_path) as handle_:
            found = [json.loads(line) for line in handle_]
        return found if len(found) >= 4 else []

    logged = wait_until(lines, "four access-log lines")
    shadowed = [f"rule r-{tenant} requests 2/1d"]
    assert [line.get("shadow") for line in logged] == [None, None, shadowed, shadowed]
    wait_until(lambda: metric_value(gateway.admin_port, "gridgate_quota_shadow_refusals_total") == 2,
               "the shadow refusals in /metrics")
    report = _report(gateway, tenant)
    assert report["rules"][0]["requests"][0] | {"full_in_s": 0} == {
        "window_s": 86400, "count": 2, "burst": 2, "remaining": 0, "full_in_s": 0, "shadow": True}
