"""USD budgets in the ledger's one atomic call (docs/limits.md, "USD budgets"), against the real bundled
Valkey, in-process: hard budgets reserve the worst case and refuse what no longer fits (changing nothing),
settling charges the real cost, soft budgets never refuse, alert thresholds are reported once per period,
and a v7 ledger settles what a v6 one admitted. The counters are read back from Valkey."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest
import valkey

from gateway.config import PriceOverride, Pricing
from gateway.identity.auth import KeyIdentity
from gateway.identity.limits import Limits, SpendBudget
from gateway.pricing.period import PeriodClock, period_span
from gateway.pricing.table import shipped_table
from gateway.quota.lease import LeaseSpec
from gateway.quota.ledger import SETTLE_APPLIED, QuotaLedger, Reservation, key_prefix
from gateway.quota.ledger_script import escape_key_part
from gateway.quota.rules import QuotaRule
from gateway.spend import alerts
from gateway.spend.price_book import PriceBook
from gateway.valkey.client import create_client
from tests.clock import TestClock
from tests.integration.test_limits_ledger import admit, counters, open_gate

# Model "m": $1,000 input, $2,000 output per million tokens: 1 and 2 milli-USD a token. A request with
# an empty body and a completion allowance of 10 tokens has a worst case of $0.02.
PRICES = PriceBook.from_config(Pricing(overrides={"m": PriceOverride(input=1000, output=2000)}), shipped_table())
WORST_10 = 20_000_000


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on its own event loop (the suite has no async plugin)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def new_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def spend(nusd: int, *, hard: bool = True, period: str = "1d", alert_at: Sequence[int] = (500, 800, 1000)) -> SpendBudget:
    return SpendBudget(nusd, period, "UTC", hard, tuple(alert_at), PeriodClock(period, None))  # type: ignore[arg-type]


def spend_rule(tenant: str, *limits: SpendBudget) -> QuotaRule:
    return QuotaRule(f"team-{tenant}", (), 10, tenant, spend=tuple(limits))


def window(url: str, tenant: str, scope: str, period: str = "1d") -> dict[bytes, bytes]:
    name = f"{key_prefix(tenant)}{scope}:s:{period}:{period_span(period, None, time.time()).id}"  # type: ignore[arg-type]
    client = valkey.Valkey.from_url(url)
    try:
        return client.hgetall(name)
    finally:
        client.close()


def rule_scope(tenant: str) -> str:
    return f"r:{escape_key_part(f'team-{tenant}')}"


@in_loop
async def test_a_hard_budget_reserves_the_worst_case_and_refuses_what_no_longer_fits(valkey_url: str) -> None:
    tenant = new_tenant()
    async with open_gate(valkey_url, [spend_rule(tenant, spend(5 * WORST_10))], prices=PRICES) as gate:
        taken = [await admit(gate, tenant, 10) for _ in range(5)]
        assert all(a.allowed for a in taken)
        assert window(valkey_url, tenant, rule_scope(tenant)) == {b"r": b"%d" % (5 * WORST_10)}
        before = counters(valkey_url, tenant)
        refused = await admit(gate, tenant, 10)
        assert not refused.allowed and refused.status == 429
        message, error_type, code = refused.error  # type: ignore[misc]
        assert code == "budget_exceeded"
        resets = period_span("1d", None, time.time()).end
        assert message == (f"rule team-{tenant} spend $0.10/1d (UTC) exceeded; resets "
                           f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(resets))}")
        retry_after = int(dict(refused.headers)[b"retry-after"])
        assert abs(retry_after - (resets - time.time())) <= 5
        assert counters(valkey_url, tenant) == before  # a refused request changes no counter
        assert gate.counters.denied_budget == 1
        # Settling charges the real cost and releases the worst case: room for more again.
        for admission in taken:
            gate.settle(admission, 10, cost_nusd=1_234)
        await gate.drain()
        assert window(valkey_url, tenant, rule_scope(tenant)) == {b"r": b"0", b"u": b"%d" % (5 * 1_234)}
        assert (await admit(gate, tenant, 10)).allowed


@in_loop
async def test_a_request_whose_worst_case_exceeds_the_whole_budget_never_fits(valkey_url: str) -> None:
    tenant = new_tenant()
    async with open_gate(valkey_url, [spend_rule(tenant, spend(WORST_10 - 1))], prices=PRICES) as gate:
        refused = await admit(gate, tenant, 10)
        assert refused.status == 429 and b"retry-after" not in dict(refused.headers)
        assert "exceeded by this request alone" in refused.error[0]  # type: ignore[index]
        assert counters(valkey_url, tenant) == {}


@in_loop
async def test_a_soft_budget_never_refuses_and_is_charged_what_was_spent(valkey_url: str) -> None:
    tenant = new_tenant()
    async with open_gate(valkey_url, [spend_rule(tenant, spend(WORST_10, hard=False, alert_at=()))],
                         prices=PRICES) as gate:
        taken = [await admit(gate, tenant, 10) for _ in range(6)]
        assert all(a.allowed for a in taken)
        assert window(valkey_url, tenant, rule_scope(tenant))[b"r"] == b"0"  # reserves nothing
        for admission in taken:
            gate.settle(admission, 10, cost_nusd=WORST_10)
        await gate.drain()
        assert window(valkey_url, tenant, rule_scope(tenant)) == {b"r": b"0", b"u": b"%d" % (6 * WORST_10)}


@in_loop
async def test_a_key_budget_and_a_rule_budget_are_taken_together(valkey_url: str) -> None:
    tenant = new_tenant()
    key = KeyIdentity(tenant, "ci", None, Limits(spend=(spend(2 * WORST_10),)))
    async with open_gate(valkey_url, [spend_rule(tenant, spend(10 * WORST_10))], prices=PRICES) as gate:
        first = [await admit(gate, tenant, 10, key=key) for _ in range(2)]
        refused = await admit(gate, tenant, 10, key=key)
        assert all(a.allowed for a in first)
        assert refused.error[0].startswith("key spend $0.04/1d (UTC) exceeded; resets ")  # type: ignore[index]
        assert window(valkey_url, tenant, rule_scope(tenant))[b"r"] == b"%d" % (2 * WORST_10)
        assert window(valkey_url, tenant, "a:ci")[b"r"] == b"%d" % (2 * WORST_10)
        for admission in first:
            gate.settle(admission, 0, reached=False)  # never reached a provider: nothing charged
        await gate.drain()
        assert window(valkey_url, tenant, "a:ci") == {b"r": b"0"}


@in_loop
async def test_each_threshold_is_reported_once_even_when_settles_race(valkey_url: str) -> None:
    tenant = new_tenant()
    alerts.published.clear()
    limit = 10 * WORST_10
    rules = [spend_rule(tenant, spend(limit))]
    async with open_gate(valkey_url, rules, prices=PRICES) as one, open_gate(valkey_url, rules, prices=PRICES) as two:
        taken = [await admit(gate, tenant, 10) for gate in (one, two) for _ in range(5)]
        ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=120)
        try:
            # Ten settles of 1/10 of the budget each, all at once from one pipeline: 50 % and 80 % and 100 %
            # are each crossed by exactly one of them.
            replies = await ledger.settle_many([(a.reservation, 10, 0, limit // 10) for a in taken])  # type: ignore[misc]
            again = await asyncio.gather(*(ledger.settle(a.reservation, 10, 0, limit // 10) for a in taken))  # type: ignore[arg-type]
        finally:
            await ledger.close()
        crossings = [reply[1:] for reply in replies if isinstance(reply, list)]
        assert sorted(c.split(b":")[1] for cs in crossings for c in cs) == [b"1000", b"500", b"800"]
        assert all(reply == 0 for reply in again)  # settled before: no charge, no alert
        assert window(valkey_url, tenant, rule_scope(tenant))[b"u"] == b"%d" % limit
        # The gate reports what its own settles crossed: nothing is left to cross this period.
        for admission in taken:
            (one if admission in taken[:5] else two).settle(admission, 10, cost_nusd=limit)
        await one.drain()
        await two.drain()
        assert alerts.published == []


@in_loop
async def test_the_gate_publishes_an_alert_per_threshold_crossed(valkey_url: str) -> None:
    tenant = new_tenant()
    alerts.published.clear()
    async with open_gate(valkey_url, [spend_rule(tenant, spend(4 * WORST_10, alert_at=(500, 1000)))],
                         prices=PRICES) as gate:
        taken = [await admit(gate, tenant, 10) for _ in range(4)]
        for admission in taken:
            gate.settle(admission, 10, cost_nusd=WORST_10)
        await gate.drain()
        start = period_span("1d", None, time.time()).start
        assert sorted(alerts.published, key=lambda a: a.threshold) == [
            alerts.SpendAlert(tenant, f"rule team-{tenant}", "$0.08/1d", time.strftime("%Y-%m-%dT%H:%M:%SZ",
                              time.gmtime(start)), t, s, 4 * WORST_10)
            for t, s in ((0.5, 2 * WORST_10), (1.0, 4 * WORST_10))]
        assert gate.counters.spend_alerts == 2


def _v6_script() -> str:
    """The v6 ledger script's text, from the commit this branch started at (the previous release)."""
    root = Path(__file__).resolve().parents[2]
    source = subprocess.run(["git", "-C", str(root), "show", "5cc1811:gateway/quota/ledger_script.py"],
                            capture_output=True, text=True, check=False)
    if source.returncode != 0:
        pytest.skip("the v6 ledger script is not in this checkout's history")
    namespace: dict[str, Any] = {}
    exec(compile(source.stdout, "ledger_script_v6.py", "exec"), namespace)  # noqa: S102 - our own previous release
    assert namespace["SCRIPT_VERSION"] == 6
    return namespace["LEDGER_SCRIPT"]


@in_loop
async def test_a_v7_ledger_settles_a_reservation_a_v6_ledger_admitted(valkey_url: str) -> None:
    tenant = new_tenant()
    prefix = key_prefix(tenant)
    client = valkey.Valkey.from_url(valkey_url)
    try:
        # A v6 admit of 100 tokens in a 1-day token window of rule "r" (the v6 argument layout).
        reply = client.eval(_v6_script(), 1, prefix + "z", "admit", prefix, "v6-1", 100, 120000, 1, 1, "", "",
                            "r:r", 0, 0, 1, 86400, 1000, 0)
        member = reply.split(b" ", 12)[12]
        window_key = next(k for k in client.keys(prefix.replace("{", "[{]") + "*") if b":w:" in k)
        assert client.hget(window_key, "r") == b"100"
    finally:
        client.close()
    ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=120)
    try:
        await ledger.load_script()
        outcome = await ledger.settle(Reservation((prefix + "z").encode(), prefix.encode(), member, 100), 40)
    finally:
        await ledger.close()
    assert outcome == SETTLE_APPLIED
    client = valkey.Valkey.from_url(valkey_url)
    try:
        assert client.hgetall(window_key) == {b"r": b"0", b"u": b"40"}
        assert client.zcard(prefix + "z") == 0
    finally:
        client.close()



@in_loop
async def test_an_expired_reservation_is_charged_its_worst_case_and_a_cancelled_one_nothing(valkey_url: str) -> None:
    tenant = new_tenant()
    rules = [spend_rule(tenant, spend(10 * WORST_10), spend(10 * WORST_10, hard=False, period="1w"))]
    clock = TestClock()
    async with open_gate(valkey_url, rules, prices=PRICES, timeout_s=1, clock=clock) as gate:
        lost = await admit(gate, tenant, 10)  # never settled: the gateway lost track of it
        gate._keeper.discard(lost.reservation)  # type: ignore[attr-defined]  # nobody extends it either
        clock.advance(1.001)
        await admit(gate, tenant, 10)  # the next call of the tenant expires the first
        assert window(valkey_url, tenant, rule_scope(tenant)) == {b"r": b"%d" % WORST_10, b"u": b"%d" % WORST_10}
        assert window(valkey_url, tenant, rule_scope(tenant), "1w") == {b"r": b"0", b"u": b"%d" % WORST_10}
        ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=120)
        try:
            account = ledger.account(tenant, rules[0])
            assert account is not None
            command = ledger.admit_command(account, 10, b"lost-reply", 1, WORST_10)
            await ledger.send_admits([command])
            assert await ledger.cancel_many([command]) == [True]  # its reply was lost: undone, charged nothing
        finally:
            await ledger.close()
        assert window(valkey_url, tenant, rule_scope(tenant)) == {b"r": b"%d" % WORST_10, b"u": b"%d" % WORST_10}


@in_loop
async def test_worker_held_blocks_hold_nano_usd_and_settle_the_summed_real_cost(valkey_url: str) -> None:
    tenant = new_tenant()
    limit = 1000 * WORST_10
    lease = LeaseSpec(ttl_s=5, headroom=2)
    async with open_gate(valkey_url, [spend_rule(tenant, spend(limit))], prices=PRICES, lease=lease) as gate:
        taken = []
        for _ in range(60):
            taken.append(await admit(gate, tenant, 10))
            await asyncio.sleep(0)  # let a block that was asked for be granted
        assert all(a.allowed for a in taken)
        assert gate.counters.leases_granted >= 1 and gate.counters.leased >= 30  # most came from blocks
        # A block reserved its nano-USD in the window: more than the requests' own worst cases.
        assert int(window(valkey_url, tenant, rule_scope(tenant))[b"r"]) >= 60 * WORST_10
        costs = [1_000 + i for i in range(len(taken))]
        for admission, cost in zip(taken, costs, strict=True):
            gate.settle(admission, 10, cost_nusd=cost)
    # Closing the gate settled its blocks: exactly the real costs are spent, nothing stays reserved.
    assert window(valkey_url, tenant, rule_scope(tenant)) == {b"r": b"0", b"u": b"%d" % sum(costs)}


@in_loop
async def test_near_a_hard_budget_no_block_is_taken_and_every_request_is_exact(valkey_url: str) -> None:
    tenant = new_tenant()
    lease = LeaseSpec(ttl_s=5, headroom=10)
    async with open_gate(valkey_url, [spend_rule(tenant, spend(12 * WORST_10))], prices=PRICES, lease=lease) as gate:
        taken = [await admit(gate, tenant, 10) for _ in range(14)]
        assert [a.allowed for a in taken] == [True] * 12 + [False] * 2
        assert gate.counters.leases_granted == 0  # 12 worst cases leave no room for 10 blocks of 4
