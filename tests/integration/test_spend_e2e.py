"""USD budgets through real gateways, real mock providers and the bundled Valkey (docs/limits.md, "USD
budgets"; docs/pricing.md): a hard budget is never overspent by concurrent requests on two gateways, the
spend counter equals the sum of what the admitted requests cost to the nano-USD, the 429 names the budget
and when it resets, a provider 4xx without usage costs nothing, a cut stream costs the worst case, an
unpriced model is refused when asked to be, and the key answer and /admin/quota show the spend."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import valkey

from gateway.config import PriceOverride, Pricing
from gateway.identity.auth import hash_api_key
from gateway.identity.limits import usd_text
from gateway.pricing.period import period_span
from gateway.pricing.table import shipped_table
from gateway.quota.ledger import key_prefix
from gateway.quota.ledger_script import escape_key_part
from gateway.spend.price_book import PriceBook
from tests.harness import (
    Client,
    admin_get,
    candidate,
    chat,
    envelope,
    metric_value,
    mock_served,
    wait_until,
)
from tests.integration.test_access_log import read_lines, wait_lines
from tests.integration.test_keys_e2e import TOKENS, admin
from tests.integration.test_limits_e2e import _bearer, _report, _tenant, _together

# Model "m" at $1,000 input and $2,000 output per million tokens: 1,000,000 and 2,000,000 nano-USD a token.
PRICING = {"overrides": {"m": {"input": 1000, "output": 2000}}}
PRICES = PriceBook.from_config(Pricing(overrides={"m": PriceOverride(input=1000, output=2000)}), shipped_table())
MAX_TOKENS = 10


def _worst(**fields: Any) -> int:
    """The worst case the gateway reserves for ``chat(port, "m", max_tokens=MAX_TOKENS, **fields)``: the
    prompt estimate (four bytes a token of the body the harness sends) at the input price plus
    ``max_tokens`` at the output price."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
                       **fields}).encode()
    return PRICES.worst_case_cost("m", -(-len(body) // 4), MAX_TOKENS)


def _options(url: str, tenant: str, spend: dict[str, Any], **extra: Any) -> dict[str, Any]:
    rule = {"name": f"team-{tenant}", "match": {"tenant": tenant}, "spend": [spend]}
    return {"auth": {"keys": [{"tenant": tenant, "key": hash_api_key("sk-1"), **extra}]},
            "quota": {"backend": {"kind": "valkey", "url": url}, "reservation_timeout": "10s", "rules": [rule]},
            "pricing": PRICING}


def _window(url: str, tenant: str, period: str = "1d", rule: str | None = None) -> dict[bytes, int]:
    """The rule's (default ``team-<tenant>``) spend window of the current period: u (spent) and r (reserved),
    nano-USD."""
    name = (f"{key_prefix(tenant)}r:{escape_key_part(rule or f'team-{tenant}')}:s:{period}:"
            f"{period_span(period, None, time.time()).id}")  # type: ignore[arg-type]
    client = valkey.Valkey.from_url(url)
    try:
        return {field: int(value) for field, value in client.hgetall(name).items()}
    finally:
        client.close()


def _settled(url: str, tenant: str) -> dict[bytes, int]:
    return wait_until(lambda: (w := _window(url, tenant)) and w.get(b"r") == 0 and w, "every reservation settled")


def _cost(response: Any) -> int:
    usage = response.json()["usage"]
    return PRICES.cost("m", usage["prompt_tokens"], usage["completion_tokens"], total_tokens=usage["total_tokens"])


def test_48_concurrent_requests_on_two_gateways_never_spend_past_a_hard_budget_that_fits_8(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    worst = _worst()
    usd = 8 * worst / 1e9  # fits exactly 8 worst cases
    options = _options(valkey_url, tenant, {"usd": usd, "period": "1d"})
    options["access_log"] = {"path": "access.log"}
    gateways = [gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2, extra=options)
                for _ in range(2)]
    served = mock_served(handle)
    answers = _together(48, lambda i: chat(gateways[i % 2].port, "m", headers=_bearer("sk-1"), max_tokens=MAX_TOKENS))
    admitted = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    assert len(admitted) + len(refused) == 48, {a.status for a in answers}
    assert len(admitted) >= 8  # the budget holds 8 worst cases at once; settled ones free room for more
    assert mock_served(handle) - served == len(admitted)  # refused requests never reached the provider
    window = _settled(valkey_url, tenant)
    assert window[b"u"] <= 8 * worst  # never past the budget
    assert window[b"u"] == sum(_cost(a) for a in admitted)  # to the nano-USD
    # The access lines of both gateways say the same: their cost_nusd add up to the counter. (The budget's
    # alert thresholds were crossed too: each alert is a line of its own, status 0, without a cost.)
    def request_lines() -> list[dict[str, Any]]:
        return [line for gateway in gateways for line in read_lines(os.path.join(gateway.directory, "access.log"))
                if line["status"]]

    lines = wait_until(lambda: len(found := request_lines()) >= 48 and found, "every request's line")
    assert len(lines) == 48 and sum(line.get("cost_nusd", 0) for line in lines) == window[b"u"]
    assert sorted(line["status"] for line in lines if "cost_nusd" in line) == [200] * len(admitted)
    error = refused[0].json()["error"]
    resets = period_span("1d", None, time.time()).end
    assert error["code"] == "budget_exceeded"
    assert error["message"] == (f"rule team-{tenant} spend {usd_text(8 * worst)}/1d (UTC) exceeded; resets "
                                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(resets))}")
    assert abs(int(refused[0].headers["retry-after"]) - (resets - time.time())) <= 5


def test_a_provider_4xx_without_usage_costs_nothing_and_a_cut_stream_costs_the_worst_case(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]),
                              extra=_options(valkey_url, tenant, {"usd": 100, "period": "1d", "enforce": "soft"}))
    refused = chat(gateway.port, "m", headers=[*_bearer("sk-1"), ("X-Mock-Status", "400")], max_tokens=MAX_TOKENS)
    assert refused.status == 400
    assert _settled(valkey_url, tenant).get(b"u", 0) == 0
    client = Client(gateway.port)
    try:
        response = client.request("POST", "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
            "stream": True}, [*_bearer("sk-1"), ("X-Mock-Reset", "mid"), ("X-Mock-Tokens", "10")])
        assert response.status == 200
    except Exception:  # the cut may surface as a broken read: what counts is the charge
        pass
    finally:
        client.close()
    assert wait_until(lambda: _window(valkey_url, tenant).get(b"u") == _worst(stream=True), "the worst case charged")


def test_an_unpriced_model_is_refused_before_a_provider_when_pricing_says_reject(
        valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    options = _options(valkey_url, tenant, {"usd": 1, "period": "1w"})
    options["pricing"] = {**PRICING, "unpriced": "reject"}
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p"), candidate("private-x", "p")]),
                              extra=options)
    served = mock_served(handle)
    answer = chat(gateway.port, "private-x", headers=_bearer("sk-1"))
    assert answer.status == 400 and answer.json()["error"]["code"] == "model_not_priced"
    assert mock_served(handle) == served
    assert chat(gateway.port, "m", headers=_bearer("sk-1"), max_tokens=MAX_TOKENS).status == 200


def test_the_key_answer_and_admin_quota_show_spend_beside_token_budgets(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    tenant = _tenant()
    options = _options(valkey_url, tenant, {"usd": 5, "period": "1mo", "tz": "America/New_York"}, alias="ci",
                       limits={"spend": [{"usd": 2.5, "period": "1d", "enforce": "soft"}]})
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    answer = chat(gateway.port, "m", headers=_bearer("sk-1"), max_tokens=MAX_TOKENS)
    assert answer.status == 200
    cost = _cost(answer)
    wait_until(lambda: _report(gateway, tenant)["rules"][0]["spend"][0]["spent_nusd"] == cost, "charged")
    key = Client(gateway.port)
    try:
        body = key.request("GET", "/v1/gridgate/key", None, _bearer("sk-1")).json()
    finally:
        key.close()
    spend = {entry["scope"]: entry for entry in body["spend"]}
    assert spend["key"] | {"reset_s": 0} == {
        "scope": "key", "usd": "$2.50", "period": "1d", "tz": "UTC", "enforce": "soft", "limit_nusd": 2_500_000_000,
        "spent_nusd": cost, "reserved_nusd": 0, "remaining_nusd": 2_500_000_000 - cost,
        "resets_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(period_span("1d", None, time.time()).end)),
        "reset_s": 0}
    rule = spend[f"rule team-{tenant}"]
    assert (rule["usd"], rule["period"], rule["tz"], rule["enforce"], rule["spent_nusd"]) == (
        "$5.00", "1mo", "America/New_York", "hard", cost)
    assert rule["resets_at"] == time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(period_span("1mo", "America/New_York", time.time()).end))


@pytest.mark.parametrize("per_key", [False, True])
def test_the_budget_remaining_gauge_reads_what_is_left_of_the_tenants_and_each_keys_budgets(
        valkey_url, mock_provider, gateway_factory, per_key):
    # gridgate_budget_remaining_nanousd: the tightest USD budget of the tenant's rules; with
    # pricing.metrics_per_key also each key's own, the rules' under key "-".
    handle = mock_provider("p")
    tenant = _tenant()
    options = _options(valkey_url, tenant, {"usd": 5, "period": "1mo"}, alias="ci",
                       limits={"spend": [{"usd": 2.5, "period": "1d", "enforce": "soft"}]})
    options["pricing"] = {**PRICING, "metrics_per_key": per_key}
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra=options)
    answer = chat(gateway.port, "m", headers=_bearer("sk-1"), max_tokens=MAX_TOKENS)
    assert answer.status == 200
    cost = _cost(answer)
    # Charged, and the worker's block given back: the first refresh (the first scrape's) then reads the final
    # state; one made while the block was still reserved would be the gauge's value for 10 s (REFRESH_S).
    wait_until(lambda: (report := _report(gateway, tenant))["rules"][0]["spend"][0]["spent_nusd"] == cost
               and report["open_reservations"] == 0, "charged, nothing reserved")
    if per_key:
        expected = {f'gridgate_budget_remaining_nanousd{{key="-",tenant="{tenant}"}}': 5_000_000_000 - cost,
                    f'gridgate_budget_remaining_nanousd{{key="ci",tenant="{tenant}"}}': 2_500_000_000 - cost}
    else:
        expected = {f'gridgate_budget_remaining_nanousd{{tenant="{tenant}"}}': 5_000_000_000 - cost}
    # The first scrape starts the read (a scrape never waits on Valkey); a later one shows it.
    wait_until(lambda: all(metric_value(gateway.admin_port, sample) == value for sample, value in expected.items()),
               "the gauge read back", timeout=15)
    if not per_key:  # no key series without the opt-in
        assert b'key="ci"' not in admin_get(gateway.admin_port, "/metrics")[2]


def test_the_budget_remaining_gauge_covers_managed_keys_and_the_tenants_only_they_name(
        mock_provider, gateway_factory, keys_store):
    # A tenant that only managed keys name (no YAML key, no rule naming it) gets the series of the rules
    # that apply to it; with metrics_per_key each managed key with a USD budget of its own gets one under
    # its kid. A revoked key has none, and a key without a USD budget of its own none either.
    handle = mock_provider("p")
    tenant = _tenant()
    everyone = {"name": "everyone", "spend": [{"usd": 5, "period": "1mo"}]}  # no match: every tenant
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra={
        "auth": {}, "admin": {"tokens": TOKENS},  # managed keys live in the quota backend's Valkey
        "quota": {"backend": {"kind": "valkey", "url": keys_store.url}, "reservation_timeout": "10s",
                  "rules": [everyone]},
        "pricing": {**PRICING, "metrics_per_key": True}})
    made = {}
    for alias, limits in (("spender", {"spend": [{"usd": 2.5, "period": "1d", "enforce": "soft"}]}),
                          ("plain", {}), ("gone", {"spend": [{"usd": 1, "period": "1d"}]})):
        status, created = admin(gateway, "POST", "/admin/keys", {"tenant": tenant, "alias": alias, "limits": limits})
        assert status == 201, created
        made[alias] = (created["key"], created["record"]["kid"])
    assert admin(gateway, "POST", f"/admin/keys/{made['gone'][1]}/revoke")[0] == 200
    key, kid = made["spender"]
    answer = wait_until(lambda: (a := chat(gateway.port, "m", headers=_bearer(key), max_tokens=MAX_TOKENS))
                        .status == 200 and a, "the key in the table")
    cost = _cost(answer)
    # Nothing reserved before the first scrape, whose refresh then reads the final state (see above).
    wait_until(lambda: _window(keys_store.url, tenant, "1mo", rule="everyone").get(b"r") == 0, "nothing reserved")
    expected = {f'gridgate_budget_remaining_nanousd{{key="-",tenant="{tenant}"}}': 5_000_000_000 - cost,
                f'gridgate_budget_remaining_nanousd{{key="{kid}",tenant="{tenant}"}}': 2_500_000_000 - cost}
    wait_until(lambda: all(metric_value(gateway.admin_port, sample) == value for sample, value in expected.items()),
               "the gauge read back", timeout=15)
    exposed = admin_get(gateway.admin_port, "/metrics")[2].decode()
    series = [line for line in exposed.splitlines() if line.startswith("gridgate_budget_remaining_nanousd{")
              and f'tenant="{tenant}"' in line]
    assert len(series) == 2, series  # neither the revoked key nor the one without a budget of its own


def test_requests_admitted_from_worker_held_blocks_are_charged_their_real_costs(
        valkey_url, mock_provider, gateway_factory):
    # Far from a hard budget, blocks (on by default) hold nano-USD: requests are admitted without a round
    # trip and the blocks settle what their requests really cost, to the nano-USD.
    handle = mock_provider("p")
    tenant = _tenant()
    gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2,
                              extra=_options(valkey_url, tenant, {"usd": 1000, "period": "1d"}))
    answers = [chat(gateway.port, "m", headers=_bearer("sk-1"), max_tokens=MAX_TOKENS) for _ in range(40)]
    assert {a.status for a in answers} == {200}
    wait_until(lambda: metric_value(gateway.admin_port, 'gridgate_quota_leases_total{event="admitted"}') >= 20,
               "most requests admitted from blocks")
    gateway.stop()  # its blocks are settled as the workers stop
    window = _window(valkey_url, tenant)
    assert (window[b"r"], window[b"u"]) == (0, sum(_cost(a) for a in answers))


def test_thresholds_crossed_by_real_requests_reach_the_webhook_the_access_log_and_the_metric(
        valkey_url, mock_provider, gateway_factory):
    # The ledger finds the crossings when the request settles; the worker hands each alert to the
    # supervisor (webhook, gridgate_spend_alerts_total) and writes it to the access log as a line of its own.
    from tests.integration.test_spend_alerts import Webhook, wait_for

    handle = mock_provider("p")
    tenant = _tenant()
    hook = Webhook()
    try:
        worst = _worst()
        # Soft, so every request goes on; one request's cost is enough for 50 %, ten are past 100 %.
        budget = {"usd": 2 * worst / 1e9, "period": "1d", "enforce": "soft", "alert_at": [0.5, 1.0]}
        options = _options(valkey_url, tenant, budget)
        options["pricing"] = {**PRICING, "alerts_webhook": f"http://127.0.0.1:{hook.server.server_port}/a"}
        options["access_log"] = {"path": "access.log"}
        gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), workers=2,
                                  extra=options)
        for _ in range(10):
            assert chat(gateway.port, "m", headers=_bearer("sk-1"), max_tokens=MAX_TOKENS).status == 200
        assert wait_for(lambda: len(hook.received) >= 2), hook.received
        time.sleep(0.5)  # no third alert comes: each threshold once per period
        bodies = sorted((a["body"] for a in hook.received), key=lambda body: body["threshold"])
        assert [(b["tenant"], b["scope"], b["threshold"]) for b in bodies] == [
            (tenant, f"rule team-{tenant}", 0.5), (tenant, f"rule team-{tenant}", 1.0)]
        assert all(b["limit_nusd"] == 2 * worst and b["spent_nusd"] >= b["threshold"] * 2 * worst for b in bodies)
        for threshold in ("0.5", "1"):
            assert metric_value(gateway.admin_port,
                                f'gridgate_spend_alerts_total{{tenant="{tenant}",threshold="{threshold}"}}') == 1
        lines = wait_lines(os.path.join(gateway.directory, "access.log"), 12)
        alerts = sorted(line["spend_alert"] for line in lines if line.get("spend_alert"))
        text = f"rule team-{tenant} spend {usd_text(2 * worst)}/1d"
        assert alerts == [f"{text} 100%", f"{text} 50%"]
        assert all(line["status"] == 0 and line["tenant"] == tenant and line["request_id"] is None
                   for line in lines if line.get("spend_alert"))
        assert sum(line["status"] == 200 for line in lines) == 10
    finally:
        hook.stop()
