"""A quota backend that answers what the ledger cannot have written is a backend error under
``quota.on_backend_error``: never a crash, never a 500, never a request left waiting (docs/limits.md)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from gateway.identity.limits import Budget, RequestLimit
from gateway.quota.admission import Admission
from gateway.quota.gate import QuotaGate
from gateway.quota.ledger import QuotaLedger
from gateway.quota.ledger_script import LEDGER_SHA
from gateway.quota.rules import QuotaRule
from gateway.valkey.client import create_client
from tests.harness import candidate, chat, envelope, mock_served

# What the fake server answers to an EVALSHA (the ledger's every call), by name.
GARBAGE = {
    "bulk": b"$7\r\ngarbage\r\n",
    "integer": b":7\r\n",
    "array": b"*2\r\n:1\r\n:2\r\n",
    "nil": b"$-1\r\n",
    "plausible": b"$5\r\n1 2 3\r\n",  # the start of an admit's reply, too short
    "refused by no limit": b"$23\r\n0 1 0 9 1000 0 0 0 0 0 0 -\r\n",  # refused by limit 9 of 2
    "noise": b"hello, this is not RESP\r\n",  # a protocol error: the connection is dropped
}


def _answer(command: list[bytes], evalsha: bytes, sha: bytes) -> bytes:
    name = command[0].upper() if command else b""
    if name == b"EVALSHA":
        return evalsha
    if name == b"SCRIPT" and command[1].upper() == b"LOAD":
        return b"$%d\r\n%s\r\n" % (len(sha), sha)
    if name == b"PING":
        return b"+PONG\r\n"
    return b"+OK\r\n"


def _commands(buffer: bytearray) -> Iterator[list[bytes]]:
    """Whole RESP commands (arrays of bulk strings) at the front of ``buffer``, consumed as read."""
    while buffer.startswith(b"*"):
        try:
            end = buffer.index(b"\r\n")
            count, pos, args = int(buffer[1:end]), end + 2, []
            for _ in range(count):
                end = buffer.index(b"\r\n", pos)
                size = int(buffer[pos + 1:end])
                if len(buffer) < end + 2 + size + 2:
                    return
                args.append(bytes(buffer[end + 2:end + 2 + size]))
                pos = end + 2 + size + 2
        except ValueError:
            return
        del buffer[:pos]
        yield args


@contextlib.asynccontextmanager
async def fake_valkey(evalsha: bytes, sha: bytes = LEDGER_SHA.encode()) -> AsyncIterator[str]:
    """A server on loopback that speaks enough RESP to be connected to, and answers every ledger call
    with ``evalsha``. Yields its URL."""

    handlers: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        buffer = bytearray()
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                buffer += data
                for command in _commands(buffer):
                    writer.write(_answer(command, evalsha, sha))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"valkey://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


RULES = [QuotaRule("r", (Budget(60, 1000),), 10, requests=(RequestLimit(60, 100, 100),))]


@pytest.mark.parametrize("policy", ["reject", "allow"])
@pytest.mark.parametrize("garbage", list(GARBAGE))
def test_an_unexpected_reply_is_answered_by_the_backend_error_policy(garbage: str, policy: str) -> None:
    async def scenario() -> None:
        async with fake_valkey(GARBAGE[garbage]) as url:
            gate = QuotaGate(QuotaLedger(create_client(url), reservation_timeout_s=10), RULES,
                             on_backend_error=policy)  # type: ignore[arg-type]
            await gate.start()
            try:
                for _ in range(5):  # past the breaker's three failures too
                    admission = gate.admission("t", "m", 100, 10)
                    assert admission is not None
                    if admission.__class__ is not Admission:
                        admission = await asyncio.wait_for(admission, 2)  # type: ignore[arg-type]
                    assert admission.reason == f"backend_error_{'rejected' if policy == 'reject' else 'allowed'}"
                    assert admission.status == (503 if policy == "reject" else None)
                assert gate.counters.backend_errors >= 1 and gate.breaker.is_open
                with contextlib.suppress(Exception):
                    await gate.quota_report("t")  # the admin page: unavailable, never a crash
            finally:
                await gate.close()

    asyncio.run(scenario())


def test_a_server_that_names_another_script_is_a_backend_down_at_start() -> None:
    async def scenario() -> None:
        async with fake_valkey(GARBAGE["bulk"], sha=b"0" * 40) as url:
            gate = QuotaGate(QuotaLedger(create_client(url), reservation_timeout_s=10), RULES)
            await gate.start()  # raises nothing: the breaker opens
            try:
                assert gate.breaker.is_open
                admission = gate.admission("t", "m", 100, 10)
                assert admission.__class__ is Admission and admission.status == 503  # type: ignore[union-attr]
            finally:
                await gate.close()

    asyncio.run(scenario())


@contextlib.contextmanager
def fake_valkey_thread(evalsha: bytes) -> Iterator[str]:
    """``fake_valkey`` on a loop of its own thread, for a gateway process to reach."""
    loop = asyncio.new_event_loop()
    ready: list[str] = []
    stop = threading.Event()

    async def run() -> None:
        async with fake_valkey(evalsha) as url:
            ready.append(url)
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    while not ready:
        threading.Event().wait(0.01)
    try:
        yield ready[0]
    finally:
        stop.set()
        thread.join(5)
        loop.close()


@pytest.mark.parametrize(("policy", "status"), [("reject", 503), ("allow", 200)])
def test_a_gateway_whose_valkey_answers_garbage_answers_by_its_policy_never_500(
        mock_provider: Callable, gateway_factory: Callable, policy: str, status: int) -> None:
    handle = mock_provider("p")
    with fake_valkey_thread(GARBAGE["plausible"]) as url:
        quota = {"backend": {"kind": "valkey", "url": url}, "on_backend_error": policy,
                 "rules": [{"name": "r", "requests": [{"window": "1m", "count": 100}],
                            "budgets": [{"window": "1m", "tokens": 100000}]}]}
        gateway = gateway_factory({"p": [handle.address]}, envelope([candidate("m", "p")]), extra={"quota": quota})
        served = mock_served(handle)
        answers = [chat(gateway.port, "m") for _ in range(6)]
        assert [a.status for a in answers] == [status] * 6
        if policy == "reject":
            assert answers[0].json()["error"]["code"] == "quota_unavailable"
            assert mock_served(handle) == served  # nothing reached the provider
