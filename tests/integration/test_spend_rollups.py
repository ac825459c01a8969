"""The daily rollups' writes (docs/pricing.md, "Spend reports"): batched off the request path, flushed at
drain, kept through a store outage, applied once per flush however often a flush is retried; and the
spend metrics across a worker's death. Real gateways, real mock providers, the bundled Valkey."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import os
import signal
import time

import valkey

from gateway.spend.rollups import DAY_S, RollupBatch, tenant_hash
from gateway.spend.store import write_batch
from gateway.valkey.client import create_client
from tests.harness import candidate, envelope, metric_value, request, wait_until
from tests.integration.test_spend_reports import PRICES, SPEND, ask, spend_gateway, wait_spend


def stored_requests(url: str, tenant: str) -> int:
    """The requests stored in yesterday's and today's rollups of ``tenant`` (UTC days, when asked). The workers
    roll a request up into the day it ended in, and a test that runs across midnight has requests in both;
    the store is the test's own (``keys_store``), so nothing else is in them."""
    today = dt.datetime.now(dt.UTC).date()
    client = valkey.Valkey.from_url(url)
    try:
        rollups = [client.hgetall(f"gridgate:spend:{{{day.isoformat()}}}:{tenant}")
                   for day in (today - dt.timedelta(days=1), today)]
    finally:
        client.close()
    return sum(int(value) for fields in rollups for field, value in fields.items() if field.startswith(b"r\x1f"))


def test_a_flush_retried_under_the_same_id_counts_once(keys_store):
    day = int(time.time() // DAY_S)

    async def flush_twice() -> None:
        client = create_client(keys_store.url, timeout_s=2.0)
        try:
            batch = RollupBatch()
            batch.add((day, "once", "-", "m"), 10, 0, 5, 0, 100)
            await write_batch(client, batch, "w1-1")
            await write_batch(client, batch, "w1-1")  # its reply was lost: the same flush again
            await write_batch(client, batch, "w1-2")  # another flush with the same counts
        finally:
            await client.aclose()

    asyncio.run(flush_twice())
    client = valkey.Valkey.from_url(keys_store.url)
    try:
        assert client.hgetall(tenant_hash(day, "once")) == {
            b"r\x1f-\x1fm": b"2", b"p\x1f-\x1fm": b"20", b"o\x1f-\x1fm": b"10", b"n\x1f-\x1fm": b"200"}
    finally:
        client.close()


def test_the_last_requests_are_flushed_when_the_gateway_stops(gateway_factory, providers, keys_store):
    gateway, _ = spend_gateway(gateway_factory, providers, keys_store.url)
    for _ in range(5):
        ask(gateway.port, "sk-team-b", "m")
    assert gateway.stop() == 0  # at once: the workers drain, and flush what they hold
    assert stored_requests(keys_store.url, "team-b") == 5


def test_rollups_wait_out_a_store_outage_in_the_workers(gateway_factory, providers, keys_store):
    """Without a quota block the rollups go to auth.store, which no request waits on: requests served while
    it is down are rolled up once it is back."""
    overlay = envelope([candidate("m", "provider-a")])
    key = "sk-outage"
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay, workers=1, extra={
        "auth": {"keys": [{"tenant": "team-o", "key": "sha256:" + hashlib.sha256(key.encode()).hexdigest()}],
                 "store": {"kind": "valkey", "url": keys_store.url}},
    })
    ask(gateway.port, key, "m")
    deadline = time.monotonic() + 10
    while stored_requests(keys_store.url, "team-o") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stored_requests(keys_store.url, "team-o") == 1
    keys_store.stop()
    for _ in range(3):
        ask(gateway.port, key, "m")
    # Flushes fail meanwhile, and are kept. (The worker flushes, and sends its counts, once a second each:
    # wait for the first failure to show rather than for a fixed time a slow machine may need more than.)
    wait_until(lambda: metric_value(gateway.admin_port, "gridgate_spend_rollup_flush_failures_total") >= 1,
               "a failed flush counted", timeout=15)
    assert metric_value(gateway.admin_port, "gridgate_spend_rollup_flush_failures_total") >= 1
    keys_store.restart()
    deadline = time.monotonic() + 15
    while stored_requests(keys_store.url, "team-o") < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stored_requests(keys_store.url, "team-o") == 4
    assert metric_value(gateway.admin_port, "gridgate_spend_rollups_dropped_total") == 0


def test_spend_metrics_survive_a_worker_killed(gateway_factory, providers, keys_store):
    gateway, _ = spend_gateway(gateway_factory, providers, keys_store.url)
    for _ in range(4):
        ask(gateway.port, "sk-team-b", "m", cached=1, reasoning=1)
    sample = 'gridgate_spend_nanousd_total{model="m",tenant="team-b"}'
    report = wait_spend(gateway, "?tenant=team-b", 4)
    total = report["totals"]["cost_nusd"]
    deadline = time.monotonic() + 5
    while metric_value(gateway.admin_port, sample) != total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(gateway.admin_port, sample) == total
    _, _, body = request("127.0.0.1", gateway.admin_port, "GET", "/admin/overlay",
                         headers=[("Authorization", f"Bearer {SPEND}")])
    for worker in json.loads(body)["workers"]:
        os.kill(worker["pid"], signal.SIGKILL)
    time.sleep(1.0)
    assert metric_value(gateway.admin_port, sample) == total  # folded into the retired totals
    ask(gateway.port, "sk-team-b", "m")
    assert wait_spend(gateway, "?tenant=team-b", 5)["totals"]["requests"] == 5
    deadline = time.monotonic() + 5
    while metric_value(gateway.admin_port, sample) <= total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_value(gateway.admin_port, sample) == wait_spend(gateway, "?tenant=team-b", 5)["totals"]["cost_nusd"]


def test_unpriced_requests_and_per_key_series_are_counted(gateway_factory, providers, keys_store):
    # "m" is priced by its override; "n" by nothing (the shipped table has no such model).
    gateway, _ = spend_gateway(gateway_factory, providers, keys_store.url, metrics_per_key=True,
                               overrides={"m": PRICES})
    ask(gateway.port, "sk-team-a-ci", "m")
    ask(gateway.port, "sk-team-a-web", "m")
    ask(gateway.port, "sk-team-b", "n")
    # Each of the two workers sends its counts once a second, and the three requests may have gone to
    # either: wait for every series, not only the one the unpriced request's worker sends.
    unpriced = 'gridgate_unpriced_requests_total{outcome="zero"}'
    per_key = [f'gridgate_spend_nanousd_total{{key="{key}",model="m",tenant="team-a"}}' for key in ("ci", "web")]
    wait_until(lambda: metric_value(gateway.admin_port, unpriced) >= 1
               and all(metric_value(gateway.admin_port, sample) > 0 for sample in per_key), "every series")
    assert metric_value(gateway.admin_port, unpriced) == 1
    for sample in per_key:
        assert metric_value(gateway.admin_port, sample) > 0
