"""The quota gate's parts one by one, in-process, against the real bundled Valkey: the admit batcher, the
lease book, the backend breaker and its probe, and the single-node ledger transport (the cluster transport
runs the same checks in test_quota_cluster.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from valkey.exceptions import ResponseError

from gateway.quota.admission import Admission
from gateway.quota.breaker import BackendBreaker
from gateway.quota.counters import QuotaCounters
from gateway.quota.gate import QuotaGate
from gateway.quota.lease import LeaseSpec
from gateway.quota.ledger import F_TK_LIMIT, QuotaLedger, key_prefix
from gateway.quota.rules import QuotaRule
from gateway.valkey.client import create_client
from gateway.valkey.embedded import EmbeddedValkey
from gateway.valkey.resp_transport import RespTransport
from gateway.valkey.transport import SLOT, Reply, ScriptTransport, Wire
from tests.integration.test_quota_ledger import (
    LONG,
    _free_port,
    admit,
    flush_scripts,
    new_tenant,
    rule_for,
    rule_report,
    window,
)


class CountingTransport(RespTransport):
    """The real single-node transport, noting the size of each admit write it sends."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.admit_writes: list[int] = []

    def send_admits(self, wires: Sequence[bytes]):  # type: ignore[no-untyped-def,override]
        self.admit_writes.append(len(wires))
        return super().send_admits(wires)


@contextlib.asynccontextmanager
async def counted_gate(url: str, rules: list[QuotaRule], **options: object) -> AsyncIterator[
        tuple[QuotaGate, CountingTransport]]:
    transport = CountingTransport.from_url(url, timeout_s=2)
    gate = QuotaGate(QuotaLedger(transport, reservation_timeout_s=120), rules, **options)  # type: ignore[arg-type]
    await gate.start()
    try:
        yield gate, transport  # type: ignore[misc]
    finally:
        await gate.close()


def remaining(admission: Admission) -> int:
    return int(dict(admission.headers)[b"x-ratelimit-remaining-tokens"])


async def granted(gate: QuotaGate, blocks: int, within_s: float = 2.0) -> None:
    """Until the gate holds ``blocks`` grants (the ask goes out with the write after the exact admit's reply)."""
    deadline = time.monotonic() + within_s
    while gate.counters.leases_granted < blocks:
        assert time.monotonic() < deadline, f"{gate.counters.leases_granted} block(s) granted, not {blocks}"
        await asyncio.sleep(0.005)


# -- the admit batcher --------------------------------------------------------------------------------------


def test_one_tick_of_admits_is_one_write_and_each_request_gets_its_own_reply(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with counted_gate(valkey_url, [rule_for(tenant, (LONG, 10_000))]) as (gate, transport):
            first = await asyncio.gather(*(admit(gate, tenant, 100) for _ in range(50)))
            assert transport.admit_writes == [50]
            # Sent in order, answered in order: each request its own reply.
            assert [remaining(a) for a in first] == list(range(9900, 4999, -100))
            second = await asyncio.gather(*(admit(gate, tenant, 100) for _ in range(3)))
            assert transport.admit_writes == [50, 3]
            assert [remaining(a) for a in second] == [4900, 4800, 4700]
            assert gate.counters.admitted == 53 and gate.counters.backend_errors == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["reject", "allow"])
def test_a_failed_batch_resolves_every_request_with_the_policy_and_counts_one_failure(
        tmp_path: Path, policy: str) -> None:
    server = EmbeddedValkey(tmp_path / "valkey", port=_free_port())
    url = server.start()
    tenant = new_tenant()

    async def scenario() -> None:
        async with counted_gate(url, [rule_for(tenant, (LONG, 10_000))], on_backend_error=policy,
                                breaker_failures=2) as (gate, transport):
            server.stop()  # every write fails from now on
            ticks = [await asyncio.gather(*(admit(gate, tenant, 100) for _ in range(20))) for _ in range(3)]
            expected = ((True, "backend_error_allowed", None) if policy == "allow"
                        else (False, "backend_error_rejected", 503))
            assert {(a.allowed, a.reason, a.status) for tick in ticks for a in tick} == {expected}
            # One failure per batch (not per request); the second opened the breaker, which answered the
            # third tick without a write.
            assert transport.admit_writes == [20, 20]
            assert gate.breaker.is_open and gate.counters.breaker_opened == 1
            counters = gate.counters
            assert (counters.backend_error_allowed if policy == "allow" else counters.backend_error_rejected) == 60
            assert counters.admitted == 0

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_request_that_stops_waiting_gets_its_reservation_released(valkey_url: str) -> None:
    tenant = new_tenant()

    async def scenario() -> None:
        async with counted_gate(valkey_url, [rule_for(tenant, (LONG, 1000), max_in_flight=1)]) as (gate, _):
            waiting = gate.admission(tenant, "m", 0, 300)
            assert isinstance(waiting, asyncio.Future)
            waiting.cancel()  # the client went away before the reply came; the admit ran all the same
            await asyncio.sleep(0.05)
            await gate.drain()
            report = await gate.quota_report(tenant)
            assert report["rules"][0]["in_flight"] == 0
            assert (window(report)["reserved"], window(report)["used"]) == (0, 0)  # released, unused
            assert (await admit(gate, tenant, 300)).allowed  # its concurrency slot is free again

    asyncio.run(scenario())


# -- the lease book -----------------------------------------------------------------------------------------


def test_a_block_admits_without_round_trips_and_goes_back_with_what_its_requests_were_charged(
        valkey_url: str) -> None:
    tenant = new_tenant()
    lease = LeaseSpec(tokens=1000, ttl_s=0.5, headroom=2)

    async def scenario() -> None:
        async with counted_gate(valkey_url, [rule_for(tenant, (LONG, 1_000_000))], lease=lease) as (gate, transport):
            first = await admit(gate, tenant, 40)  # exact; its reply asks for a block (the next write)
            await granted(gate, 1)
            assert transport.admit_writes == [1, 1]
            taken = [gate.admission(tenant, "m", 0, 40) for _ in range(10)]
            assert all(a.__class__ is Admission and a.allowed for a in taken)  # decided at once: no await
            assert transport.admit_writes == [1, 1] and gate.counters.leased == 10
            assert window(await gate.quota_report(tenant))["reserved"] == 40 + 1000  # the block is one reservation
            for admission in taken:
                gate.settle(admission, 7)  # type: ignore[arg-type]
            gate.settle(first, 40)
            # The used block was renewed before it expired (its successor took nothing and lapsed after it);
            # each went back with what its requests were charged. The successor's life (0.5 s) is counted from
            # its grant, which a slow backend may bring late: wait for it, then well past its end.
            await granted(gate, 2)
            await asyncio.sleep(1.2)
            await gate.drain()
            assert gate.counters.leases_granted == 2
            report = window(await gate.quota_report(tenant))
            assert (report["used"], report["reserved"]) == (40 + 70, 0)

    asyncio.run(scenario())


def test_a_request_that_does_not_fit_closes_the_block_and_goes_to_the_ledger(valkey_url: str) -> None:
    tenant = new_tenant()
    lease = LeaseSpec(tokens=1000, ttl_s=30, headroom=2)

    async def scenario() -> None:
        async with counted_gate(valkey_url, [rule_for(tenant, (LONG, 1_000_000))], lease=lease) as (gate, transport):
            gate.settle(await admit(gate, tenant, 10), 10)
            await granted(gate, 1)
            inside = gate.admission(tenant, "m", 0, 600)
            assert inside.__class__ is Admission and inside.lease is not None  # type: ignore[union-attr]
            outside = gate.admission(tenant, "m", 0, 600)  # 1200 > 1000: the block closes
            assert outside.__class__ is not Admission
            outside = await outside  # type: ignore[misc]
            assert outside.allowed and outside.lease is None and outside.reservation is not None
            assert gate.counters.leases_granted >= 1
            gate.settle(inside, 55)  # type: ignore[arg-type]  # its block's last request: settled with it
            gate.settle(outside, 600)
            await gate.drain()
            report = window(await gate.quota_report(tenant))
            # The closed block went back with 55; a successor block (asked for when it closed) may be held.
            assert report["used"] == 10 + 55 + 600 and report["reserved"] in (0, 1000)

    asyncio.run(scenario())


def test_a_used_block_is_renewed_before_it_expires_and_an_idle_one_lapses(valkey_url: str) -> None:
    tenant = new_tenant()
    lease = LeaseSpec(tokens=1000, ttl_s=0.4, headroom=2)

    async def scenario() -> None:
        async with counted_gate(valkey_url, [rule_for(tenant, (LONG, 1_000_000))], lease=lease) as (gate, transport):
            gate.settle(await admit(gate, tenant, 10), 10)
            await granted(gate, 1)
            used = gate.admission(tenant, "m", 0, 10)
            assert used.__class__ is Admission and used.lease is not None  # type: ignore[union-attr]
            await granted(gate, 2)  # its successor, asked for shortly before the block expires
            assert transport.admit_writes == [1, 1, 1]  # the exact admit, the ask, the renewal: nothing else
            gate.settle(used, 10)  # type: ignore[arg-type]
            await asyncio.sleep(1.0)  # the successor was never used: it lapses, nothing replaces it
            assert gate.counters.leases_granted == 2
            await gate.drain()
            report = window(await gate.quota_report(tenant))
            assert (report["used"], report["reserved"]) == (20, 0)

    asyncio.run(scenario())


def test_closing_the_gate_returns_every_block_charging_requests_in_flight_their_estimate(valkey_url: str) -> None:
    tenant = new_tenant()
    lease = LeaseSpec(tokens=1000, ttl_s=30, headroom=2)

    async def scenario() -> None:
        async with counted_gate(valkey_url, [rule_for(tenant, (LONG, 1_000_000))], lease=lease) as (gate, _):
            gate.settle(await admit(gate, tenant, 10), 10)
            await granted(gate, 1)
            running = gate.admission(tenant, "m", 0, 300)
            assert running.__class__ is Admission and running.lease is not None  # type: ignore[union-attr]
        # closed with the request in flight: its block went back charging it 300
        ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=120)
        try:
            report = (await rule_report(ledger, rule_for(tenant, (LONG, 1_000_000)), tenant)).windows[0]
            assert (report.used, report.reserved) == (10 + 300, 0)
        finally:
            await ledger.close()

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def slow_replies(url: str, delay_s: float) -> AsyncIterator[str]:
    """A loopback proxy to the Valkey at ``url`` that holds every reply ``delay_s`` (commands pass at
    once): a distant backend. Yields the URL to reach Valkey through it."""
    target = urlsplit(url)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if target.scheme == "unix":
            server_reader, server_writer = await asyncio.open_unix_connection(target.path)
        else:
            server_reader, server_writer = await asyncio.open_connection(target.hostname, target.port)
        await asyncio.gather(pipe(client_reader, server_writer, 0), pipe(server_reader, client_writer, delay_s))

    proxy = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = proxy.sockets[0].getsockname()[1]
    password = f":{target.password}@" if target.password else ""
    try:
        yield f"valkey://{password}127.0.0.1:{port}/0"
    finally:
        proxy.close()


def test_a_block_granted_while_the_gate_closes_goes_back_unused(valkey_url: str) -> None:
    # The ask for a block is on the wire when the worker stops: the ledger grants it, and the grant's reply
    # must still give it back, or the whole block stays reserved until it expires and is charged in full.
    tenant = new_tenant()
    rule = rule_for(tenant, (LONG, 1_000_000))
    lease = LeaseSpec(tokens=1000, ttl_s=30, headroom=2)

    async def scenario() -> None:
        async with slow_replies(valkey_url, 0.3) as distant:
            async with counted_gate(distant, [rule], lease=lease) as (gate, transport):
                running = await admit(gate, tenant, 10)  # its reply asks for a block ...
                await asyncio.sleep(0)
                assert transport.admit_writes == [1, 1] and gate.counters.leases_granted == 0  # ... not granted yet
                assert running.allowed  # and it is still running: nothing to settle yet
            # closed: the grant arrived while it closed
        ledger = QuotaLedger(create_client(valkey_url), reservation_timeout_s=120)
        try:
            report = (await rule_report(ledger, rule, tenant)).windows[0]
            assert (report.used, report.reserved) == (0, 10)  # the running request's reservation, no block
        finally:
            await ledger.close()

    asyncio.run(scenario())


# -- the backend breaker ------------------------------------------------------------------------------------


def test_the_breaker_opens_answers_by_policy_and_its_probe_closes_it_once_the_backend_answers(
        tmp_path: Path) -> None:
    server = EmbeddedValkey(tmp_path / "valkey", port=_free_port())
    url = server.start()

    async def scenario() -> None:
        counters = QuotaCounters()
        ledger = QuotaLedger(create_client(url, timeout_s=0.2), reservation_timeout_s=120)
        breaker = BackendBreaker(ledger, counters, policy="reject", failures_to_open=2, probe_interval_s=0.05)
        try:
            server.stop()
            breaker.failed("first")
            assert not breaker.is_open
            breaker.failed("second")
            assert breaker.is_open and counters.breaker_opened == 1
            assert breaker.unavailable().status == 503 and counters.backend_error_rejected == 1
            await asyncio.sleep(0.3)  # the probe keeps failing meanwhile
            assert breaker.is_open and counters.backend_errors > 2
            server.start()
            answering = time.monotonic()
            while breaker.is_open:
                assert time.monotonic() - answering < 0.5, "the probe did not close the breaker"
                await asyncio.sleep(0.01)
            assert counters.breaker_closed == 1
        finally:
            breaker.stop()
            await ledger.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


# -- the transport ------------------------------------------------------------------------------------------


async def check_transport(transport: ScriptTransport, url: str) -> None:
    """What the ledger relies on, for either transport (``url`` reaches the same server, for a flush)."""
    tenant = f"t-{uuid.uuid4().hex[:10]}"
    rule = rule_for(tenant, (LONG, 1000))
    ledger = QuotaLedger(transport, reservation_timeout_s=120)
    await ledger.load_script()
    await transport.ping()
    account = ledger.account(tenant, rule)
    assert account is not None
    zkey, prefix = account.zkey, account.prefix
    template = transport.template((zkey, "report", SLOT, SLOT))
    assert transport.fill(template, (prefix, b"%d" % LONG)) == transport.wire((zkey, "report", prefix, b"%d" % LONG))

    # Admits: one round trip, replies in order.
    commands = [ledger.admit_command(account, n, b"id-%d" % n) for n in (300, 400, 500)]
    replies: list[Reply] = await transport.send_admits([c.wire for c in commands])
    assert [bytes(r)[:2] for r in replies] == [b"1 ", b"1 ", b"0 "]  # type: ignore[arg-type]
    assert QuotaLedger.read(commands[1], replies[1]).triple(F_TK_LIMIT)[1] == 300  # type: ignore[arg-type]
    # The keyspace: the tenant's reservation set, wherever it lives.
    sets = [key async for key in transport.scan_keys(key_prefix(tenant).replace("{", "[{]") + "z", "zset")]
    assert sets == [zkey]

    # A batch survives a lost script cache: the calls answered NOSCRIPT are redone after a reload.
    await flush_scripts(url)
    reservations = [QuotaLedger.read(c, r).reservation for c, r in zip(commands[:2], replies, strict=False)]  # type: ignore[arg-type]
    settles: list[Wire] = [ledger._settle_wire(r, 10, 0) for r in reservations if r is not None]
    assert await transport.run_batch(settles) == [1, 1]
    # One call raises an error reply.
    with pytest.raises(ResponseError, match="unknown mode"):
        await transport.run_one(transport.wire((zkey, "no-such-mode", prefix)))
    report = await rule_report(ledger, rule, tenant)
    assert (report.windows[0].used, report.windows[0].reserved) == (20, 0)


def test_the_single_node_transport_does_what_the_ledger_relies_on(valkey_url: str) -> None:
    async def scenario() -> None:
        transport = create_client(valkey_url)
        assert type(transport) is RespTransport
        try:
            await check_transport(transport, valkey_url)
        finally:
            await transport.aclose()

    asyncio.run(scenario())
