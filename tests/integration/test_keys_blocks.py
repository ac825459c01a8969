"""Managed keys admitted from worker-held blocks (docs/limits.md, "Worker-held blocks"; docs/keys.md): a
steady stream of a managed key costs Valkey one call per block, not one per request, and a key revoked
meanwhile is admitted from a block for at most its life (<= 1 s) even when the host's key table lags (its
supervisor frozen with SIGSTOP): the block's successor is asked for with the tenant's deny set, which
refuses it in Valkey."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

from tests.harness import Client, candidate, envelope, metric_value, wait_until
from tests.integration.test_keys_e2e import TOKENS, admin

LEASED = 'gridgate_quota_leases_total{event="admitted"}'
BODY = b'{"model": "m"}'
SLACK_S = 0.35  # a request's own time and the scheduling of two gateways on two cores


def gateway_pair(gateway_factory, providers, url: str):
    """Two gateways sharing one Valkey: the key store, the deny set and the quota's ledger."""
    handle = providers["provider-a"]
    quota = {"backend": {"kind": "valkey", "url": url},
             "lease": {"tokens": 100_000, "ttl": "5s", "headroom": 2},  # a managed key's blocks live <= 1 s
             "rules": [{"name": f"blocks-{uuid.uuid4().hex[:8]}", "budgets": [{"window": "1h", "tokens": 10**9}],
                        "estimate": {"default_max_tokens": 32}}]}
    # The keys live in the quota's Valkey. The access lines go to a file: the test freezes a supervisor,
    # which relays its workers' stdout.
    extra = {"auth": {"keys": []}, "admin": {"tokens": TOKENS}, "quota": quota, "access_log": {"path": "access.log"}}
    return [gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra=extra)
            for _ in range(2)]


def managed_key(gateway) -> tuple[str, str]:
    status, created = admin(gateway, "POST", "/admin/keys", {"tenant": "team-a", "alias": "ci"})
    assert status == 201
    return created["key"], created["record"]["kid"]


def stream(port: int, key: str, stop: threading.Event, answers: list[tuple[float, int]]) -> None:
    """Requests one after another on one connection (a new one after a refusal), each (time, status)."""
    client = Client(port)
    try:
        while not stop.is_set():
            response = client.request("POST", "/v1/chat/completions", BODY, [("Authorization", f"Bearer {key}")])
            answers.append((time.monotonic(), response.status))
            if response.status != 200 or response.headers.get("connection") == "close":
                client.close()
                client = Client(port)
    finally:
        client.close()


def test_a_managed_keys_steady_stream_is_admitted_from_blocks(gateway_factory, providers, keys_store):
    first, _ = gateway_pair(gateway_factory, providers, keys_store.url)
    key, _ = managed_key(first)
    wait_until(lambda: Client(first.port).request("POST", "/v1/chat/completions", BODY,
                                                  [("Authorization", f"Bearer {key}")]).status == 200,
               "the key to reach the gateway's table", 3)
    before = metric_value(first.admin_port, LEASED)
    stop, answers = threading.Event(), []
    runner = threading.Thread(target=stream, args=(first.port, key, stop, answers))
    runner.start()
    time.sleep(1.5)  # a stream over more than one block's life
    stop.set()
    runner.join()
    assert answers and all(status == 200 for _, status in answers)
    wait_until(lambda: metric_value(first.admin_port, LEASED) - before >= len(answers) - 3, "the metrics published", 3)
    # Every request but the few that asked for a block (the first, and one per block lost across a window
    # edge at most) was admitted from a block held by the worker: no Valkey round trip.
    assert metric_value(first.admin_port, LEASED) - before >= len(answers) - 3


def test_a_revoked_key_is_admitted_from_a_block_for_at_most_its_life_when_the_table_lags(
        gateway_factory, providers, keys_store):
    first, second = gateway_pair(gateway_factory, providers, keys_store.url)
    key, kid = managed_key(first)
    wait_until(lambda: Client(second.port).request("POST", "/v1/chat/completions", BODY,
                                                   [("Authorization", f"Bearer {key}")]).status == 200,
               "the key to reach the second gateway's table", 3)
    stop, answers = threading.Event(), []
    runner = threading.Thread(target=stream, args=(second.port, key, stop, answers))
    runner.start()
    try:
        wait_until(lambda: len(answers) > 20, "the stream running on blocks", 3)
        os.kill(second.process.pid, signal.SIGSTOP)  # its key table follower stops: the table lags
        try:
            assert admin(first, "POST", f"/admin/keys/{kid}/revoke")[0] == 200
            revoked_at = time.monotonic()
            wait_until(lambda: any(status == 401 for at, status in answers if at > revoked_at),
                       "the revoked key refused in Valkey", 1.0 + 2 * SLACK_S)
            time.sleep(0.3)  # and it stays refused
        finally:
            os.kill(second.process.pid, signal.SIGCONT)
    finally:
        stop.set()
        runner.join()
    after = [(at - revoked_at, status) for at, status in answers if at > revoked_at]
    last_admitted = max((at for at, status in after if status == 200), default=0.0)
    assert last_admitted <= 1.0 + SLACK_S, f"admitted {last_admitted:.3f}s after the revocation"
    first_refusal = next(index for index, (_, status) in enumerate(after) if status == 401)
    assert all(status == 401 for _, status in after[first_refusal:])  # refused from then on, never admitted again
