"""The worker-held blocks of one worker (``quota.lease``): which (rule, tenant) holds which block, and
their life: asked for, granted, taken from, renewed, expired, returned. The arithmetic of one block is
``lease.py``; why blocks exist, and what they trade, is said there.

- **Ask**: after an exact admit that left every limit ``headroom`` blocks of room, a block of the
  (tenant, rule, key) is asked for, unless one is open or asked for already. The ask is an admit of the
  block's size (``slots`` requests, ``tokens`` tokens) in the same tick's batch
  (``AdmitBatcher.submit_detached``): to the ledger a block is one reservation.
- **Grant**: the block opens for ``ttl`` (never past the end of a token window of its limits: its
  reservation counts in this window) and is kept alive like a request's reservation (``keeper.py``).
- **Take**: a request that fits is admitted from the block in memory, with no await.
- **Renew**: shortly before a used block expires its successor is asked for, so steady traffic never
  waits on a round trip between blocks; an idle (tenant, rule, key) lets its block expire and holds nothing.
  A block whose successor is still on its way when it expires (a slow or busy Valkey) keeps admitting
  until the successor is granted or refused, for at most ``RENEW_GRACE_S`` (and a ``ttl``) more, never past
  its window's end: otherwise every request of a busy key would go to Valkey one by one at the moment
  Valkey is slow. What it admits was reserved when it was granted, so no limit is exceeded.
- **Return**: a block that is closed (expired, full, replaced) and has no request in flight is settled
  with what its requests were charged, and the slots they did not use go back.

The last block of each (tenant, rule, key) is remembered: the next one is sized from what it used
(``lease.next_sizes``).
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from gateway.ids import CounterIds
from gateway.quota.batcher import AdmitBatcher
from gateway.quota.breaker import Breaker
from gateway.quota.counters import QuotaCounters
from gateway.quota.keeper import ReservationKeeper
from gateway.quota.lease import (
    MIN_BLOCK_REQUESTS,
    Allowance,
    Lease,
    LeaseReservation,
    LeaseSpec,
    SpendAllowance,
    fit,
    ms_to_window_end,
    next_sizes,
    next_spend,
    request_allowance,
)
from gateway.quota.ledger import (
    F_RQ_LIMIT,
    F_SPEND_ROOM,
    F_TK_LIMIT,
    Account,
    AdmitCommand,
    AdmitReply,
    QuotaLedger,
)
from gateway.quota.reconcile import Reconciler
from gateway.valkey.transport import Reply

# The longest a managed key's block lives (CONTRACT: a block may admit a key revoked meanwhile for at most
# its ttl, <= 1 s, when the host's key table lags; the block's successor is asked for with the deny set).
MANAGED_BLOCK_TTL_S = 1.0
_monotonic = time.monotonic
_time = time.time

LeaseKey = tuple[str, str, str]  # (tenant, rule, key): ``Account.lease_key``

# A block's successor is asked for this long before the block expires (at most a quarter of its life).
RENEW_LEAD_S = 0.1
# A block whose successor has not arrived when it expires admits this much longer at most (nor more than
# its own life, nor past its window's end) while the successor's admit is under way.
RENEW_GRACE_S = 1.0


class LeaseBook:
    __slots__ = ("spec", "open", "_asked", "_held", "_last", "_graced", "_ledger", "_batcher", "_breaker",
                 "_keeper", "_reconciler", "_counters", "_ids", "_closing")

    def __init__(self, spec: LeaseSpec, ledger: QuotaLedger, batcher: AdmitBatcher, breaker: Breaker,
                 keeper: ReservationKeeper, reconciler: Reconciler, counters: QuotaCounters, ids: CounterIds) -> None:
        self.spec = spec
        self.open: dict[LeaseKey, Lease] = {}  # the open block of each key (read by the gate: empty = no take)
        self._asked: set[LeaseKey] = set()  # blocks asked for, not granted yet
        self._held: set[Lease] = set()  # every block not settled yet (open, or closed with requests)
        self._last: dict[LeaseKey, Lease] = {}  # the latest block of each key: the next one's size
        # The blocks whose successor is on its way, with the end of their own life: each may admit past it.
        self._graced: dict[LeaseKey, tuple[Lease, float]] = {}
        self._ledger = ledger
        self._batcher = batcher
        self._breaker = breaker
        self._keeper = keeper
        self._reconciler = reconciler
        self._counters = counters
        self._ids = ids
        self._closing = False

    # -- request path

    def missed(self, account: Account, tenant_slot: int, estimate: int, worst: int, lease: Lease) -> None:
        """The open block ``lease`` did not take a request (``Lease.take`` said None; the gate admits from
        a block itself): a block that closed leaves ``open`` (its requests still end and settle into it),
        and its successor is asked for. ``worst``: the request's worst-case cost in nano-USD."""
        if lease.closed:
            del self.open[account.lease_key]
            if lease.in_flight == 0:
                self.settle(lease)
            self.want(account, tenant_slot, estimate,
                      lease.tokens.remaining if lease.tokens is not None else 0,
                      lease.slots.remaining if lease.slots is not None else 0, worst=worst,
                      spend_room=lease.spend.remaining if lease.spend is not None else -1)

    def want(self, account: Account, tenant_slot: int, estimate: int, tokens_room: int, slots_room: int,
             renewing: bool = False, worst: int = 0, spend_room: int = -1) -> None:
        """Ask for a block of the account if it may lease, every limit has the headroom, the backend is
        not known down, and no block of it is asked for, nor open (unless ``renewing``: the open one is
        about to expire). ``tokens_room``/``slots_room``/``spend_room``: what the tightest limit of each
        kind has left (nano-USD for the hard USD budgets); ``worst``: a request's worst case."""
        if not account.leasable or self._breaker.is_open or self._closing:
            return
        key = account.lease_key
        if (key in self.open and not renewing) or key in self._asked:
            return
        spec = self.spec
        previous, now = self._last.get(key), _monotonic()
        tokens, slots = next_sizes(spec, previous, estimate, now)
        if account.has_budgets:
            tokens = fit(tokens, tokens_room, spec.headroom, MIN_BLOCK_REQUESTS * max(1, estimate),
                         spec.tokens is not None)
            if not tokens:
                return
        else:
            tokens = 0
        if account.has_requests:
            slots = fit(slots, slots_room, spec.headroom, MIN_BLOCK_REQUESTS, spec.requests is not None)
            if not slots:
                return
        nusd = 0
        if account.spend:
            nusd = next_spend(previous, worst, now)
            if account.has_hard_spend:
                nusd = fit(nusd, spend_room, spec.headroom, MIN_BLOCK_REQUESTS * max(1, worst), False)
                if not nusd:
                    return
        self._asked.add(key)
        command = self._ledger.admit_command(account, tokens, self._ids.next(), slots, nusd)
        self._batcher.submit_detached(command, partial(self._granted, tenant_slot))

    def close(self) -> None:
        """Settle every block now; requests still in flight are charged at their estimate."""
        self._closing = True
        self.open.clear()
        for lease in list(self._held):
            lease.close()
            self.settle(lease)

    # -- a block's life

    def _granted(self, tenant_slot: int, command: AdmitCommand, reply: Reply | BaseException) -> None:
        account = command.account
        key = account.lease_key
        self._asked.discard(key)
        graced = self._graced.pop(key, None)
        if reply.__class__ is not bytes:
            self._no_successor(key, graced)
            return  # the batch failed: counted there; requests go to the ledger one by one
        try:
            answer = QuotaLedger.read(command, reply)  # type: ignore[arg-type]
        except ValueError:
            self._no_successor(key, graced)
            self._breaker.failed("an admit reply the ledger cannot have written")
            return
        reservation = answer.reservation
        if reservation is None:
            self._no_successor(key, graced)
            return  # no room for a block: requests go to the ledger one by one
        block = LeaseReservation(reservation.zkey, reservation.prefix, reservation.member, reservation.estimate,
                                 reservation.slots, reservation.worst, reservation.spend)
        if self._closing:  # granted while the gate shuts down: give it straight back
            self._reconciler.enqueue(block, 0, block.slots, 0)
            return
        spec = self.spec
        now = _monotonic()
        window_end_s = _to_window_end_s(account, answer, spec.ttl_s)
        life_s = min(spec.ttl_s, window_end_s, MANAGED_BLOCK_TTL_S if account.managed else window_end_s)
        tokens, slots, spend = _allowances(command, answer, now)
        lease = Lease(block, tokens, now + life_s, tenant_slot, slots, spend, opened_at=now)
        replaced = self.open.get(key)
        self.open[key] = self._last[key] = lease
        self._held.add(lease)
        self._keeper.add(block)
        self._counters.leases_granted += 1
        if replaced is not None and replaced.close():  # renewed: the old block takes no more requests
            self.settle(replaced)
        loop = asyncio.get_running_loop()
        if spec.ttl_s < window_end_s:
            # The next block is asked for shortly before this one expires. Not across a window's end: a
            # block reserved now would count in the window that is ending (nor does its grace reach it).
            # No grace for a managed key: a revoked one is admitted from blocks for at most one block's life.
            grace_until = now + (life_s if account.managed else min(window_end_s, life_s + min(life_s, RENEW_GRACE_S)))
            loop.call_later(max(0.0, life_s - min(life_s / 4, RENEW_LEAD_S)), self._renew, account, key, lease,
                            grace_until)
        loop.call_later(life_s, self._expired, key, lease)

    def _renew(self, account: Account, key: LeaseKey, lease: Lease, grace_until: float) -> None:
        """Ask for the successor of a block that is still open and was used; while it is on its way the
        block may admit until ``grace_until`` (monotonic), past its own life."""
        if self.open.get(key) is lease and not lease.closed and lease.taken:
            tokens, slots, spend = lease.tokens, lease.slots, lease.spend
            self.want(account, lease.tenant_slot, lease.last_estimate, tokens.remaining if tokens is not None else 0,
                      slots.remaining if slots is not None else 0, renewing=True, worst=lease.last_worst,
                      spend_room=spend.remaining if spend is not None else -1)
            if key in self._asked:
                self._graced[key] = (lease, lease.closes_at)
                lease.closes_at = grace_until

    def _expired(self, key: LeaseKey, lease: Lease) -> None:
        """The block's life (or its grace: ``_renew``) is over: it closes, unless it is in its grace."""
        if self.open.get(key) is not lease:
            return
        now = _monotonic()
        graced = self._graced.get(key)
        if graced is not None and graced[0] is lease:
            if now < lease.closes_at:
                asyncio.get_running_loop().call_later(lease.closes_at - now, self._expired, key, lease)
                return
            del self._graced[key]  # its grace ran out: the successor's answer finds nothing left to end
        del self.open[key]
        if lease.close():
            self.settle(lease)

    def _no_successor(self, key: LeaseKey, graced: tuple[Lease, float] | None) -> None:
        """The successor of a block did not come (refused, or the call failed): the block's grace ends,
        so it closes at the end of its own life (now, if that has passed)."""
        if graced is not None:
            lease, life_end = graced
            lease.closes_at = life_end
            if _monotonic() >= life_end:
                self._expired(key, lease)

    def settle(self, lease: Lease) -> None:
        """Settle a block with what its requests were charged and the slots they did not use (once: the
        block leaves ``_held``)."""
        if lease in self._held:
            self._held.discard(lease)
            self._keeper.discard(lease.reservation)
            self._reconciler.enqueue(lease.reservation, lease.tokens_charged, lease.slots_unused, lease.spend_charged)


def _to_window_end_s(account: Account, answer: AdmitReply, ttl_s: float) -> float:
    """Seconds until a granted block must stop admitting: its token windows' first end (past ``ttl_s``
    when it has none), nor past the end of a USD budget's period (it reserved in this one)."""
    to_window_end = ms_to_window_end(account, answer.now_ms)
    window_end_s = ttl_s + 1 if to_window_end is None else to_window_end / 1000
    if account.spend:
        window_end_s = min(window_end_s, max(0.0, account.spend_until - _time()))
    return window_end_s


def _allowances(command: AdmitCommand, answer: AdmitReply,
                now: float) -> tuple[Allowance | None, Allowance | None, SpendAllowance | None]:
    """(tokens, request slots, nano-USD) a granted block holds, each None when its account has no such limit."""
    account = command.account
    tokens = slots = spend = None
    if account.has_budgets:
        limit, remaining, reset_ms = answer.triple(F_TK_LIMIT)
        tokens = Allowance(command.estimate, limit, remaining, now + reset_ms / 1000)
    if account.has_requests:
        limit, remaining, reset_ms = answer.triple(F_RQ_LIMIT)
        slots = request_allowance(command.slots, limit, remaining, now + reset_ms / 1000)
    if account.spend:
        room = int(answer.fields[F_SPEND_ROOM])
        spend = SpendAllowance(command.worst, room if room >= 0 else 1 << 62)
    return tokens, slots, spend
