"""``KidWaits`` (workers/kid_wait.py): one shared wait per issuer and kid, ended by a new key set or by
its bound, and bounded in kids and waiters (past them: no wait, the 401 at once)."""

from __future__ import annotations

import asyncio
import time

from workers import kid_wait
from workers.kid_wait import KidWaits


def test_requests_naming_one_kid_share_one_wait_ended_by_the_issuers_new_key_set():
    async def scenario() -> None:
        waits = KidWaits({"corp": 5.0, "other": 5.0, "off": 0.0})
        first, second = waits.wait_for("corp", "k2"), waits.wait_for("corp", "k2")
        assert first is not None and first is second and len(waits) == 1
        elsewhere = waits.wait_for("other", "k2")
        assert elsewhere is not first
        assert waits.wait_for("off", "k2") is None and waits.wait_for(None, "k2") is None
        waits.keys_changed("corp")
        assert first.done() and not elsewhere.done() and len(waits) == 1
        assert waits.wait_for("corp", "k2") is not first  # a later request waits for the next set

    asyncio.run(scenario())


def test_a_wait_ends_at_its_bound_and_the_bounds_refuse_more_waits(monkeypatch):
    monkeypatch.setattr(kid_wait, "MAX_KIDS", 2)
    monkeypatch.setattr(kid_wait, "MAX_WAITERS", 3)

    async def scenario() -> None:
        waits = KidWaits({"corp": 0.05})
        started = time.monotonic()
        until = waits.wait_for("corp", "a")
        assert until is not None
        assert [waits.wait_for("corp", "a") is until for _ in range(2)] == [True, True]
        assert waits.wait_for("corp", "a") is None  # a fourth waiter on one kid: no wait
        assert waits.wait_for("corp", "b") is not None
        assert waits.wait_for("corp", "c") is None  # a third kid at once: no wait
        await until
        assert 0.04 <= time.monotonic() - started < 1.0
        await asyncio.sleep(0.1)
        assert len(waits) == 0

    asyncio.run(scenario())
