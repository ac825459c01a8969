"""The token quota against a real Valkey (the bundled binary): admission, reconciliation, expiry,
atomicity, sharing across processes, backend failure policy and persistence."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from gateway.quota.admission import Admission
from gateway.quota.gate import QuotaGate
from gateway.quota.ledger import (
    SETTLE_APPLIED,
    SETTLE_NOOP,
    QuotaLedger,
    Reservation,
    key_prefix,
)
from gateway.quota.ledger_report import ScopeReport
from gateway.quota.rules import Budget, QuotaRule
from gateway.request.attempts import attempt_tokens
from gateway.valkey.client import create_client
from gateway.valkey.cluster_transport import ClusterTransport
from gateway.valkey.embedded import EmbeddedValkey, EmbeddedValkeyError
from tests.clock import TestClock
from tests.harness import clear_of_window_end
from tests.inprocess import until

# Windows this long never roll over during a test run (they are aligned to the epoch).
LONG = 10_000_000
LONGER = 20_000_000


def new_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def rule_for(tenant: str, *budgets: tuple[int, int], max_in_flight: int = 0) -> QuotaRule:
    return QuotaRule(
        name=f"r-{tenant}",
        budgets=tuple(Budget(w, t) for w, t in budgets),
        default_max_tokens=100,
        match_tenant=tenant,
        max_in_flight=max_in_flight,
    )


@contextlib.asynccontextmanager
async def open_gate(
    url: str, rules: Sequence[QuotaRule], *, reservation_timeout_s: float = 120, clock: TestClock | None = None,
    **options: object
) -> AsyncIterator[QuotaGate]:
    ledger = QuotaLedger(create_client(url), reservation_timeout_s=reservation_timeout_s, clock=clock)
    gate = QuotaGate(ledger, rules, **options)  # type: ignore[arg-type]
    await gate.start()
    try:
        yield gate
    finally:
        await gate.close()


async def admit(gate: QuotaGate, tenant: str, tokens: int, model: str = "m") -> Admission:
    """The gate's ``admission`` as a worker awaits it; body_len 0: the estimate is exactly ``tokens``."""
    admission = gate.admission(tenant, model, 0, tokens)
    assert admission is not None, "no rule applies"
    if admission.__class__ is not Admission:
        admission = await admission  # type: ignore[misc]
    return admission  # type: ignore[return-value]


async def flush_scripts(url: str) -> None:
    """SCRIPT FLUSH on the server (every primary of a cluster), as a restart or a failover would."""
    client = create_client(url)
    try:
        if isinstance(client, ClusterTransport):
            await client.script_flush()  # valkey-py's: on every primary
        else:
            await client.execute_command("SCRIPT", "FLUSH")
    finally:
        await client.aclose()


async def rule_report(ledger: QuotaLedger, rule: QuotaRule, tenant: str) -> ScopeReport:
    """What the ledger holds for one rule of one tenant."""
    return (await ledger.report(tenant, [rule.scope]))[1][0]


def window(report: dict, rule_index: int = 0, window_index: int = 0) -> dict:
    return report["rules"][rule_index]["windows"][window_index]


def test_admits_within_budget_and_denies_over_it(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 1000))]) as gate:
            remaining = []
            for _ in range(3):
                admission = await admit(gate, tenant, 300)
                assert admission.allowed and admission.status is None
                remaining.append(dict(admission.headers)[b"x-ratelimit-remaining-tokens"])
            assert remaining == [b"700", b"400", b"100"]

            denied = await admit(gate, tenant, 300)
            assert (denied.allowed, denied.status, denied.reason) == (False, 429, "denied")
            assert denied.error is not None and denied.error[2] == "rate_limit_exceeded"
            headers = dict(denied.headers)
            assert headers[b"x-ratelimit-limit-tokens"] == b"1000"
            assert headers[b"x-ratelimit-remaining-tokens"] == b"100"
            assert int(headers[b"retry-after"]) >= 1
            assert headers[b"x-ratelimit-reset-tokens"].endswith(b"s")
            assert (await admit(gate, tenant, 100)).allowed  # what is left still fits
            assert gate.counters.admitted == 4 and gate.counters.denied == 1

    asyncio.run(scenario())


def test_concurrent_admissions_never_exceed_the_budget(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 10_000))]) as gate:
            results = await asyncio.gather(*(admit(gate, tenant, 100) for _ in range(300)))
            assert sum(a.allowed for a in results) == 100
            report = await gate.quota_report(tenant)
            assert window(report)["reserved"] == 10_000
            assert window(report)["remaining"] == 0

    asyncio.run(scenario())


_OTHER_PROCESS = textwrap.dedent(
    """
    import asyncio, sys
    from gateway.quota.admission import Admission
    from gateway.valkey.client import create_client
    from gateway.quota.gate import QuotaGate
    from gateway.quota.ledger import QuotaLedger
    from gateway.quota.rules import Budget, QuotaRule

    url, tenant, window, budget, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])

    async def main():
        rule = QuotaRule("r-" + tenant, (Budget(window, budget),), 100, tenant)
        gate = QuotaGate(QuotaLedger(create_client(url), reservation_timeout_s=120), [rule],
                         request_timeout_s=5)
        await gate.start()
        import time
        await asyncio.sleep(max(0.0, start_at - time.time()))
        async def admit():
            admission = gate.admission(tenant, "m", 0, 100)
            return admission if admission.__class__ is Admission else await admission
        results = await asyncio.gather(*(admit() for _ in range(150)))
        print(sum(a.allowed for a in results))
        await gate.close()

    asyncio.run(main())
    """
)


def test_separate_processes_share_one_exact_budget(valkey_url: str) -> None:
    tenant = new_tenant()
    start_at = time.time() + 1.0  # both children and this process race from the same instant
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _OTHER_PROCESS, valkey_url, tenant, str(LONG), "10000", str(start_at)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for _ in range(2)
    ]

    async def scenario() -> int:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 10_000))], request_timeout_s=5) as gate:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            results = await asyncio.gather(*(admit(gate, tenant, 100) for _ in range(150)))
            return sum(a.allowed for a in results)

    here = asyncio.run(scenario())
    there = [int(child.communicate(timeout=20)[0]) for child in children]
    assert all(child.returncode == 0 for child in children)
    assert here + sum(there) == 100  # 450 attempts, budget for exactly 100


def test_reconciliation_refunds_unused_reservation_so_later_requests_fit(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 1000))]) as gate:
            first = await admit(gate, tenant, 600)
            assert first.allowed
            assert not (await admit(gate, tenant, 600)).allowed
            gate.settle(first, 100)
            await gate.drain()
            report = await gate.quota_report(tenant)
            assert (window(report)["used"], window(report)["reserved"]) == (100, 0)
            assert (await admit(gate, tenant, 600)).allowed
            assert gate.counters.tokens_refunded == 500 and gate.counters.tokens_actual == 100

    asyncio.run(scenario())


def test_overage_is_charged(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 1000))]) as gate:
            admission = await admit(gate, tenant, 100)
            gate.settle(admission, 900)
            await gate.drain()
            assert window(await gate.quota_report(tenant))["used"] == 900
            assert gate.counters.tokens_overage == 800
            assert not (await admit(gate, tenant, 200)).allowed

    asyncio.run(scenario())


def test_reconciling_twice_charges_once(valkey_url: str) -> None:
    tenant = new_tenant()
    rule = rule_for(tenant, (LONG, 1000))

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule]) as gate:
            admission = await admit(gate, tenant, 500)
            reservation = admission.reservation
            assert reservation is not None
            ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=120)
            try:
                assert await ledger.settle(reservation, 50) == SETTLE_APPLIED
                assert await ledger.settle(reservation, 50) == SETTLE_NOOP
                assert await ledger.settle(reservation, 400) == SETTLE_NOOP
            finally:
                await ledger.close()
            gate.settle(admission, 70)  # the gate's own settle is now a duplicate too
            gate.settle(admission, 70)  # and a second call on the handle does nothing
            await gate.drain()
            report = await gate.quota_report(tenant)
            assert (window(report)["used"], window(report)["reserved"]) == (50, 0)
            assert gate.counters.reconcile_duplicates == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("status", "total"), [(500, None), (0, None), (200, None)])
def test_failed_or_unreported_responses_are_charged_at_the_estimate(
    valkey_url: str, status: int, total: int | None
) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 1000))]) as gate:
            admission = await admit(gate, tenant, 400)
            assert attempt_tokens(status, total, admission.estimate) == 400
            gate.settle(admission, None)
            await gate.drain()
            report = await gate.quota_report(tenant)
            assert (window(report)["used"], window(report)["reserved"]) == (400, 0)

    asyncio.run(scenario())


def test_abandoned_reservation_is_charged_at_its_estimate_after_the_timeout(valkey_url: str) -> None:
    tenant = new_tenant()
    rule = rule_for(tenant, (LONG, 1000))

    clock = TestClock()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule], reservation_timeout_s=0.5, clock=clock) as gate:
            async with open_gate(valkey_url, [rule], reservation_timeout_s=0.5, clock=clock) as lost:
                abandoned = await admit(lost, tenant, 300)  # that gate stops without settling it
            assert abandoned.allowed
            clock.advance(0.499)
            report = await gate.quota_report(tenant)
            assert (window(report)["reserved"], report["rules"][0]["in_flight"]) == (300, 1)
            clock.advance(0.002)
            report = await gate.quota_report(tenant)
            assert (window(report)["used"], window(report)["reserved"]) == (300, 0)
            assert report["rules"][0]["in_flight"] == 0
            gate.settle(abandoned, 5)  # too late: stays charged at the estimate
            await gate.drain()
            assert window(await gate.quota_report(tenant))["used"] == 300

    asyncio.run(scenario())


def test_an_expired_reservation_settled_before_anyone_noticed_is_charged_at_estimate(valkey_url: str) -> None:
    tenant = new_tenant()
    rule = rule_for(tenant, (LONG, 1000))

    clock = TestClock()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule], reservation_timeout_s=0.3, clock=clock) as gate:
            async with open_gate(valkey_url, [rule], reservation_timeout_s=0.3, clock=clock) as lost:
                admission = await admit(lost, tenant, 300)  # nothing keeps it alive from now on
            clock.advance(0.301)
            gate.settle(admission, 5)
            await gate.drain()
            assert gate.counters.reservations_expired == 1
            assert window(await gate.quota_report(tenant))["used"] == 300

    asyncio.run(scenario())


def test_a_request_running_past_the_timeout_keeps_counting_and_is_charged_its_usage(valkey_url: str) -> None:
    # Issue 27, finding 6: a 10.4 s stream cost its estimate with the timeout at 5 s, and stopped
    # counting toward max_in_flight. The gate extends the reservations of requests still running.
    tenant = new_tenant()
    rule = rule_for(tenant, (LONG, 1000), max_in_flight=1)

    clock = TestClock()

    async def scenario() -> None:
        # The ledger's time is the test's clock, so a stalled process cannot let the reservation lapse: the
        # keeper's passes (every quarter of the 0.2 s timeout, in real time) extend it to the clock's now +
        # 0.2 s, and the clock moves on 0.15 s at a time, each step once a pass has extended it.
        async with open_gate(valkey_url, [rule], reservation_timeout_s=0.2, clock=clock) as gate:
            running = await admit(gate, tenant, 300)
            assert running.allowed
            for _ in range(6):  # 0.9 s of the ledger's time: over four timeouts
                clock.advance(0.15)
                # only a pass stamped after the step extends it (one stamped before finds its deadline
                # already at that now + 0.2 s, and moves nothing)
                extended = gate.counters.reservations_extended
                await until(lambda seen=extended: gate.counters.reservations_extended > seen, "an extension")
            report = await gate.quota_report(tenant)
            assert (window(report)["used"], window(report)["reserved"]) == (0, 300)
            assert report["rules"][0]["in_flight"] == 1
            second = await admit(gate, tenant, 10)
            assert (second.allowed, second.reason) == (False, "denied_concurrency")
            gate.settle(running, 42)
            await gate.drain()
            report = await gate.quota_report(tenant)
            assert (window(report)["used"], window(report)["reserved"]) == (42, 0)
            assert report["rules"][0]["in_flight"] == 0
            assert gate.counters.reservations_extended == 6 and gate.counters.reservations_expired == 0
            # A settled reservation is no longer extended (over two passes), nor charged again once past
            # any deadline it had.
            extended = gate.counters.reservations_extended
            await asyncio.sleep(2.5 * 0.05)
            assert gate.counters.reservations_extended == extended
            clock.advance(1.0)
            assert window(await gate.quota_report(tenant))["used"] == 42

    asyncio.run(scenario())


def test_extending_moves_only_live_reservations(valkey_url: str) -> None:
    tenant = new_tenant()
    rule = rule_for(tenant, (LONG, 1000))

    clock = TestClock()

    async def scenario() -> None:
        # The ledger's time is the test's clock: each step lands exactly on its side of a deadline.
        ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=1.0, clock=clock)
        await ledger.load_script()

        async def reserve(tokens: int) -> Reservation:
            command = ledger.admit_command(ledger.account(tenant, rule), tokens, uuid.uuid4().hex.encode())
            (reply,) = await ledger.send_admits([command])
            reservation = QuotaLedger.read(command, reply).reservation
            assert reservation is not None
            return reservation

        try:
            settled, lapsing, live = await reserve(100), await reserve(200), await reserve(300)
            assert await ledger.settle(settled, 7) == SETTLE_APPLIED
            clock.advance(0.5)
            assert await ledger.extend_many([live]) == 1
            clock.advance(0.501)  # `lapsing` is past its deadline now, `live` is not (0.499 s left)
            assert await ledger.extend_many([settled, lapsing, live]) == 1  # neither comes back
            report = await rule_report(ledger, rule, tenant)
            assert (report.in_flight, report.windows[0].used, report.windows[0].reserved) == (1, 207, 300)
            assert await ledger.settle(lapsing, 1) == SETTLE_NOOP  # it was charged at its estimate
            assert await ledger.settle(live, 30) == SETTLE_APPLIED
            assert (await rule_report(ledger, rule, tenant)).windows[0].used == 237
        finally:
            await ledger.close()

    asyncio.run(scenario())


def test_tenants_have_independent_budgets(valkey_url: str) -> None:
    a, b = new_tenant(), new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(a, (LONG, 500)), rule_for(b, (LONG, 500))]) as gate:
            assert (await admit(gate, a, 500)).allowed
            assert not (await admit(gate, a, 1)).allowed
            assert (await admit(gate, b, 500)).allowed

    asyncio.run(scenario())


def test_one_default_rule_still_meters_each_tenant_separately(valkey_url: str) -> None:
    a, b = new_tenant(), new_tenant()
    default = QuotaRule(f"default-{a}", (Budget(LONG, 500),), 100)

    async def scenario() -> None:
        async with open_gate(valkey_url, [default]) as gate:
            assert (await admit(gate, a, 500)).allowed
            assert not (await admit(gate, a, 500)).allowed
            assert (await admit(gate, b, 500)).allowed

    asyncio.run(scenario())


def test_multiple_windows_are_all_or_nothing(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 1000), (LONGER, 500))]) as gate:
            assert (await admit(gate, tenant, 300)).allowed
            denied = await admit(gate, tenant, 300)  # fits the first window, not the second
            assert denied.status == 429
            assert dict(denied.headers)[b"x-ratelimit-limit-tokens"] == b"500"
            assert dict(denied.headers)[b"x-ratelimit-remaining-tokens"] == b"200"
            report = await gate.quota_report(tenant)
            assert [w["reserved"] for w in report["rules"][0]["windows"]] == [300, 300]
            admitted = await admit(gate, tenant, 200)
            # Success headers report the tightest budget.
            assert dict(admitted.headers)[b"x-ratelimit-remaining-tokens"] == b"0"

    asyncio.run(scenario())


def test_concurrency_cap_limits_requests_in_flight(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 10_000), max_in_flight=2)]) as gate:
            first, second = await admit(gate, tenant, 10), await admit(gate, tenant, 10)
            assert first.allowed and second.allowed
            third = await admit(gate, tenant, 10)
            assert (third.status, third.reason) == (429, "denied_concurrency")
            assert dict(third.headers)[b"retry-after"] == b"1"
            gate.settle(first, 10)
            await gate.drain()
            assert (await admit(gate, tenant, 10)).allowed

    asyncio.run(scenario())


def test_report_covers_every_rule_that_can_apply(valkey_url: str) -> None:
    tenant = new_tenant()
    rules = [
        QuotaRule(f"big-{tenant}", (Budget(LONG, 50),), 10, tenant, "big"),
        rule_for(tenant, (LONG, 1000), (LONGER, 5000)),
    ]

    async def scenario() -> None:
        async with open_gate(valkey_url, rules) as gate:
            await admit(gate, tenant, 20, model="big")
            await admit(gate, tenant, 30, model="small")
            report = await gate.quota_report(tenant)
            assert report["tenant"] == tenant
            assert [r["rule"] for r in report["rules"]] == [f"big-{tenant}", f"r-{tenant}"]
            assert report["rules"][0]["windows"][0] | {"reset_s": 0} == {
                "window_s": LONG,
                "limit": 50,
                "used": 0,
                "reserved": 20,
                "remaining": 30,
                "reset_s": 0,
            }
            assert [w["reserved"] for w in report["rules"][1]["windows"]] == [30, 30]
            assert 0 < report["rules"][1]["windows"][0]["reset_s"] <= LONG

    asyncio.run(scenario())


def test_every_key_has_a_ttl(valkey_url: str) -> None:
    tenant = new_tenant()
    rule = rule_for(tenant, (60, 1000), (LONG, 5000))
    clear_of_window_end(60, 5)  # the minute's window must not roll over between the two admits: one hash

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule], reservation_timeout_s=120) as gate:
            await admit(gate, tenant, 10)
            settled = await admit(gate, tenant, 10)
            gate.settle(settled, 3)
            await gate.drain()
            client = create_client(valkey_url)
            try:
                keys = [
                    k
                    async for k in client.scan_iter(match=key_prefix(tenant).replace("{", "[{]") + "*")
                ]
                assert len(keys) == 3  # the reservation set and one hash per window
                for key in keys:
                    ttl_ms = await client.execute_command("PTTL", key)
                    assert 120_000 < ttl_ms <= (LONG + 240) * 1000, (key, ttl_ms)
            finally:
                await client.aclose()

    asyncio.run(scenario())


def test_lost_script_cache_is_reloaded_transparently(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for(tenant, (LONG, 1000))]) as gate:
            await flush_scripts(valkey_url)
            admission = await admit(gate, tenant, 100)
            assert admission.allowed
            await flush_scripts(valkey_url)
            gate.settle(admission, 40)  # the pipelined settle path reloads too
            await gate.drain()
            assert window(await gate.quota_report(tenant))["used"] == 40
            assert gate.counters.reconcile_failures == 0

    asyncio.run(scenario())


def test_unmatched_tenant_is_unmetered_without_a_round_trip(valkey_url: str) -> None:
    async def scenario() -> None:
        async with open_gate(valkey_url, [rule_for("someone-else", (LONG, 1))]) as gate:
            assert gate.admission(new_tenant(), "m", 0, 10**9) is None  # nothing to await, nothing to settle
            assert gate.counters.unmetered == 1 and gate.counters.admitted == 0

    asyncio.run(scenario())


# --- backend failures ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("policy", ["reject", "allow"])
def test_backend_down_applies_policy_with_breaker_and_recovers_at_once(tmp_path: Path, policy: str) -> None:
    server = EmbeddedValkey(tmp_path / "valkey", port=_free_port())
    url = server.start()
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(
            url, [rule_for(tenant, (LONG, 10_000))], on_backend_error=policy, breaker_failures=2,
        ) as gate:
            assert (await admit(gate, tenant, 100)).reason == "admitted"
            server.stop()
            outcomes = [await admit(gate, tenant, 100) for _ in range(2)]
            assert gate.breaker.is_open and gate.counters.breaker_opened == 1
            # Open breaker: the policy applies without touching the network.
            started = time.perf_counter()
            outcomes += [await admit(gate, tenant, 100) for _ in range(200)]
            assert (time.perf_counter() - started) / 200 < 0.001
            if policy == "reject":
                assert {(a.allowed, a.status, a.reason) for a in outcomes} == {
                    (False, 503, "backend_error_rejected")
                }
                assert outcomes[0].error is not None
                assert dict(outcomes[-1].headers)[b"retry-after"] == b"1"
                assert gate.counters.backend_error_rejected == 202
            else:
                assert {(a.allowed, a.reason) for a in outcomes} == {(True, "backend_error_allowed")}
                assert gate.counters.backend_error_allowed == 202
                gate.settle(outcomes[0], 10)  # nothing was reserved: nothing to settle
            await asyncio.sleep(0.3)  # the probe keeps failing meanwhile; the breaker stays open
            assert gate.breaker.is_open and gate.counters.breaker_closed == 0
            server.start()  # same port and data: the budget so far survives; it answers PING now
            answering = time.monotonic()
            while (await admit(gate, tenant, 100)).reason != "admitted":
                assert time.monotonic() - answering < 0.5, "no admission within 0.5 s of the backend answering"
                await asyncio.sleep(0.01)
            assert not gate.breaker.is_open and gate.counters.breaker_closed == 1
            report = await gate.quota_report(tenant)
            assert window(report)["reserved"] == 200

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_backend_that_hangs_costs_at_most_the_timeout_until_the_breaker_opens() -> None:
    # Accepts connections and never answers: the worst case for request latency.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(
            f"valkey://127.0.0.1:{port}/0",
            [rule_for(tenant, (LONG, 1000))],
            request_timeout_s=0.1,
            breaker_failures=2,
        ) as gate:
            timings = []
            for _ in range(20):
                started = time.perf_counter()
                admission = await admit(gate, tenant, 10)
                timings.append(time.perf_counter() - started)
                assert admission.status == 503
            assert all(t < 0.3 for t in timings[:2])  # bounded by the request timeout
            # Then the breaker answers at once: well under the 0.1 s a call to the backend would wait (not
            # 10 ms: a process that loses the CPU for a slice or two on a loaded machine takes longer).
            assert max(timings[2:]) < 0.05

    try:
        asyncio.run(scenario())
    finally:
        listener.close()


def test_budgets_survive_an_embedded_server_restart(tmp_path: Path) -> None:
    tenant = new_tenant()
    rules = [rule_for(tenant, (LONG, 1000))]

    async def spend() -> None:
        async with open_gate(url, rules) as gate:
            admission = await admit(gate, tenant, 700)
            gate.settle(admission, 650)
            await gate.drain()

    async def check() -> None:
        async with open_gate(url, rules) as gate:
            assert window(await gate.quota_report(tenant))["used"] == 650
            assert not (await admit(gate, tenant, 400)).allowed

    server = EmbeddedValkey(tmp_path / "data")
    url = server.start()
    try:
        asyncio.run(spend())
        server.stop()
        url = server.start()
        asyncio.run(check())
    finally:
        server.stop()


def test_a_second_server_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    first = EmbeddedValkey(tmp_path / "data")
    first.start()
    try:
        with pytest.raises(EmbeddedValkeyError, match="already running"):
            EmbeddedValkey(tmp_path / "data").start()
    finally:
        first.stop()


def test_an_admit_whose_reply_was_lost_is_released_once_the_backend_catches_up(valkey_url: str) -> None:
    tenant = new_tenant()
    rule = rule_for(tenant, (LONG, 1000), max_in_flight=1)

    async def stall_backend(stalling: asyncio.Event) -> None:
        # A busy script: Valkey reads nothing else meanwhile, like an overloaded server. (TIME is frozen
        # inside scripts, so it counts instead: 0.5 to 1.5 s by the machine, well under the 5 s busy-script
        # threshold after which Valkey would refuse, not queue, other commands: 450 million took 4.4 s on
        # an idle 2-core test machine, and a loaded one goes past it.)
        client = create_client(valkey_url, timeout_s=30)
        script = "local x = 0 for i = 1, tonumber(ARGV[1]) do x = x + i end return 1"
        try:
            await client.execute_command("PING")  # connected: the script is written the moment it is sent
            stalled = client.execute_command("EVAL", script, 0, 150_000_000)
            stalling.set()
            await stalled
        finally:
            await client.aclose()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule], request_timeout_s=0.25) as gate:
            stalling = asyncio.Event()
            stall = asyncio.create_task(stall_backend(stalling))
            await stalling.wait()  # the script goes first, whatever connecting its client took
            await asyncio.sleep(0.1)
            lost = await admit(gate, tenant, 100)
            assert lost.reason == "backend_error_rejected" and lost.status == 503
            await stall
            # The admit ran after all; the gate cancels it off the request path.
            deadline = time.monotonic() + 8
            report = await gate.quota_report(tenant)
            while time.monotonic() < deadline and (window(report)["reserved"] or report["rules"][0]["in_flight"]):
                await asyncio.sleep(0.2)
                report = await gate.quota_report(tenant)
            assert window(report)["reserved"] == 0 and window(report)["used"] == 0
            assert report["rules"][0]["in_flight"] == 0
            assert (await admit(gate, tenant, 100)).allowed  # the concurrency slot is free again

    asyncio.run(scenario())
