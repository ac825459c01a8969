"""What was spent, reported (docs/pricing.md, "Spend reports"): access-log fields, daily rollups in Valkey
and ``GET /admin/spend``, through real gateways, real mock providers and a real bundled Valkey."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import valkey

from tests.harness import ROOT, candidate, chat, envelope, metric_value, request, wait_until
from tests.integration.test_access_log import wait_lines

SPEND, VIEWER = "spend-reader-token", "keys-only-token"
TOKENS = [
    {"name": "finance", "key": "sha256:" + hashlib.sha256(SPEND.encode()).hexdigest(), "scopes": ["spend:read"]},
    {"name": "viewer", "key": "sha256:" + hashlib.sha256(VIEWER.encode()).hexdigest(), "scopes": ["keys:read"]},
]
KEYS = {"sk-team-a-ci": ("team-a", "ci"), "sk-team-a-web": ("team-a", "web"), "sk-team-b": ("team-b", None)}
# USD per million tokens -> nano-USD per token: input 2000, cached 1000, output 8000, reasoning 16000.
PRICES = {"input": 2, "output": 8, "cached_input": 1, "reasoning": 16}


def cost_of(prompt: int, cached: int, completion: int, reasoning: int) -> int:
    """What docs/pricing.md says a request costs at ``PRICES``, in nano-USD (whole here: no rounding)."""
    return (prompt - cached) * 2000 + cached * 1000 + (completion - reasoning) * 8000 + reasoning * 16000


def spend_gateway(gateway_factory, providers, store_url: str, **pricing: Any):
    overlay = envelope([candidate("m", "provider-a"), candidate("n", "provider-b")])
    clusters = {name: [providers[name].address] for name in ("provider-a", "provider-b")}
    keys = [{"tenant": tenant, "key": "sha256:" + hashlib.sha256(key.encode()).hexdigest(),
             **({"alias": alias} if alias else {})} for key, (tenant, alias) in KEYS.items()]
    gateway = gateway_factory(clusters, overlay, workers=2, extra={
        "auth": {"keys": keys},
        "admin": {"tokens": TOKENS},
        "quota": {"backend": {"kind": "valkey", "url": store_url},
                  "rules": [{"name": "all", "budgets": [{"window": "1h", "tokens": 10_000_000}]}]},
        "pricing": {"overrides": {"m": PRICES, "n": PRICES}, **pricing},
        "access_log": {"path": "access.log"},
    })
    return gateway, os.path.join(gateway.directory, "access.log")


def ask(port: int, key: str, model: str, cached: int = 0, reasoning: int = 0, stream: bool = False):
    headers = [("Authorization", f"Bearer {key}"), ("X-Mock-Tokens", "12")]
    if cached or reasoning:
        headers += [("X-Mock-Cached-Tokens", str(cached)), ("X-Mock-Reasoning-Tokens", str(reasoning))]
    fields: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    response = chat(port, model, headers=headers, messages=[{"role": "user", "content": "hello " * 20}], **fields)
    assert response.status == 200, response.body
    return response


def spend(gateway, query: str = "", token: str | None = SPEND) -> tuple[int, Any]:
    headers = [] if token is None else [("Authorization", f"Bearer {token}")]
    status, _, body = request("127.0.0.1", gateway.admin_port, "GET", f"/admin/spend{query}", headers=headers,
                              timeout=5)
    return status, json.loads(body) if body else None


def wait_spend(gateway, query: str, requests: int, timeout: float = 10.0) -> Any:
    """The report once it counts ``requests`` requests (the workers flush their rollups every second)."""
    deadline = time.monotonic() + timeout
    while True:
        status, report = spend(gateway, query)
        assert status == 200, report
        if report["totals"]["requests"] >= requests or time.monotonic() > deadline:
            return report
        time.sleep(0.1)


def test_access_lines_carry_the_cost_and_the_usage_parts_of_each_request(gateway_factory, providers, keys_store):
    gateway, path = spend_gateway(gateway_factory, providers, keys_store.url)
    ask(gateway.port, "sk-team-a-ci", "m", cached=5, reasoning=4)
    ask(gateway.port, "sk-team-b", "n", cached=3, reasoning=2, stream=True)
    ask(gateway.port, "sk-team-a-web", "m")  # no details in the usage: no cached/reasoning fields

    lines = wait_lines(path, 3, timeout=10.0)
    assert len(lines) == 3, lines
    by_model_and_tenant = {(line["served_model"], line["tenant"]): line for line in lines}
    detailed = next(line for line in lines if line.get("tokens_cached") == 5)
    assert detailed["tokens_cached"] == 5 and detailed["tokens_reasoning"] == 4
    assert detailed["tokens_completion"] == 12 and detailed["tokens_prompt"] > 5
    assert detailed["cost_nusd"] == cost_of(detailed["tokens_prompt"], 5, 12, 4)
    streamed = by_model_and_tenant[("n", "team-b")]
    assert (streamed["tokens_cached"], streamed["tokens_reasoning"]) == (3, 2)
    assert streamed["cost_nusd"] == cost_of(streamed["tokens_prompt"], 3, streamed["tokens_completion"], 2)
    plain = next(line for line in lines if line["served_model"] == "m" and "tokens_cached" not in line)
    assert "tokens_reasoning" not in plain
    assert plain["cost_nusd"] == cost_of(plain["tokens_prompt"], 0, plain["tokens_completion"], 0)
    # The metric sums the same costs, per tenant and model. Each of the two workers sends its counts once a
    # second: wait until both series are in (the requests may have gone to different workers).
    expected = {'gridgate_spend_nanousd_total{model="m",tenant="team-a"}': detailed["cost_nusd"] + plain["cost_nusd"],
                'gridgate_spend_nanousd_total{model="n",tenant="team-b"}': streamed["cost_nusd"]}
    wait_until(lambda: all(metric_value(gateway.admin_port, series) == value for series, value in expected.items()),
               "both tenants' spend series", timeout=5)
    assert {series: metric_value(gateway.admin_port, series) for series in expected} == expected


def test_the_spend_report_groups_the_rollups_each_way(gateway_factory, providers, keys_store):
    gateway, path = spend_gateway(gateway_factory, providers, keys_store.url)
    for key, model in (("sk-team-a-ci", "m"), ("sk-team-a-ci", "m"), ("sk-team-a-web", "n"), ("sk-team-b", "m")):
        ask(gateway.port, key, model, cached=2, reasoning=1)
    lines = wait_lines(path, 4, timeout=10.0)
    total = sum(line["cost_nusd"] for line in lines)
    today = dt.datetime.now(dt.UTC).date().isoformat()

    by_day = wait_spend(gateway, "", 4)
    assert by_day["group_by"] == "day" and [row["day"] for row in by_day["data"]] == [today]
    assert by_day["totals"]["requests"] == 4 and by_day["totals"]["cost_nusd"] == total
    assert by_day["totals"]["tokens_cached"] == 8 and by_day["totals"]["tokens_reasoning"] == 4
    assert by_day["totals"]["tokens_prompt"] == sum(line["tokens_prompt"] for line in lines)
    assert by_day["totals"]["tokens_completion"] == sum(line["tokens_completion"] for line in lines)
    assert by_day["totals"]["cost_usd"] == f"{total / 1e9:.9f}".rstrip("0").rstrip(".")

    _, by_tenant = spend(gateway, "?group_by=tenant")
    assert [(row["tenant"], row["requests"]) for row in by_tenant["data"]] == [("team-a", 3), ("team-b", 1)]
    _, by_key = spend(gateway, "?group_by=key&tenant=team-a")
    assert [(row["key"], row["requests"]) for row in by_key["data"]] == [("ci", 2), ("web", 1)]
    _, by_model = spend(gateway, "?group_by=model")
    assert [(row["model"], row["requests"]) for row in by_model["data"]] == [("m", 3), ("n", 1)]
    cost_m = sum(line["cost_nusd"] for line in lines if line["served_model"] == "m")
    assert by_model["data"][0]["cost_nusd"] == cost_m
    _, filtered = spend(gateway, f"?model=m&kid=-&from={today}&to={today}")
    assert filtered["totals"]["requests"] == 1  # team-b's key has no alias: "-"
    _, other_days = spend(gateway, "?from=2020-01-01&to=2020-01-31")
    assert other_days["data"] == [] and other_days["totals"]["requests"] == 0

    # Stored per day and tenant, expiring 400 days (and 2 of slack) after the day began.
    client = valkey.Valkey.from_url(keys_store.url)
    try:
        ttl = client.ttl(f"gridgate:spend:{{{today}}}:team-a")
        day_start = dt.datetime.fromisoformat(today).replace(tzinfo=dt.UTC).timestamp()
        assert abs(ttl - (day_start + 402 * 86400 - time.time())) < 5
        assert 400 * 86400 < client.ttl(f"gridgate:spend:{{{today}}}:tenants") <= 402 * 86400
    finally:
        client.close()


def test_the_spend_report_refuses_bad_input_and_callers_without_the_scope(gateway_factory, providers, keys_store):
    gateway, _ = spend_gateway(gateway_factory, providers, keys_store.url)
    for query, problem in (
        ("?from=2026-13-01", "from: must be a date YYYY-MM-DD"),
        ("?to=yesterday", "to: must be a date YYYY-MM-DD"),
        ("?from=2026-02-01&to=2026-01-01", "to: 2026-01-01 is before from 2026-02-01"),
        ("?from=2025-01-01&to=2026-03-01", "from: the range spans 425 days; at most 400"),
        ("?group_by=week", "group_by: must be one of day, model, key, tenant"),
        ("?colour=red", "colour: unknown query parameter"),
        ("?tenant=a&tenant=b", "tenant: give it once"),
    ):
        status, answer = spend(gateway, query)
        assert status == 400 and answer["error"]["message"].startswith(problem), (query, answer)
    assert spend(gateway, "?from=2025-01-01&to=2026-02-04")[0] == 200  # exactly 400 days
    status, answer = spend(gateway, token=None)
    assert status == 401 and answer["error"]["code"] == "invalid_admin_token"
    status, answer = spend(gateway, token=VIEWER)
    assert status == 403 and answer["error"]["code"] == "insufficient_scope"


def test_without_admin_tokens_the_spend_report_answers_403(gateway_factory, providers, keys_store):
    overlay = envelope([candidate("m", "provider-a")])
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay, extra={
        "quota": {"backend": {"kind": "valkey", "url": keys_store.url},
                  "rules": [{"name": "all", "budgets": [{"window": "1h", "tokens": 1000}]}]}})
    status, answer = spend(gateway, token=None)
    assert status == 403 and answer["error"]["code"] == "admin_tokens_not_configured"


def test_a_store_that_is_down_answers_503(gateway_factory, providers, keys_store):
    gateway, _ = spend_gateway(gateway_factory, providers, keys_store.url)
    assert spend(gateway)[0] == 200
    keys_store.stop()
    status, answer = spend(gateway)
    assert status == 503 and answer["error"]["code"] == "spend_store_unavailable"


def test_gridgate_spend_prints_the_table_of_a_real_gateways_spend(gateway_factory, providers, keys_store):
    gateway, path = spend_gateway(gateway_factory, providers, keys_store.url)
    for key, model in (("sk-team-a-ci", "m"), ("sk-team-b", "n"), ("sk-team-b", "n")):
        ask(gateway.port, key, model, cached=2, reasoning=1)
    lines = wait_lines(path, 3, timeout=10.0)
    wait_spend(gateway, "", 3)
    env = {**os.environ, "GRIDGATE_ADMIN_TOKEN": SPEND}
    command = [sys.executable, "-m", "gateway", "spend", "-c", gateway.config_path, "--group-by", "tenant"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=30, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    title, header, *rows, rule, total = done.stdout.splitlines()
    assert title.startswith("spend ") and title.endswith("by tenant")
    assert header.split() == ["tenant", "requests", "prompt", "cached", "completion", "reasoning", "cost_usd", "hits",
                              "saved"]
    cost = {tenant: sum(line["cost_nusd"] for line in lines if line["tenant"] == tenant) for tenant in ("team-a", "team-b")}
    assert [row.split()[:2] for row in rows] == [["team-a", "1"], ["team-b", "2"]]
    assert [row.split()[3] for row in rows] == ["2", "4"]  # cached tokens
    assert [row.split()[6] for row in rows] == [f"{cost['team-a'] / 1e9:.9f}".rstrip("0"),
                                                 f"{cost['team-b'] / 1e9:.9f}".rstrip("0")]
    assert set(rule) == {"-", " "}
    assert total.split()[:2] == ["total", "3"]
    assert len({len(line) for line in (header, *rows, total)}) == 1  # aligned: numbers end in one column
    # --json prints the API's answer; without the token's scope the command says why.
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, env=env, timeout=30, cwd=ROOT)
    assert json.loads(as_json.stdout)["totals"]["requests"] == 3
    refused = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT,
                             env={**env, "GRIDGATE_ADMIN_TOKEN": VIEWER})
    assert refused.returncode == 1 and "403 insufficient_scope" in refused.stderr
    # The plot tool reads the same report: a text chart with one bar per day that had spend.
    plot = subprocess.run([sys.executable, "-m", "loadtest.spend_plot", "--admin", f"127.0.0.1:{gateway.admin_port}",
                           "--text"], capture_output=True, text=True, env=env, timeout=30, cwd=ROOT)
    assert plot.returncode == 0, plot.stderr
    legend_b, legend_a, day_line = plot.stdout.splitlines()
    assert (legend_b, legend_a) == ("A = team-b", "B = team-a")  # the dearest first
    assert day_line.startswith(dt.datetime.now(dt.UTC).date().isoformat())
    assert f"{(cost['team-a'] + cost['team-b']) / 1e9:.6f} USD" in day_line
    assert set(day_line.split()[-1]) == {"A", "B"}
