"""The upstream pool on real loopback sockets: slots, waiter hand-over, idle eviction."""

from __future__ import annotations

import asyncio

import pytest

from gateway.request.failures import Failure
from workers.upstream import PoolExhausted, UpstreamPool


class _Server:
    """An asyncio TCP server that accepts and holds connections; counts them."""

    def __init__(self) -> None:
        self.accepted = 0
        self.transports: list[asyncio.Transport] = []

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        outer = self

        class Holder(asyncio.Protocol):
            def connection_made(self, transport):  # type: ignore[override]
                outer.accepted += 1
                outer.transports.append(transport)

        self.server = await loop.create_server(Holder, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for transport in self.transports:
            transport.close()
        self.server.close()
        await self.server.wait_closed()


def run(scenario) -> None:
    async def main() -> None:
        server = _Server()
        port = await server.start()
        try:
            await scenario(server, port)
        finally:
            await server.stop()

    asyncio.run(main())


def pool_for(port: int, **options) -> UpstreamPool:
    defaults = {"max_connections": 1, "connect_timeout": 1.0, "read_timeout": 5.0}
    return UpstreamPool("127.0.0.1", port, **{**defaults, **options})


def test_released_connection_is_handed_to_the_waiter_not_parked():
    async def scenario(server, port):
        pool = pool_for(port)
        first = await pool.acquire()
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        pool.release(first, reusable=True)
        handed = await waiter
        assert handed is first and handed.reused and pool.idle == [] and pool.open_count == 1
        assert server.accepted == 1

    run(scenario)


def test_a_freed_slot_is_handed_to_the_waiter_which_connects():
    async def scenario(server, port):
        pool = pool_for(port)
        first = await pool.acquire()
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        pool.release(first, reusable=False)  # broken: the slot, not the connection, goes to the waiter
        second = await waiter
        assert second is not first and pool.open_count == 1 and server.accepted == 2

    run(scenario)


def test_waiter_gives_up_with_pool_exhausted_and_leaks_nothing():
    async def scenario(server, port):
        pool = pool_for(port, wait_timeout=0.05)
        first = await pool.acquire()
        with pytest.raises(PoolExhausted):
            await pool.acquire()
        pool.release(first, reusable=True)
        assert pool.idle == [first] and pool.open_count == 1

    run(scenario)


def test_connection_handed_over_just_as_the_waiter_gives_up_is_passed_on():
    async def scenario(server, port):
        pool = pool_for(port, wait_timeout=5.0)
        first = await pool.acquire()
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        pool.release(first, reusable=True)  # resolves the waiter's future ...
        waiter.cancel()  # ... which is cancelled before it could run: the connection must not leak
        try:
            owner = await waiter  # Python 3.11's wait_for hands it over despite the cancel
        except asyncio.CancelledError:
            owner = None  # later Pythons raise: then the pool must have taken it back
        if owner is not None:
            assert owner is first
            pool.release(owner, reusable=True)
        assert pool.idle == [first] and pool.open_count == 1
        assert await pool.acquire() is first

    run(scenario)


def test_idle_connection_closed_by_the_provider_is_evicted_and_its_slot_freed():
    async def scenario(server, port):
        pool = pool_for(port)
        conn = await pool.acquire()
        pool.release(conn, reusable=True)
        assert pool.idle == [conn]
        server.transports[0].close()  # the provider drops the idle keep-alive connection
        for _ in range(100):
            if not pool.idle:
                break
            await asyncio.sleep(0.01)
        assert pool.idle == [] and pool.open_count == 0
        fresh = await pool.acquire()
        assert fresh is not conn and server.accepted == 2

    run(scenario)


def test_bytes_arriving_on_an_idle_connection_close_it_and_free_its_slot():
    async def scenario(server, port):
        pool = pool_for(port)
        conn = await pool.acquire()
        pool.release(conn, reusable=True)
        server.transports[0].write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nleak")  # nobody asked
        for _ in range(100):
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        # Out of the pool at once (not left for the next acquire to skip), its slot free for a fresh one.
        assert conn.closed and pool.idle == [] and pool.open_count == 0
        fresh = await pool.acquire()
        assert fresh is not conn and server.accepted == 2

    run(scenario)


def test_bytes_arriving_before_a_handed_over_connection_is_used_make_its_request_fail_as_a_reset():
    async def scenario(server, port):
        pool = pool_for(port)
        first = await pool.acquire()
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        pool.release(first, reusable=True)  # handed to the waiter, which has not run yet ...
        first.data_received(b"HTTP/1.1 200 OK\r\n")  # ... when unasked bytes arrive
        handed = await waiter
        assert handed is first and handed.closed and pool.open_count == 0

        class Sink:
            failure = None

            def upstream_failed(self, failure, detail):
                self.failure = failure

        sink = Sink()
        handed.send_request(sink, b"POST", b"/", b"up", [], b"")
        assert sink.failure == Failure.RESET  # retried on a fresh connection by the proxy, never answered
        assert pool.open_count == 0  # the slot was returned once, not twice

    run(scenario)


def test_try_acquire_only_returns_live_idle_connections():
    async def scenario(server, port):
        pool = pool_for(port, max_connections=2)
        assert pool.try_acquire() is None
        conn = await pool.acquire()
        pool.release(conn, reusable=True)
        assert pool.try_acquire() is conn and conn.reused

    run(scenario)


# -- fair slots (docs/configuration.md#tenants): interactive before batch, tenants in turn, bounded ---


async def _queue(pool: UpstreamPool, waiters: list[tuple[str, str, bool]]) -> dict[str, asyncio.Task]:
    """Start one waiter per (name, tenant, batch), in that order, each queued before the next starts."""
    tasks = {}
    for name, tenant, batch in waiters:
        tasks[name] = asyncio.ensure_future(pool.acquire(tenant=tenant, batch=batch))
        await asyncio.sleep(0)  # let it reach the queue
    await asyncio.sleep(0.01)
    assert not any(task.done() for task in tasks.values())
    return tasks


async def _serve_in_turn(pool: UpstreamPool, first, tasks: dict[str, asyncio.Task], reusable: bool) -> list[str]:
    """Free the held connection (or its slot) again and again; the order in which the waiters got it."""
    order: list[str] = []
    held = first
    while len(order) < len(tasks):
        pool.release(held, reusable=reusable)
        done, _ = await asyncio.wait([t for t in tasks.values() if not t.done()], return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        (task,) = done
        order.append(next(name for name, candidate in tasks.items() if candidate is task))
        held = task.result()
    pool.release(held, reusable=True)
    return order


def test_a_released_connection_goes_to_interactive_waiters_before_earlier_batch_ones():
    async def scenario(server, port):
        pool = pool_for(port)
        first = await pool.acquire()
        tasks = await _queue(pool, [("bulk-1", "bulk", True), ("bulk-2", "bulk", True), ("app-1", "app", False),
                                    ("other-1", "other", True), ("app-2", "app", False)])
        order = await _serve_in_turn(pool, first, tasks, reusable=True)
        assert order == ["app-1", "app-2", "bulk-1", "other-1", "bulk-2"]
        assert server.accepted == 1 and pool.open_count == 1 and pool.idle == [first]

    run(scenario)


def test_freed_slots_go_to_the_tenants_of_a_class_in_turn():
    async def scenario(server, port):
        pool = pool_for(port)
        first = await pool.acquire()
        burst = [(f"a-{index}", "a", True) for index in range(4)]
        tasks = await _queue(pool, [*burst, ("b-0", "b", True), ("c-0", "c", True)])
        order = await _serve_in_turn(pool, first, tasks, reusable=False)  # each waiter opens its own connection
        assert order == ["a-0", "b-0", "c-0", "a-1", "a-2", "a-3"]
        assert server.accepted == 7 and pool.open_count == 1

    run(scenario)


def test_waiters_past_the_cap_are_turned_away_at_once_and_a_waiter_that_gives_up_frees_its_place():
    async def scenario(server, port):
        pool = pool_for(port, wait_timeout=5.0, max_waiters=2)
        first = await pool.acquire()
        tasks = await _queue(pool, [("a", "t", False), ("b", "t", True)])
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(PoolExhausted):
            await pool.acquire(tenant="u")
        assert loop.time() - started < 1.0  # not after wait_timeout
        tasks["a"].cancel()  # a client leaves: its place is free again
        await asyncio.sleep(0.01)
        third = asyncio.ensure_future(pool.acquire(tenant="u"))
        await asyncio.sleep(0.01)
        assert not third.done()
        pool.release(first, reusable=True)
        assert await third is first  # interactive "u" before batch "b"
        pool.release(first, reusable=True)
        assert await tasks["b"] is first
        pool.release(first, reusable=True)
        assert pool.idle == [first] and pool.open_count == 1

    run(scenario)


def test_timed_out_waiters_leave_the_queue():
    async def scenario(server, port):
        pool = pool_for(port, wait_timeout=0.02, max_waiters=1)
        first = await pool.acquire()
        for _ in range(3):  # each one would be turned away at once if an earlier one still held the place
            with pytest.raises(PoolExhausted) as refused:
                await pool.acquire(tenant="t")
            assert str(refused.value) == "all 1 connections busy"  # waited, then gave up
        pool.release(first, reusable=True)
        assert pool.idle == [first] and pool.open_count == 1

    run(scenario)


def test_a_connection_handed_to_an_interactive_waiter_that_leaves_goes_to_the_next_waiter():
    async def scenario(server, port):
        pool = pool_for(port, wait_timeout=5.0)
        first = await pool.acquire()
        tasks = await _queue(pool, [("bulk", "bulk", True), ("app", "app", False)])
        pool.release(first, reusable=True)  # resolves the interactive waiter's future ...
        tasks["app"].cancel()  # ... which leaves before it could run
        try:
            owner = await tasks["app"]  # Python 3.11's wait_for hands it over despite the cancel
        except asyncio.CancelledError:
            owner = None
        if owner is not None:
            pool.release(owner, reusable=True)
        assert await tasks["bulk"] is first and pool.idle == [] and pool.open_count == 1
        pool.release(first, reusable=True)
        assert pool.idle == [first]

    run(scenario)
