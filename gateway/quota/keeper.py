"""Keeping the reservations of running requests alive, off the request path.

A reservation carries a deadline (admission + ``quota.reservation_timeout``); past it the ledger takes
the reservation for lost: charged at its estimate, and no longer counted toward ``max_in_flight``.
That is right for a request the gateway lost track of, wrong for one still streaming: it would be
charged its estimate instead of its usage, and its tenant could open more concurrent requests than
its cap. So each worker keeps its live reservations here and, once per ``period`` (a quarter of the
timeout), extends in one pipelined round trip every one that was already live at the previous pass.

Two generations, so the request path pays one dict insert at admission and one pop at settlement, and
no clock: ``young`` holds what was reserved since the last pass, ``old`` everything before. A pass
extends ``old``, then ``young`` becomes old. A reservation is first extended between one and two
periods after it was made (at most half its timeout), so even a pass that fails leaves the next one
time before the deadline. Worker-held blocks (``quota.lease``) are kept alive the same way while they
are held: a block whose reservation expired would be charged in full, whatever its requests used.

What is not kept: a reservation whose settlement was handed to the reconciler (dropped or not, it
then expires as it should), and every reservation of a worker that died (the supervisor sweeps them).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.quota.breaker import Breaker
from gateway.quota.counters import QuotaCounters
from gateway.quota.ledger import QuotaLedger, Reservation
from gateway.valkey.client import BACKEND_ERRORS, describe_error

log = logging.getLogger("gridgate.quota")

MIN_PERIOD_S = 0.05  # a tiny reservation_timeout must not turn the pass into a busy loop


class ReservationKeeper:
    __slots__ = ("_ledger", "_counters", "_breaker", "_timeout_s", "period_s", "_young", "_old", "_timer",
                 "_task", "_loop")

    def __init__(self, ledger: QuotaLedger, counters: QuotaCounters, breaker: Breaker, *, call_timeout_s: float) -> None:
        self._ledger = ledger
        self._counters = counters
        self._breaker = breaker
        self._timeout_s = max(call_timeout_s * 4, 1.0)
        self.period_s = max(ledger.reservation_timeout_s / 4, MIN_PERIOD_S)
        self._young: dict[bytes, Reservation] = {}  # member -> reservation, reserved since the last pass
        self._old: dict[bytes, Reservation] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(self.period_s, self._pass)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    # -- request path: one dict operation each

    def add(self, reservation: Reservation) -> None:
        """A reservation was made: keep it alive until ``discard``."""
        self._young[reservation.member] = reservation

    def discard(self, reservation: Reservation) -> None:
        """Its request ended (the settlement is on its way): stop extending it."""
        if self._young.pop(reservation.member, None) is None:
            self._old.pop(reservation.member, None)

    # -- the periodic pass

    def _pass(self) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(self.period_s, self._pass)
        due = list(self._old.values())
        if self._young:
            self._old.update(self._young)
            self._young = {}
        if not due or self._breaker.is_open:
            return  # nothing old enough, or the backend is known down (a pass after it answers again)
        if self._task is not None and not self._task.done():
            return  # the previous pass is still waiting on the backend
        self._task = self._loop.create_task(self._extend(due))

    async def _extend(self, due: list[Reservation]) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                extended = await self._ledger.extend_many(due)
        except BACKEND_ERRORS as exc:
            self._counters.backend_errors += 1
            log.debug("quota: extending %d reservations failed: %s", len(due), describe_error(exc))
            return
        except Exception:  # never let one bad pass go unnoticed; the next pass tries again
            log.exception("quota: extending %d reservations failed", len(due))
            return
        self._counters.reservations_extended += extended
