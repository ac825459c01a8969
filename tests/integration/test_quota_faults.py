"""The quota ledger and gate around faults, against the real bundled Valkey: batched admissions, the
dead-worker sweep, requests that can never fit, admits whose requests gave up."""

from __future__ import annotations

import asyncio
import time

from gateway.quota.gate import QuotaGate
from gateway.quota.ledger import QuotaLedger, Reservation
from gateway.quota.ledger_script import LEDGER_SHA
from gateway.quota.owner import owner_tag
from gateway.quota.rules import Budget, QuotaRule, RequestLimit
from gateway.valkey.client import create_client
from gateway.valkey.resp import encode_command
from gateway.valkey.resp_transport import RespTransport
from tests.harness import clear_of_window_end
from tests.integration.test_quota_ledger import (
    LONG,
    admit,
    flush_scripts,
    new_tenant,
    open_gate,
    rule_for,
    window,
)


def test_one_tick_of_64_admits_stays_exact_even_when_the_script_cache_was_lost(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 4000), (2 * LONG, 10**6))]) as gate:
            await flush_scripts(valkey_url)  # as after a restart: the whole batch answers NOSCRIPT first
            results = await asyncio.gather(*(admit(gate, tenant, 100) for _ in range(64)))
            assert sum(a.allowed for a in results) == 40
            assert {a.reason for a in results} == {"admitted", "denied"}
            report = await gate.quota_report(tenant)
            assert (window(report)["reserved"], window(report, 0, 1)["reserved"]) == (4000, 4000)
            for admission in results:
                gate.settle(admission, 10, 6)  # denied ones hold nothing: no-ops
            await gate.drain()
            report = await gate.quota_report(tenant)
            assert (window(report)["used"], window(report)["reserved"]) == (400, 0)
            assert gate.tenant_tokens.snapshot() == {tenant: (240, 160), "other": (0, 0)}
            assert gate.counters.backend_errors == 0 and not gate.breaker.is_open

    asyncio.run(scenario())


def test_a_request_that_can_never_fit_gets_a_429_without_retry_after(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        rules = [rule_for(tenant, (60, 1000), (86400, 2_000))]
        async with open_gate(valkey_url, rules) as gate:
            assert (await admit(gate, tenant, 900)).allowed
            # 1200 exceeds the whole 1000-token minute: not retryable, even though the day is also short.
            never = await admit(gate, tenant, 1200)
            headers = dict(never.headers)
            assert (never.allowed, never.status, never.reason) == (False, 429, "denied_never_fits")
            assert b"retry-after" not in headers
            assert headers[b"x-ratelimit-limit-tokens"] == b"1000"
            assert b"x-ratelimit-remaining-tokens" in headers and b"x-ratelimit-reset-tokens" in headers
            message, kind, code = never.error  # type: ignore[misc]
            assert "1200 tokens" in message and "1000 tokens per 1m" in message and "never be admitted" in message
            assert (kind, code) == ("tokens", "rate_limit_exceeded")
            # Fits a window but not what is left of it: the ordinary, retryable 429.
            later = await admit(gate, tenant, 200)
            assert later.reason == "denied" and int(dict(later.headers)[b"retry-after"]) >= 1
            assert gate.counters.denied_never_fits == 1 and gate.counters.denied == 2
            assert window(await gate.quota_report(tenant))["reserved"] == 900  # the denials changed nothing

    clear_of_window_end(60, 5)  # a new minute's empty window would admit the request refused above
    asyncio.run(scenario())


def test_sweep_settles_a_dead_workers_reservations_once_and_leaves_the_others(valkey_url: str) -> None:
    tenant, other_tenant = new_tenant(), new_tenant()
    rules = [rule_for(tenant, (LONG, 10_000), max_in_flight=3), rule_for(other_tenant, (LONG, 10_000))]
    dead, alive = owner_tag(7, 1, 4242), owner_tag(7, 1, 42421)  # same slot: the replacement lives on

    async def scenario() -> None:
        async with open_gate(valkey_url, rules, owner=dead) as dying, \
                open_gate(valkey_url, rules, owner=alive) as replacement:
            gone = [await admit(dying, tenant, 100) for _ in range(2)] + [await admit(dying, other_tenant, 50)]
            kept = await admit(replacement, tenant, 300)
            assert all(a.allowed for a in [*gone, kept])
            assert not (await admit(replacement, tenant, 1)).allowed  # max_in_flight 3 is full

            sweeper = QuotaLedger(create_client(valkey_url, timeout_s=2), reservation_timeout_s=1)
            try:
                assert await sweeper.sweep([dead, owner_tag(1, 9, 1)]) == (3, 250)
                assert await sweeper.sweep([dead]) == (0, 0)  # idempotent
            finally:
                await sweeper.close()

            report = (await replacement.quota_report(tenant))["rules"][0]
            assert report["in_flight"] == 1  # the replacement's reservation survived
            assert (report["windows"][0]["used"], report["windows"][0]["reserved"]) == (200, 300)
            assert (await admit(replacement, tenant, 1)).allowed  # the slots are free again
            # A late settle by the worker (it was not dead after all) charges nothing more.
            dying.settle(gone[0], 5)
            await dying.drain()
            assert dying.counters.reconcile_duplicates == 1
            assert window(await replacement.quota_report(tenant))["used"] == 200
            other = (await replacement.quota_report(other_tenant))["rules"][0]["windows"][0]
            assert (other["used"], other["reserved"]) == (50, 0)

    asyncio.run(scenario())


def test_an_admit_whose_request_gave_up_is_released_when_its_reply_arrives(valkey_url: str) -> None:
    tenant = new_tenant()

    async def stall_backend(stalling: asyncio.Event) -> None:
        client = create_client(valkey_url, timeout_s=30)
        try:  # a busy script: Valkey reads nothing else for 0.3 to 0.8 s (see test_quota_ledger)
            await client.execute_command("PING")  # connected: the script is written the moment it is sent
            stalled = client.execute_command(
                "EVAL", "local x = 0 for i = 1, tonumber(ARGV[1]) do x = x + i end return 1", 0, 80_000_000)
            stalling.set()
            await stalled
        finally:
            await client.aclose()

    async def scenario() -> None:
        # A patient client (the default gives up after 250 ms without a reply: another path).
        ledger = QuotaLedger(create_client(valkey_url, timeout_s=5), reservation_timeout_s=120)
        gate = QuotaGate(ledger, [rule_for(tenant, (LONG, 1000), max_in_flight=1)])
        await gate.start()
        try:
            stalling = asyncio.Event()
            stall = asyncio.create_task(stall_backend(stalling))
            await stalling.wait()  # the script goes first, whatever connecting its client took
            await asyncio.sleep(0.05)
            waiting = asyncio.create_task(admit(gate, tenant, 100))
            await asyncio.sleep(0.05)
            waiting.cancel()  # the client went away while the admit was in flight
            await stall
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                report = await gate.quota_report(tenant)
                if report["rules"][0]["in_flight"] == 0 and window(report)["reserved"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert report["rules"][0]["in_flight"] == 0 and window(report)["reserved"] == 0
            assert window(report)["used"] == 0  # released unused: it never reached a provider
            assert (await admit(gate, tenant, 100)).allowed
            assert gate.counters.backend_errors == 0  # the reply came, late: not a backend failure
        finally:
            await gate.close()

    asyncio.run(scenario())


def test_the_pre_encoded_admit_and_settle_are_exactly_the_commands() -> None:
    # Key names carry `%` (escaped rule and tenant names): the templates must not read them as formats.
    transport = RespTransport()
    ledger = QuotaLedger(transport, reservation_timeout_s=120)
    rule = QuotaRule("r:1%d", (Budget(60, 1000), Budget(86400, 5000)), 10, max_in_flight=3,
                     requests=(RequestLimit(60, 50, 10),))
    account = ledger.account("t{x}%d", rule)
    assert account is not None and b"%25d" in account.prefix and b"{t%7Bx%7D%25d}" in account.prefix
    command = ledger.admit_command(account, 123, b"ab.1.0.7.f")
    assert command.wire == encode_command(("EVALSHA", LEDGER_SHA, 1, account.zkey, "admit", account.prefix,
                                           b"ab.1.0.7.f", 123, 120_000, 1, 1, "", "", 0, "r:r%3A1%25d", 3, 1, 60, 50, 10,
                                           0, 2, 60, 1000, 0, 86400, 5000, 0, 0))
    reservation = Reservation(account.zkey, account.prefix, b"ab.1.0.7.f|123|1|r:r%3A1%25d:w:60:1||", 123)
    assert ledger._settle_wire(reservation, 42, 1) == encode_command(
        ("EVALSHA", LEDGER_SHA, 1, reservation.zkey, "settle", reservation.prefix, reservation.member, 42, 1, b""))
    assert ledger._settle_wire(reservation, 42, 0, 1_234) == encode_command(
        ("EVALSHA", LEDGER_SHA, 1, reservation.zkey, "settle", reservation.prefix, reservation.member, 42, 0, 1234))
    # A USD budget: the worst case is a slot of the call, the period's id and end are part of the template.
    from gateway.identity.limits import SpendBudget
    from gateway.pricing.period import PeriodClock

    clock = PeriodClock("1d", None)
    spender = QuotaRule("s", (), 10, spend=(SpendBudget(5_000_000_000, "1d", "UTC", True, (500, 1000), clock),))
    account = ledger.account("t", spender, now=1_796_083_200.0)  # 2026-12-01T00:00:00Z
    assert account is not None and account.spend_until == 1_796_169_600
    command = ledger.admit_command(account, 50, b"id", 1, 7_000)
    assert command.wire == encode_command(("EVALSHA", LEDGER_SHA, 1, account.zkey, "admit", account.prefix, b"id", 50,
                                           120_000, 1, 1, "", "", 7000, "r:s", 0, 0, 0, 1, "1d", "20261201",
                                           1_796_169_600_000, 5_000_000_000, 1, "500/1000"))
