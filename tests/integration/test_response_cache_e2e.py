"""The response cache through a real gateway (supervisor, worker, managed keys, the bundled Valkey) and a
real mock provider: a key revoked after its answer was cached cannot read it; the spend report, ``gridgate
spend`` and the metrics show what hits saved; the quota's embedded Valkey is the default backend; the
cache's Valkey stopped and started again passes traffic, then hits again (docs/cache.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

from gateway.identity.auth import hash_api_key
from tests.harness import ROOT, candidate, envelope, metric_value, mock_served, request, wait_until
from tests.integration.test_access_log import wait_lines
from tests.integration.test_keys_e2e import TOKENS, admin
from tests.integration.test_spend_reports import PRICES, SPEND, cost_of, spend
from tests.integration.test_spend_reports import TOKENS as SPEND_TOKENS


def test_a_key_revoked_after_its_answer_was_cached_cannot_read_it(gateway_factory, mock_provider, keys_store):
    handle = mock_provider("provider-a")
    extra = {"auth": {}, "admin": {"tokens": TOKENS}, "workers": 1,
             "quota": {"backend": {"kind": "valkey", "url": keys_store.url}, "lease": None,
                       "rules": [{"name": "r", "budgets": [{"window": "1m", "tokens": 1_000_000}]}]},
             "cache": {"enabled": True}}
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra=extra)
    status, created = admin(gateway, "POST", "/admin/keys", {"tenant": "team-c"})
    assert status == 201
    kid, secret = created["record"]["kid"], created["key"]
    body = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "temperature": 0}
    auth = [("Authorization", f"Bearer {secret}")]
    # A key just made reaches the worker's table a moment later (401 until then; nothing cached or sent).
    first = wait_until(lambda: (answer := request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body,
                                                  auth))[0] != 401 and answer, "the new key in the worker's table")
    states = [dict(first[1]).get("x-gridgate-cache")]
    assert first[0] == 200
    for _ in range(2):
        status, headers, _ = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body, auth)
        assert status == 200
        states.append(dict(headers)["x-gridgate-cache"])
    assert states[0] == "miss" and states[-1] == "hit"  # (the second may race the store of the first)
    served = mock_served(handle)
    status, _ = admin(gateway, "POST", f"/admin/keys/{kid}/revoke")
    assert status == 200
    status, headers, data = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body, auth)
    assert status == 401 and json.loads(data)["error"]["code"] == "key_revoked"
    assert dict(headers).get("x-gridgate-cache") != "hit"
    assert mock_served(handle) == served


HITS = 4


def test_the_spend_report_the_command_and_the_metric_show_what_the_hits_saved(gateway_factory, mock_provider,
                                                                                keys_store):
    """A miss then ``HITS`` hits of a priced model, through a real gateway of two workers: /admin/spend,
    ``gridgate spend`` and ``gridgate_cache_saved_nanousd_total`` all say the hits saved exactly ``HITS`` times
    the miss's cost (integer nano-USD), and the cost column holds the miss alone."""
    handle = mock_provider("provider-a")
    tenant = f"team-{uuid.uuid4().hex[:8]}"
    secret = f"sk-{uuid.uuid4().hex}"
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), workers=2,
                              extra={"auth": {"keys": [{"tenant": tenant, "key": hash_api_key(secret)}]},
                                     "admin": {"tokens": SPEND_TOKENS},
                                     "quota": {"backend": {"kind": "valkey", "url": keys_store.url},
                                               "rules": [{"name": "all",
                                                          "budgets": [{"window": "1h", "tokens": 10_000_000}]}]},
                                     "pricing": {"overrides": {"m": PRICES}},
                                     "access_log": {"path": "access.log"},
                                     "cache": {"enabled": True}})
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 20}], "temperature": 0}
    auth = [("Authorization", f"Bearer {secret}"), ("X-Mock-Tokens", "12")]
    status, headers, data = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body, auth)
    assert status == 200 and headers["x-gridgate-cache"] == "miss"
    usage = json.loads(data)["usage"]
    cost = cost_of(usage["prompt_tokens"], 0, usage["completion_tokens"], 0)  # docs/pricing.md, by hand
    assert cost > 0
    path = os.path.join(gateway.directory, "access.log")
    wait_lines(path, 1, timeout=10.0)  # the miss's line is written once its answer was stored
    for _ in range(HITS):
        status, headers, again = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body, auth)
        assert (status, headers["x-gridgate-cache"], again) == (200, "hit", data)
    assert mock_served(handle) == 1

    lines = wait_lines(path, 1 + HITS, timeout=10.0)
    assert [line["cache"] for line in lines] == ["miss"] + ["hit"] * HITS
    assert lines[0]["cost_nusd"] == cost and all(line["saved_nusd"] == cost for line in lines[1:])
    saved = HITS * cost
    saved_tokens = HITS * (usage["prompt_tokens"] + usage["completion_tokens"])
    # Each worker flushes its own rollups: wait for the miss's worker and the hits' worker(s) alike.
    report = wait_until(lambda: (answer := spend(gateway, "?group_by=tenant")[1])["totals"]["cache_hits"] == HITS
                        and answer["totals"]["requests"] == 1 and answer, "the miss and the hits in the rollups")
    (row,) = report["data"]
    assert row["tenant"] == tenant
    assert (row["requests"], row["cost_nusd"], row["cache_hits"]) == (1, cost, HITS)  # requests: reached a provider
    assert (row["saved_nusd"], row["saved_tokens"]) == (saved, saved_tokens)
    assert (row["cost_usd"], row["saved_usd"]) == (usd(cost), usd(saved))
    assert report["totals"]["saved_nusd"] == saved and report["totals"]["cost_nusd"] == cost

    command = [sys.executable, "-m", "gateway", "spend", "-c", gateway.config_path, "--group-by", "tenant"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT,
                          env={**os.environ, "GRIDGATE_ADMIN_TOKEN": SPEND})
    assert done.returncode == 0, done.stderr
    _, header, table_row, _, total = done.stdout.splitlines()
    columns = header.split()
    assert dict(zip(columns, table_row.split(), strict=True)) == {
        "tenant": tenant, "requests": "1", "prompt": str(usage["prompt_tokens"]), "cached": "0",
        "completion": str(usage["completion_tokens"]), "reasoning": "0", "cost_usd": usd(cost), "hits": str(HITS),
        "saved": usd(saved)}
    assert total.split()[columns.index("saved")] == usd(saved)

    series = f'gridgate_cache_saved_nanousd_total{{tenant="{tenant}"}}'
    wait_until(lambda: metric_value(gateway.admin_port, series) == saved, "the saved metric", timeout=5)
    assert metric_value(gateway.admin_port, f'gridgate_cache_hits_total{{tenant="{tenant}"}}') == HITS
    assert metric_value(gateway.admin_port, f'gridgate_cache_misses_total{{tenant="{tenant}"}}') == 1


def usd(nusd: int) -> str:
    """The report's decimal USD of ``nusd`` (exact: nine decimals, trailing zeros dropped)."""
    return f"{nusd // 10**9}.{nusd % 10**9:09d}".rstrip("0").rstrip(".")


def ask_chat(gateway, question: dict) -> tuple[int, str | None, bytes]:
    status, headers, data = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", question)
    return status, headers.get("x-gridgate-cache"), data


def test_the_cache_lives_in_the_quotas_embedded_valkey_by_default(gateway_factory, mock_provider):
    """No cache backend and a quota block of its own default (the bundled Valkey the supervisor starts):
    the cache uses it, across two workers."""
    handle = mock_provider("provider-a")
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), workers=2,
                              extra={"quota": {"rules": [{"name": "r", "requests": [{"window": "1d", "count": 100}]}]},
                                     "cache": {"enabled": True}})
    question = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "temperature": 0}
    status, state, first = ask_chat(gateway, question)
    assert (status, state) == (200, "miss")
    answers = [ask_chat(gateway, question) for _ in range(6)]  # new connections: both workers
    assert answers == [(200, "hit", first)] * 6
    assert mock_served(handle) == 1


def test_the_caches_valkey_stopped_and_started_again(gateway_factory, mock_provider, keys_store):
    """The cache's own Valkey goes away under a real gateway: every request is answered by the provider
    (bypass), none with an error; once it is back (its append-only file kept the entry) hits resume."""
    handle = mock_provider("provider-a")
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), workers=1,
                              extra={"cache": {"enabled": True, "backend": {"url": keys_store.url}, "local": None}})
    question = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "temperature": 0}
    assert ask_chat(gateway, question)[0] == 200
    wait_until(lambda: ask_chat(gateway, question)[1] == "hit", "the entry stored", timeout=5)
    # The entry as stored: a repeat sent before the first answer's SET landed (written on a connection of its
    # own) was a miss too and may store its own answer over it, so the stored one is what a hit returns once
    # those writes are through.
    time.sleep(0.3)
    hit_status, state, first = ask_chat(gateway, question)
    assert (hit_status, state) == (200, "hit")
    served = mock_served(handle)
    keys_store.stop()
    down = [ask_chat(gateway, question) for _ in range(5)]
    assert [(status, state) for status, state, _ in down] == [(200, "bypass")] * 5
    assert mock_served(handle) == served + 5
    keys_store.start()
    meanwhile: list[tuple[int, str | None, bytes]] = []
    back = wait_until(lambda: (meanwhile.append(ask_chat(gateway, question)) or meanwhile[-1][1] == "hit")
                      and meanwhile[-1], "hits again", timeout=10)
    assert back == (200, "hit", first), [(s, st) for s, st, _ in meanwhile][-5:]
    assert {status for status, _, _ in meanwhile} == {200}  # the bypasses until it answered again


def test_with_worker_held_blocks_a_revoked_key_reads_no_cached_answer_after_a_second(
        gateway_factory, mock_provider, keys_store):
    """Leases on (the default): the key's hits are admitted from its worker-held block, in memory. Once it
    is revoked, docs/keys.md bounds what a block may still admit to 1 s: within that (and a little for the
    host table) every repeat is refused 401 ``key_revoked`` and none is answered from the cache again."""

    handle = mock_provider("provider-a")
    extra = {"auth": {}, "admin": {"tokens": TOKENS}, "workers": 1,
             "quota": {"backend": {"kind": "valkey", "url": keys_store.url},
                       "rules": [{"name": "r", "requests": [{"window": "1d", "count": 100_000}]}]},
             "cache": {"enabled": True}}
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra=extra)
    status, created = admin(gateway, "POST", "/admin/keys", {"tenant": "team-d"})
    assert status == 201
    kid, secret = created["record"]["kid"], created["key"]
    body = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "temperature": 0}
    auth = [("Authorization", f"Bearer {secret}")]

    def ask() -> tuple[int, str | None, bytes]:
        status, headers, data = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body, auth)
        return status, headers.get("x-gridgate-cache"), data

    # A key just made reaches the worker's table a moment later (401 until then; nothing cached or sent).
    first = wait_until(lambda: (answer := ask())[0] != 401 and answer, "the new key in the worker's table")
    assert first[:2] == (200, "miss")
    wait_until(lambda: ask()[1] == "hit", "the entry stored", timeout=5)
    assert [ask()[:2] for _ in range(10)] == [(200, "hit")] * 10  # from the key's block
    served = mock_served(handle)
    assert admin(gateway, "POST", f"/admin/keys/{kid}/revoke")[0] == 200
    revoked_at = time.monotonic()
    first_refusal = wait_until(lambda: (answer := ask())[0] == 401 and answer, "the revoked key refused", timeout=5)
    assert time.monotonic() - revoked_at < 2.0
    assert json.loads(first_refusal[2])["error"]["code"] == "key_revoked"
    after = [ask() for _ in range(5)]
    assert [(status, state) for status, state, _ in after] == [(401, None)] * 5
    assert mock_served(handle) == served
