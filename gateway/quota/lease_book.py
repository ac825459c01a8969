"""The worker-held blocks of one worker (``quota.lease``): which (rule, tenant) holds which block, and
their life: asked for, granted, taken from, renewed, expired, returned. The arithmetic of one block is
``lease.py``; why blocks exist, and what they trade, is said there.

- **Ask**: after an exact admit that left the budget ``headroom`` blocks of room, a block of the pair is
  asked for, unless one is open or asked for already. The ask is an admit of the block's size in the same
  tick's batch (``AdmitBatcher.submit_detached``): to the ledger a block is one reservation.
- **Grant**: the block opens for ``ttl`` (never past the end of the rule's first window: its reservation
  counts in this window) and is kept alive like a request's reservation (``keeper.py``).
- **Take**: a request of the pair that fits is admitted from the block in memory, with no await.
- **Renew**: shortly before a used block expires its successor is asked for, so steady traffic never
  waits on a round trip between blocks; an idle pair lets its block expire and holds nothing.
- **Return**: a block that is closed (expired, full, replaced) and has no request in flight is settled
  with what its requests were charged; the unused part goes back to the budget.

Keys are (rule name, tenant) today; the next limits (request slots per key, nano-USD) add allowances to a
block (``lease.Allowance``) rather than new books.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from gateway.ids import CounterIds
from gateway.quota.admission import Admission
from gateway.quota.batcher import AdmitBatcher
from gateway.quota.breaker import Breaker
from gateway.quota.counters import QuotaCounters
from gateway.quota.keeper import ReservationKeeper
from gateway.quota.lease import Allowance, Lease, LeaseReservation, LeaseSpec, leasable, ms_to_window_end
from gateway.quota.ledger import ADMITTED, Account, AdmitCommand, QuotaLedger
from gateway.quota.reconcile import Reconciler
from gateway.quota.transport import Reply

_monotonic = time.monotonic

LeaseKey = tuple[str, str]  # (rule name, tenant)

# A block's successor is asked for this long before the block expires (at most a quarter of its life).
RENEW_LEAD_S = 0.1


class LeaseBook:
    __slots__ = ("spec", "open", "_asked", "_held", "_ledger", "_batcher", "_breaker", "_keeper", "_reconciler",
                 "_counters", "_ids", "_closing")

    def __init__(self, spec: LeaseSpec, ledger: QuotaLedger, batcher: AdmitBatcher, breaker: Breaker,
                 keeper: ReservationKeeper, reconciler: Reconciler, counters: QuotaCounters, ids: CounterIds) -> None:
        self.spec = spec
        self.open: dict[LeaseKey, Lease] = {}  # the open block of each pair (read by the gate: empty = no take)
        self._asked: set[LeaseKey] = set()  # blocks asked for, not granted yet
        self._held: set[Lease] = set()  # every block not settled yet (open, or closed with requests)
        self._ledger = ledger
        self._batcher = batcher
        self._breaker = breaker
        self._keeper = keeper
        self._reconciler = reconciler
        self._counters = counters
        self._ids = ids
        self._closing = False

    # -- request path

    def take(self, account: Account, tenant_slot: int, estimate: int) -> Admission | None:
        """The request's Admission from the pair's open block, or None (no block, or it does not fit: the
        request goes to the ledger; a block with no room left is closed, and its successor asked for)."""
        key = (account.rule.name, account.tenant)
        lease = self.open.get(key)
        if lease is None:
            return None
        headers = lease.take(estimate, _monotonic())
        if headers is not None:
            counters = self._counters
            counters.admitted += 1
            counters.leased += 1
            counters.tokens_estimated += estimate
            return Admission(True, "admitted", None, headers, None, estimate, lease.tenant_slot, None, lease, True)
        if lease.closed:
            del self.open[key]  # its requests still end and settle into it
            if lease.in_flight == 0:
                self._return(lease)
            self.want(account, tenant_slot, lease.tokens.remaining)
        return None

    def want(self, account: Account, tenant_slot: int, room: int, renewing: bool = False) -> None:
        """Ask for a block of the pair if the rule may lease, the budget has the headroom, the backend is
        not known down, and no block of the pair is asked for, nor open (unless ``renewing``: the open
        one is about to expire)."""
        spec = self.spec
        if not spec.wanted(room) or not leasable(account.rule) or self._breaker.is_open or self._closing:
            return
        key = (account.rule.name, account.tenant)
        if (key in self.open and not renewing) or key in self._asked:
            return
        self._asked.add(key)
        command = self._ledger.admit_command(account, spec.tokens, self._ids.next())
        self._batcher.submit_detached(command, partial(self._granted, tenant_slot))

    def end(self, lease: Lease, estimate: int, actual_tokens: int | None) -> None:
        """A request admitted from ``lease`` ended: count its charge into the block (settled with it)."""
        charged = estimate if actual_tokens is None else actual_tokens if actual_tokens > 0 else 0
        self._counters.count_settled(estimate, charged)
        if lease.end(estimate, charged):
            self._return(lease)

    def close(self) -> None:
        """Settle every block now; requests still in flight are charged at their estimate."""
        self._closing = True
        self.open.clear()
        for lease in list(self._held):
            lease.close()
            self._return(lease)

    # -- a block's life

    def _granted(self, tenant_slot: int, command: AdmitCommand, reply: Reply | BaseException) -> None:
        account = command.account
        key = (account.rule.name, account.tenant)
        self._asked.discard(key)
        if reply.__class__ is not bytes:
            return  # the batch failed: counted there; requests go to the ledger one by one
        decision = QuotaLedger.decision(command, reply)  # type: ignore[arg-type]
        reservation = decision.reservation
        if decision.verdict != ADMITTED or reservation is None:
            return  # no room for a block: requests go to the ledger one by one
        block = LeaseReservation(reservation.zkey, reservation.prefix, reservation.member, reservation.estimate)
        if self._closing:  # granted while the gate shuts down: give it straight back
            self._reconciler.enqueue(block, 0)
            return
        spec = self.spec
        now = _monotonic()
        window_end_s = ms_to_window_end(account.rule, decision.now_ms) / 1000
        life_s = min(spec.ttl_s, window_end_s)
        tokens = Allowance(spec.tokens, decision.limit, decision.remaining, now + decision.reset_ms / 1000)
        lease = Lease(block, tokens, now + life_s, tenant_slot)
        replaced = self.open.get(key)
        self.open[key] = lease
        self._held.add(lease)
        self._keeper.add(block)
        self._counters.leases_granted += 1
        if replaced is not None and replaced.close():  # renewed: the old block takes no more requests
            self._return(replaced)
        loop = asyncio.get_running_loop()
        loop.call_later(life_s, self._expired, key, lease)
        if spec.ttl_s < window_end_s:
            # The next block is asked for shortly before this one expires. Not across a window's end: a
            # block reserved now would count in the window that is ending.
            loop.call_later(max(0.0, life_s - min(life_s / 4, RENEW_LEAD_S)), self._renew, account, key, lease)

    def _renew(self, account: Account, key: LeaseKey, lease: Lease) -> None:
        """Ask for the successor of a block that is still open and was used."""
        if self.open.get(key) is lease and not lease.closed and lease.tokens.committed:
            self.want(account, lease.tenant_slot, lease.tokens.remaining, renewing=True)

    def _expired(self, key: LeaseKey, lease: Lease) -> None:
        if self.open.get(key) is lease:
            del self.open[key]
            if lease.close():
                self._return(lease)

    def _return(self, lease: Lease) -> None:
        """Settle a block with what its requests were charged (once: the block leaves ``_held``)."""
        if lease in self._held:
            self._held.discard(lease)
            self._keeper.discard(lease.reservation)
            self._reconciler.enqueue(lease.reservation, lease.tokens.committed)
