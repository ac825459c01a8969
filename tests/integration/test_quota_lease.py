"""Worker-held token blocks (``quota.lease``) through real gateways, real providers and the bundled Valkey."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

from gateway.valkey.embedded import EmbeddedValkey
from loadtest.fault_proxy import FaultProxyThread
from tests.harness import Client, admin_get, candidate, chat, envelope, metric_value, wait_until
from tests.integration.test_quota_e2e import _auth, _bearer

GRANTED = 'gridgate_quota_leases_total{event="granted"}'
LEASED = 'gridgate_quota_leases_total{event="admitted"}'
# 14 bytes of body: a prompt estimate of 4 tokens, plus default_max_tokens 32 = 36 per request.
BODY = b'{"model": "m"}'
ESTIMATE = 36


def _lease_quota(url: str, tokens: int, *, block: int, ttl: str = "300ms", headroom: int = 2,
                 timeout: str = "30s", **rule: object) -> dict:
    return {
        "backend": {"kind": "valkey", "url": url},
        "reservation_timeout": timeout,
        "lease": {"tokens": block, "ttl": ttl, "headroom": headroom},
        "rules": [{"name": f"lease-{uuid.uuid4().hex[:8]}", "budgets": [{"window": "1h", "tokens": tokens}],
                   "estimate": {"default_max_tokens": 32}, **rule}],
    }


def _window(gateway, tenant: str, index: int = 0) -> dict:
    report = json.loads(admin_get(gateway.admin_port, f"/admin/quota?tenant={tenant}")[2])
    return report["rules"][0]["windows"][index]


def _post(port: int, headers: list[tuple[str, str]]) -> int:
    client = Client(port)
    try:
        return client.request("POST", "/v1/chat/completions", BODY, headers).status
    finally:
        client.close()


def test_leased_requests_are_charged_their_usage_and_the_block_goes_back(valkey_url, mock_provider,
                                                                          gateway_factory):
    handle = mock_provider("p", tokens=5)
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"t-lease": "sk-l"}),
                                     "quota": _lease_quota(valkey_url, 1_000_000, block=5000, ttl="1s")})
    charged = 0
    for _ in range(20):
        response = chat(gateway.port, "m", headers=_bearer("sk-l"), max_tokens=10)
        assert response.status == 200, response.body
        assert int(response.headers["x-ratelimit-remaining-tokens"]) < 1_000_000
        assert response.headers["x-ratelimit-limit-tokens"] == "1000000"
        charged += response.json()["usage"]["total_tokens"]
    # The first request reserved in Valkey and asked for a block; (nearly) all others came from it.
    wait_until(lambda: metric_value(gateway.admin_port, LEASED) >= 15, "requests admitted from a block")
    assert metric_value(gateway.admin_port, GRANTED) >= 1
    # While the block is open Valkey holds it as one reservation; after its ttl it is settled with
    # exactly the usage its requests reported, and nothing stays reserved.
    window = wait_until(lambda: (w := _window(gateway, "t-lease"))["reserved"] == 0 and w,
                        "the block settled", timeout=10)
    assert window["used"] == charged


def test_blocks_never_overspend_a_shared_budget_and_leave_it_exact(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", latency_ms=5)
    budget = 100 * ESTIMATE
    # Blocks of 10 requests while 50 would fit; every answer is a 500, charged at the estimate, so
    # exactly 100 requests can ever be admitted, however blocks and single reservations mix. (Four
    # workers hold at most four blocks: the burst admits at least 60, so the end needs no block.)
    options = {"auth": _auth({"t-share": "sk-s"}),
               "quota": _lease_quota(valkey_url, budget, block=10 * ESTIMATE, ttl="200ms", headroom=5)}
    gateways = [gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2, extra=options)
                for _ in range(2)]
    headers = [*_bearer("sk-s"), ("X-Mock-Status", "500")]
    statuses: list[int] = []
    lock = threading.Lock()

    def fire(port: int, count: int) -> None:
        for _ in range(count):
            status = _post(port, headers)
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=fire, args=(gateways[i % 2].port, 20)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(statuses) <= {500, 429}, statuses
    assert statuses.count(500) <= 100  # never more than the budget holds
    wait_until(lambda: sum(metric_value(g.admin_port, GRANTED) for g in gateways) >= 1, "blocks granted")
    # Blocks still open at the end go back after their ttl; then the last of the budget is admitted
    # one reservation at a time (too little room is left for blocks), exactly to the limit.
    wait_until(lambda: _window(gateways[0], "t-share")["reserved"] == 0, "every block settled", timeout=10)
    late = 0
    while _post(gateways[late % 2].port, headers) == 500:
        late += 1
        assert late <= 100
    assert statuses.count(500) + late == 100
    assert _window(gateways[1], "t-share")["used"] == budget


def test_rules_with_a_concurrency_cap_and_budgets_near_the_limit_never_lease(valkey_url, mock_provider,
                                                                             gateway_factory):
    handle = mock_provider("p")
    capped = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                             extra={"auth": _auth({"t-cap": "sk-c"}),
                                    "quota": _lease_quota(valkey_url, 1_000_000, block=100, max_in_flight=4)})
    # 10 blocks of headroom wanted, 9 blocks of room: every request reserves in Valkey.
    tight = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                            extra={"auth": _auth({"t-tight": "sk-t"}),
                                   "quota": _lease_quota(valkey_url, 900 * ESTIMATE, block=100 * ESTIMATE,
                                                         headroom=10)})
    for _ in range(10):
        assert _post(capped.port, _bearer("sk-c")) == 200
        assert _post(tight.port, _bearer("sk-t")) == 200
    for gateway in (capped, tight):
        wait_until(lambda g=gateway: metric_value(g.admin_port, 'gridgate_quota_decisions_total{reason="admitted"}')
                   >= 10, "the admissions published")
        assert metric_value(gateway.admin_port, GRANTED) == 0
        assert metric_value(gateway.admin_port, LEASED) == 0


def test_a_stopping_gateway_settles_its_blocks_and_a_dead_worker_s_are_swept(valkey_url, mock_provider,
                                                                               gateway_factory):
    handle = mock_provider("p", tokens=5)
    block = 5000
    options = {"auth": _auth({"t-stop": "sk-x"}),
               "quota": _lease_quota(valkey_url, 1_000_000, block=block, ttl="60s", timeout="60s")}
    first = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    observer = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    charged = 0
    for _ in range(5):
        response = chat(first.port, "m", headers=_bearer("sk-x"))
        assert response.status == 200
        charged += response.json()["usage"]["total_tokens"]
    wait_until(lambda: _window(observer, "t-stop")["reserved"] == block, "the block held in Valkey")
    # SIGTERM: the worker drains and settles its block at once (its ttl and the timeout are 60 s).
    assert first.stop() == 0
    window = _window(observer, "t-stop")
    assert (window["reserved"], window["used"]) == (0, charged)
    # SIGKILL: the supervisor sweeps the dead worker's block, charged at its size (its requests may
    # have reached a provider; the worker took their usage with it).
    second = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    assert chat(second.port, "m", headers=_bearer("sk-x")).status == 200
    assert chat(second.port, "m", headers=_bearer("sk-x")).status == 200
    wait_until(lambda: metric_value(second.admin_port, GRANTED) >= 1, "a block for the second gateway")
    held = _window(observer, "t-stop")
    assert held["reserved"] == block
    os.kill(second.worker_pids()[0], signal.SIGKILL)
    swept = wait_until(lambda: (w := _window(observer, "t-stop"))["reserved"] == 0 and w, "the sweep", timeout=10)
    assert swept["used"] == held["used"] + block


def test_a_block_closes_when_the_first_window_of_its_rule_ends(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=5)
    quota = _lease_quota(valkey_url, 1_000_000, block=5000, ttl="60s")
    quota["rules"][0]["budgets"] = [{"window": "1h", "tokens": 1_000_000}, {"window": "2s", "tokens": 1_000_000}]
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"t-window": "sk-w"}), "quota": quota})
    charged = 0
    for _ in range(3):
        response = chat(gateway.port, "m", headers=_bearer("sk-w"))
        assert response.status == 200
        charged += response.json()["usage"]["total_tokens"]
    wait_until(lambda: metric_value(gateway.admin_port, GRANTED) >= 1, "a block granted")
    # Its ttl is a minute, but it was reserved in this 2 s window: it closes at the window's end and
    # is settled, which the hour's window shows (the 2 s window it was charged to is gone by then).
    hour = wait_until(lambda: (w := _window(gateway, "t-window"))["reserved"] == 0 and w, "the block settled",
                      timeout=5)
    assert hour["used"] == charged


def test_an_open_block_keeps_admitting_while_valkey_is_down(tmp_path, mock_provider, gateway_factory):
    server = EmbeddedValkey(tmp_path / "valkey")
    url = server.start()
    try:
        handle = mock_provider("p")
        gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                                  extra={"auth": _auth({"t-down": "sk-d"}),
                                         "quota": _lease_quota(url, 1_000_000, block=5000, ttl="60s")})
        assert chat(gateway.port, "m", headers=_bearer("sk-d")).status == 200
        wait_until(lambda: metric_value(gateway.admin_port, GRANTED) >= 1, "a block granted")
        server.stop()
        # The budget was reserved before Valkey went away: the block admits without it (the
        # on_backend_error policy, reject, would answer 503 to a request that needs Valkey).
        for _ in range(5):
            assert chat(gateway.port, "m", headers=_bearer("sk-d")).status == 200
        # A request larger than the block needs Valkey: the policy answers for it.
        assert chat(gateway.port, "m", headers=_bearer("sk-d"), max_tokens=6000).status == 503
        restarted = EmbeddedValkey(tmp_path / "valkey")  # same data dir: same socket, same URL
        assert restarted.start() == url
        try:
            assert gateway.stop() == 0  # settles its block into the restarted Valkey
        finally:
            restarted.stop()
    finally:
        server.stop()  # idempotent: only if a failure came first


def _steady_stream(port: int, key: str, seconds: float) -> int:
    """Requests one after another on one connection (5 ms apart) for ``seconds``, each answered 200: how many."""
    client = Client(port)
    sent = 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            response = client.request("POST", "/v1/chat/completions", BODY, _bearer(key))
            assert response.status == 200, response.body
            sent += 1
            time.sleep(0.005)
    finally:
        client.close()
    return sent


def test_the_next_block_is_taken_before_the_open_one_expires(valkey_url, mock_provider, gateway_factory):
    """A steady stream of requests never falls back to Valkey between blocks: each block's successor is
    asked for shortly before it expires, so only the very first request reserves in Valkey."""
    handle = mock_provider("p", tokens=5)
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra={"auth": _auth({"t-renew": "sk-r"}),
                                     "quota": _lease_quota(valkey_url, 10**9, block=100_000, ttl="400ms")})
    sent = _steady_stream(gateway.port, "sk-r", 2.0)  # five blocks' worth of time
    wait_until(lambda: metric_value(gateway.admin_port, LEASED) >= sent - 1, "the metrics published", timeout=3)
    assert metric_value(gateway.admin_port, LEASED) == sent - 1
    assert metric_value(gateway.admin_port, GRANTED) >= 4
    # Replaced blocks were settled with what their requests used: nothing stays reserved beyond the open one.
    window = _window(gateway, "t-renew")
    assert window["reserved"] <= 100_000


def test_a_block_admits_until_its_late_successor_arrives(keys_store, mock_provider, gateway_factory):
    """Valkey answering slowly (every reply 150 ms late, through a fault proxy): each block's successor,
    asked for 100 ms before the block expires, arrives after it. The block keeps admitting until the
    successor is there, so a steady stream still goes to Valkey only for its first request, rather than
    one request at a time whenever Valkey is slow."""
    handle = mock_provider("p", tokens=5)
    credentials, _, address = keys_store.url.removeprefix("valkey://").rpartition("@")  # a TCP Valkey of its own
    with FaultProxyThread(address.split("/")[0]) as proxy:
        quota = _lease_quota(f"valkey://{credentials}@{proxy.address}/0", 10**9, block=100_000, ttl="1s")
        gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                                  extra={"auth": _auth({"t-late": "sk-late"}), "quota": quota})
        sent = _steady_stream(gateway.port, "sk-late", 0.3)  # the first block, granted at once
        proxy.set_fault(chunk_delay_s=0.15)  # under the 250 ms a ledger call may take
        sent += _steady_stream(gateway.port, "sk-late", 3.5)  # three successors, each late
        wait_until(lambda: metric_value(gateway.admin_port, LEASED) >= sent - 1, "the metrics published",
                   timeout=3)
        assert metric_value(gateway.admin_port, LEASED) == sent - 1
        assert metric_value(gateway.admin_port, GRANTED) >= 4
        proxy.set_fault()
        # The blocks it replaced are settled (the last one's settle may still be on its way): nothing stays
        # reserved beyond the open one.
        wait_until(lambda: _window(gateway, "t-late")["reserved"] <= 100_000, "the replaced blocks settled")
        # Stopped while the proxy still runs: after it, the gateway's last settlement retried a dead address
        # for 6 s of teardown.
        gateway.stop()
