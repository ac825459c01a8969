"""Request rates, key limits, in-flight caps and shadow limits in one atomic admit, against the real bundled
Valkey, in-process (docs/limits.md). The counters are read back from Valkey, key by key."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import valkey

from gateway.identity.auth import KeyIdentity
from gateway.identity.limits import Budget, Limits, RequestLimit
from gateway.quota.admission import Admission
from gateway.quota.gate import QuotaGate
from gateway.quota.lease import LeaseSpec
from gateway.quota.ledger import QuotaLedger, key_prefix
from gateway.quota.rules import QuotaRule
from gateway.valkey.client import create_client
from tests.clock import TestClock
from tests.integration.test_quota_ledger import LONG

DAY = 86400


def new_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def rule(tenant: str, *, requests: Sequence[RequestLimit] = (), budgets: Sequence[Budget] = (),
         max_in_flight: int = 0, name: str | None = None, **match: Any) -> QuotaRule:
    return QuotaRule(name or f"r-{tenant}", tuple(budgets), 10, match.pop("match_tenant", tenant),
                     max_in_flight=max_in_flight, requests=tuple(requests), **match)


def key(tenant: str, alias: str = "ci", **limits: Any) -> KeyIdentity:
    return KeyIdentity(tenant, alias, None, Limits(**limits))


@contextlib.asynccontextmanager
async def open_gate(url: str, rules: Sequence[QuotaRule], **options: Any) -> AsyncIterator[QuotaGate]:
    ledger = QuotaLedger(create_client(url), reservation_timeout_s=options.pop("timeout_s", 120),
                         clock=options.pop("clock", None))
    gate = QuotaGate(ledger, rules, **options)
    await gate.start()
    try:
        yield gate
    finally:
        await gate.close()


async def admit(gate: QuotaGate, tenant: str, tokens: int = 10, *, key: KeyIdentity | None = None,
                model: str = "m") -> Admission:
    admission = gate.admission(tenant, model, 0, tokens, key)
    assert admission is not None, "nothing meters it"
    if admission.__class__ is not Admission:
        admission = await admission  # type: ignore[misc]
    return admission  # type: ignore[return-value]


def counters(url: str, tenant: str) -> dict[bytes, Any]:
    """Every key of the tenant with its value (strings, hashes, sorted sets with scores): what a refused
    request must leave exactly as it was."""
    client = valkey.Valkey.from_url(url)
    try:
        state: dict[bytes, Any] = {}
        for name in client.scan_iter(match=key_prefix(tenant).replace("{", "[{]") + "*"):
            kind = client.type(name)
            if kind == b"string":
                state[name] = client.get(name)
            elif kind == b"hash":
                state[name] = client.hgetall(name)
            elif kind == b"zset":
                state[name] = client.zrange(name, 0, -1, withscores=True)
            else:
                raise AssertionError(f"unexpected key type {kind!r} of {name!r}")
        return state
    finally:
        client.close()


def headers(admission: Admission) -> dict[bytes, bytes]:
    return dict(admission.headers)


def test_a_request_limit_admits_its_burst_then_one_slot_per_interval(valkey_url: str) -> None:
    tenant = new_tenant()
    limit = RequestLimit(DAY, 5, 5)

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule(tenant, requests=[limit])]) as gate:
            admitted = [await admit(gate, tenant) for _ in range(5)]
            assert all(a.allowed for a in admitted)
            assert [headers(a)[b"x-ratelimit-remaining-requests"] for a in admitted] == [b"4", b"3", b"2", b"1", b"0"]
            assert headers(admitted[0])[b"x-ratelimit-limit-requests"] == b"5"
            assert b"x-ratelimit-limit-tokens" not in headers(admitted[0])  # no budget applies
            refused = await admit(gate, tenant)
            assert (refused.allowed, refused.status, refused.reason) == (False, 429, "denied_requests")
            message, kind, code = refused.error  # type: ignore[misc]
            assert (kind, code) == ("requests", "rate_limit_exceeded")
            assert f"rule r-{tenant} requests 5/1d" in message
            # The next slot frees one interval (a day / 5) after the first was taken: not a constant.
            retry = int(headers(refused)[b"retry-after"])
            assert DAY // 5 - 5 <= retry <= DAY // 5
            assert gate.counters.denied_requests == 1

    asyncio.run(scenario())


def test_gcra_has_no_window_boundary_and_burst_bounds_what_comes_at_once(valkey_url: str) -> None:
    tenant = new_tenant()
    clock = TestClock()
    start = clock.to_next(1, 0.75)  # three quarters into a second: the next slot falls across its end

    async def scenario() -> None:
        # 2 per second, at most 1 at once: one slot every 500 ms, whatever the wall clock's seconds say.
        async with open_gate(valkey_url, [rule(tenant, requests=[RequestLimit(1, 2, 1)])], clock=clock) as gate:
            assert (await admit(gate, tenant)).allowed
            assert not (await admit(gate, tenant)).allowed  # a burst of one: the second waits its interval
            clock.now = start + 0.499
            assert not (await admit(gate, tenant)).allowed  # a millisecond early, across the second's end
            clock.now = start + 0.5
            assert (await admit(gate, tenant)).allowed
            # Asked every 50 ms for 2 s (each instant computed afresh: no float drift): one admitted every
            # 500 ms, never two in a row across a second boundary as a fixed window of 2 per second would.
            admitted = []
            for step in range(1, 41):
                clock.now = start + 0.5 + step * 0.05
                if (await admit(gate, tenant)).allowed:
                    admitted.append(step * 50)
            assert admitted == [500, 1000, 1500, 2000], admitted

    asyncio.run(scenario())


@pytest.mark.parametrize("refusing", ["key requests", "rule tokens", "rule in-flight", "key tokens", "rule requests"])
def test_a_refused_request_changes_no_counter_of_any_limit(valkey_url: str, refusing: str) -> None:
    tenant = new_tenant()
    own = key(tenant, requests=(RequestLimit(DAY, 3 if refusing == "key requests" else 100, 3
                                             if refusing == "key requests" else 100),),
              budgets=(Budget(LONG, 100 if refusing == "key tokens" else 10_000),))
    the_rule = rule(tenant, requests=[RequestLimit(60, 3 if refusing == "rule requests" else 100,
                                                   3 if refusing == "rule requests" else 100)],
                    budgets=[Budget(LONG, 100 if refusing == "rule tokens" else 10_000)],
                    max_in_flight=3 if refusing == "rule in-flight" else 50)

    async def scenario() -> None:
        async with open_gate(valkey_url, [the_rule]) as gate:
            held = [await admit(gate, tenant, 30, key=own) for _ in range(3)]
            assert all(a.allowed for a in held)
            before = counters(valkey_url, tenant)
            # a clock per request limit, a window per budget, the rule's in-flight set, the tenant's reservations
            assert len(before) == 2 + 2 + 1 + 1
            refused = await admit(gate, tenant, 30, key=own)
            assert not refused.allowed and refused.status == 429
            assert refusing.split()[0] in refused.message  # type: ignore[operator]
            assert counters(valkey_url, tenant) == before
            # The held requests end: everything they took is given back or charged, and the next one fits
            # what it refused (a request slot is not given back by a request that reached a provider).
            for admission in held:
                gate.settle(admission, 5)
            await gate.drain()
            if refusing not in ("key requests", "rule requests"):
                assert (await admit(gate, tenant, 30, key=own)).allowed

    asyncio.run(scenario())


def test_key_limits_apply_on_top_of_the_rule_and_the_headers_name_the_tightest(valkey_url: str) -> None:
    tenant = new_tenant()
    bot = key(tenant, "bot", requests=(RequestLimit(DAY, 2, 2),))
    other = key(tenant, "other")  # no limits of its own
    the_rule = rule(tenant, requests=[RequestLimit(DAY, 10, 10)], budgets=[Budget(LONG, 1000)])

    async def scenario() -> None:
        async with open_gate(valkey_url, [the_rule]) as gate:
            first = await admit(gate, tenant, 100, key=bot)
            assert headers(first)[b"x-ratelimit-limit-requests"] == b"2"  # the key's, the tighter one
            assert headers(first)[b"x-ratelimit-remaining-requests"] == b"1"
            assert headers(first)[b"x-ratelimit-limit-tokens"] == b"1000"
            assert headers(first)[b"x-ratelimit-remaining-tokens"] == b"900"
            assert (await admit(gate, tenant, 100, key=bot)).allowed
            refused = await admit(gate, tenant, 100, key=bot)
            assert not refused.allowed and "key requests 2/1d" in refused.message  # type: ignore[operator]
            # the same tenant's other key is held by the rule alone: 8 of its 10 slots are left
            admitted = await admit(gate, tenant, 10, key=other)
            assert headers(admitted)[b"x-ratelimit-limit-requests"] == b"10"
            assert headers(admitted)[b"x-ratelimit-remaining-requests"] == b"7"
            report = await gate.quota_report(tenant)
            assert [r["rule"] for r in report["rules"]] == [f"r-{tenant}"]
            assert report["rules"][0]["requests"][0]["remaining"] == 7
            assert report["rules"][0]["windows"][0]["reserved"] == 210

    asyncio.run(scenario())


def test_a_request_that_never_reached_a_provider_gives_its_slot_back(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with open_gate(valkey_url, [rule(tenant, requests=[RequestLimit(DAY, 2, 2)],
                                               budgets=[Budget(LONG, 1000)])]) as gate:
            unrouted = await admit(gate, tenant, 100)
            gate.settle(unrouted, 0, reached=False)  # e.g. no provider serves the model
            refused_by_provider = await admit(gate, tenant, 100)
            gate.settle(refused_by_provider, 0)  # a provider 4xx: nothing charged, but it reached a provider
            await gate.drain()
            assert (await admit(gate, tenant, 100)).allowed  # the unrouted request's slot came back
            assert not (await admit(gate, tenant, 100)).allowed  # the 4xx's did not
            report = (await gate.quota_report(tenant))["rules"][0]
            assert report["windows"][0]["used"] == 0 and report["windows"][0]["reserved"] == 100

    asyncio.run(scenario())


def test_shadow_limits_count_and_report_but_never_refuse(valkey_url: str) -> None:
    tenant = new_tenant()
    the_rule = rule(tenant, requests=[RequestLimit(DAY, 2, 2, shadow=True), RequestLimit(60, 100, 100)],
                    budgets=[Budget(LONG, 150, shadow=True)])

    async def scenario() -> None:
        async with open_gate(valkey_url, [the_rule]) as gate:
            results = [await admit(gate, tenant, 50) for _ in range(4)]
            assert all(a.allowed for a in results)
            requests, tokens = f"rule r-{tenant} requests 2/1d", f"rule r-{tenant} tokens 150/10000000s"
            assert [a.shadow for a in results] == [None, None, (requests,), (requests, tokens)]
            assert gate.counters.shadow_refusals == 3
            assert headers(results[0])[b"x-ratelimit-limit-requests"] == b"100"  # the enforced limit only
            report = (await gate.quota_report(tenant))["rules"][0]
            assert report["requests"][0]["shadow"] is True and report["requests"][0]["remaining"] == 0
            assert "shadow" not in report["requests"][1]
            assert report["windows"][0]["shadow"] is True and report["windows"][0]["reserved"] == 150

    asyncio.run(scenario())


def test_a_block_takes_request_slots_at_once_and_gives_back_what_it_did_not_use(valkey_url: str) -> None:
    tenant = new_tenant()
    the_rule = rule(tenant, requests=[RequestLimit(DAY, 1000, 1000)], budgets=[Budget(LONG, 1_000_000)])

    async def scenario() -> None:
        async with open_gate(valkey_url, [the_rule], lease=LeaseSpec(ttl_s=30, headroom=2, tokens=1000, requests=50)) as gate:
            gate.settle(await admit(gate, tenant, 10), 10)
            while gate.counters.leases_granted < 1:
                await asyncio.sleep(0.005)
            report = (await gate.quota_report(tenant))["rules"][0]
            assert report["requests"][0]["remaining"] == 1000 - 1 - 50  # the block took 50 slots at once
            taken = [gate.admission(tenant, "m", 0, 10) for _ in range(5)]
            assert all(a.__class__ is Admission and a.lease is not None for a in taken)
            assert headers(taken[-1])[b"x-ratelimit-remaining-requests"] == b"%d" % (1000 - 1 - 5)
            gate.settle(taken[0], 0, reached=False)  # never reached a provider: its slot goes back with the block
            for admission in taken[1:]:
                gate.settle(admission, 10)  # type: ignore[arg-type]
        # closed: the block went back with 4 slots used
        async with open_gate(valkey_url, [the_rule]) as reader:
            report = (await reader.quota_report(tenant))["rules"][0]
            assert report["requests"][0]["remaining"] == 1000 - 1 - 4
            assert (report["windows"][0]["used"], report["windows"][0]["reserved"]) == (50, 0)

    asyncio.run(scenario())


def test_blocks_are_sized_from_use_and_never_taken_near_a_limit(valkey_url: str) -> None:
    tenant, small = new_tenant(), new_tenant()

    async def scenario() -> None:
        spec = LeaseSpec(ttl_s=30, headroom=10)
        async with open_gate(valkey_url, [rule(tenant, requests=[RequestLimit(DAY, 100_000, 100_000)]),
                                          rule(small, requests=[RequestLimit(DAY, 30, 30)])], lease=spec) as gate:
            assert (await admit(gate, tenant)).allowed
            while gate.counters.leases_granted < 1:
                await asyncio.sleep(0.005)
            sizes = []
            # Each block fills at once (well within its 30 s life), so the next one is MAX_GROWTH times its
            # size, until the headroom caps it: 100,000 - 1 - 4 - 64 - 1,024 slots left, a tenth of that.
            for _ in range(4):
                granted = gate.counters.leases_granted
                taken = 0
                while gate.admission(tenant, "m", 0, 1).__class__ is Admission:
                    taken += 1
                sizes.append(taken)
                while gate.counters.leases_granted == granted:
                    await asyncio.sleep(0.005)
            assert sizes == [4, 64, 1024, (100_000 - 1 - 4 - 64 - 1024) // 10], sizes
            # 30 requests a day: the first admit leaves 29, less than 10 blocks of 4: every request is exact
            for _ in range(30):
                assert (await admit(gate, small)).allowed
            assert not (await admit(gate, small)).allowed
            assert gate.counters.leases_granted == 5

    asyncio.run(scenario())


def test_concurrent_admits_against_a_request_limit_never_exceed_it(valkey_url: str) -> None:
    tenant = new_tenant()
    rules = [rule(tenant, requests=[RequestLimit(DAY, 37, 37)])]

    async def scenario() -> int:
        async with open_gate(valkey_url, rules, lease=LeaseSpec(ttl_s=1, headroom=2)) as one, \
                open_gate(valkey_url, rules, lease=LeaseSpec(ttl_s=1, headroom=2)) as two:
            results = await asyncio.gather(*(admit(gate, tenant) for _ in range(200) for gate in (one, two)))
            admitted = sum(a.allowed for a in results)
            assert admitted <= 37
        # both gates closed: their blocks went back, so the slots taken are exactly the requests admitted
        async with open_gate(valkey_url, rules) as reader:
            assert (await reader.quota_report(tenant))["rules"][0]["requests"][0]["remaining"] == 37 - admitted
        return admitted

    assert asyncio.run(scenario()) > 0


def test_the_script_reads_valkeys_time_unless_a_test_clock_is_given(valkey_url: str) -> None:
    """The windows tests move a ``TestClock``; production passes none, and the script reads ``TIME``."""
    tenant = new_tenant()
    the_rule = rule(tenant, requests=[RequestLimit(DAY, 10, 10)], budgets=[Budget(LONG, 1000)])

    async def now_ms(clock: TestClock | None) -> int:
        ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=120, clock=clock)
        try:
            await ledger.load_script()
            account = ledger.account(tenant, the_rule)
            assert account is not None
            command = ledger.admit_command(account, 10, uuid.uuid4().hex.encode())
            (reply,) = await ledger.send_admits([command])
            admitted = QuotaLedger.read(command, reply)  # type: ignore[arg-type]
            assert admitted.admitted
            return admitted.now_ms
        finally:
            await ledger.close()

    async def scenario() -> None:
        before = time.time()
        real = await now_ms(None)
        after = time.time()
        assert int(before * 1000) - 1 <= real <= int(after * 1000) + 1  # Valkey's clock is this machine's
        assert await now_ms(TestClock(1_900_000_000.25)) == 1_900_000_000_250
        assert await now_ms(TestClock(1_900_000_001.5)) == 1_900_000_001_500

    asyncio.run(scenario())
