"""The upstream pool on real loopback sockets: slots, waiter hand-over, idle eviction."""

from __future__ import annotations

import asyncio

import pytest

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


def test_try_acquire_only_returns_live_idle_connections():
    async def scenario(server, port):
        pool = pool_for(port, max_connections=2)
        assert pool.try_acquire() is None
        conn = await pool.acquire()
        pool.release(conn, reusable=True)
        assert pool.try_acquire() is conn and conn.reused

    run(scenario)
