"""The reconciler's life around its stop (gateway/quota/reconcile.py)."""

from __future__ import annotations

import asyncio

from gateway.quota.counters import QuotaCounters
from gateway.quota.ledger import QuotaLedger, Reservation
from gateway.quota.reconcile import Reconciler
from gateway.valkey.resp_transport import RespTransport


def test_a_settlement_handed_over_after_the_stop_is_kept_and_raises_nothing() -> None:
    # A grant or a late request can end after the gate closed: handing its settlement over must not raise
    # out of the caller (a batch's resolution loop would stop half way, leaving requests unanswered).
    async def scenario() -> None:
        ledger = QuotaLedger(RespTransport(), reservation_timeout_s=1)  # idle: nothing is ever sent
        reconciler = Reconciler(ledger, QuotaCounters(), timeout_s=0.25)
        reconciler.start()
        await asyncio.sleep(0)  # the drainer waits for work
        await reconciler.stop(drain_timeout_s=1)
        reconciler.enqueue(Reservation(b"z", b"p", b"m", 5), 0)
        assert reconciler.backlog == 1  # left to expire at its estimate, as the docstring says

    asyncio.run(scenario())
