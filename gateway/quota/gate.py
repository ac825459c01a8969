"""The quota as a worker sees it: ``admission`` before routing, ``settle`` when the request ends.

Request path: which rule meters the (tenant, model) (memoised) -> the estimate -> an open worker-held
block of the (rule, tenant) admits at once, with no await (``lease_book.py``, opt-in ``quota.lease``)
-> else, the breaker closed, the admit joins this loop tick's batch (``batcher.py``: one pipelined write
for every admit of the tick) and the request awaits its own Admission. ``admission`` returns None when
no rule applies, so unmetered requests pay no coroutine either.

Settling never waits: ``settle`` hands the reservation to the reconciler (``reconcile.py``), which
settles in pipelined batches with retries; a block's share is counted into its block, settled with it.
A dropped or failed settlement costs the tenant at most its estimate (the reservation times out).

The parts, each in its own module: the ledger and its transport (``ledger.py``, ``transport.py``: the
key layout and the one Lua script), the admit batcher, the lease book, the backend breaker with its probe
and the ``on_backend_error`` policy (``breaker.py``), the reconciler, and the reservation keeper
(``keeper.py``: a request that outlives the reservation timeout keeps its reservation live). The
reservations of a worker that dies are settled by the supervisor's sweep (``owner.py``).

Concurrency cap: ``QuotaRule.max_in_flight`` is enforced by the same script call, counting the live
reservations of the (rule, tenant), so it holds across every worker and every gateway sharing the Valkey.

Where further limits go (request rates, per-key limits, spend): into what a (tenant, model) is metered by
(``Metered``, memoised here), the arguments and reply of the one admit call (``ledger.py``), and further
allowances of a block (``lease.Allowance``). The batcher, the breaker and the transports carry any admit.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.ids import CounterIds
from gateway.quota.admission import (
    H_LIMIT,
    H_REMAINING,
    H_RESET,
    H_RETRY_AFTER,
    Admission,
    duration_text,
    never_fits_message,
)
from gateway.quota.backend import BACKEND_ERRORS, describe_error
from gateway.quota.batcher import AdmitBatcher
from gateway.quota.breaker import BackendBreaker, BackendPolicy
from gateway.quota.counters import QuotaCounters, TenantTokens, configured_tenants
from gateway.quota.estimate import PROMPT_BYTES_PER_TOKEN
from gateway.quota.keeper import ReservationKeeper
from gateway.quota.lease import Lease, LeaseSpec
from gateway.quota.lease_book import LeaseBook
from gateway.quota.ledger import ADMITTED, DENIED_BUDGET, Account, AdmitCommand, QuotaLedger
from gateway.quota.owner import owner_tag
from gateway.quota.reconcile import Reconciler
from gateway.quota.report import quota_report
from gateway.quota.rules import QuotaRule, RuleSet, rules_from_config

if TYPE_CHECKING:
    from gateway.config import Config

__all__ = ["Admission", "QuotaGate"]

# What meters a (tenant, model): its rule's account in the ledger and the tenant's TenantTokens slot.
Metered = tuple[Account, int]

_MAX_METERED = 4096  # (tenant, model) pairs remembered; hostile model names cannot grow it further


class QuotaGate:
    """One per worker: ``admission`` and ``settle`` on the request path, ``start``/``drain``/``close`` around
    it, ``quota_report`` for the admin page; ``counters`` and ``tenant_tokens`` feed the metrics."""

    def __init__(
        self,
        ledger: QuotaLedger,
        rules: Sequence[QuotaRule],
        *,
        on_backend_error: BackendPolicy = "reject",
        request_timeout_s: float = 0.25,
        breaker_failures: int = 3,
        probe_interval_s: float = 0.1,
        owner: bytes | None = None,
        tenants: Sequence[str] = (),
        reconcile_queue_size: int = 10000,
        reconcile_batch: int = 128,
        reconcile_retry_delays_s: Sequence[float] = (0.05, 0.25, 1.0),
        lease: LeaseSpec | None = None,
    ) -> None:
        """``owner``: the worker's ``owner_tag`` (every reservation id starts with it, so the supervisor
        can sweep a dead worker's reservations); None for a gate outside a supervised worker.
        ``tenants``: the configured tenant names, the label set of ``tenant_tokens``."""
        self._ledger = ledger
        self._rules = RuleSet(rules)
        self._timeout_s = request_timeout_s
        self._ids = CounterIds(prefix=owner)
        self.counters = counters = QuotaCounters()
        self.tenant_tokens = TenantTokens([*tenants, *(r.match_tenant for r in rules if r.match_tenant)])
        self._breaker = BackendBreaker(ledger, counters, policy=on_backend_error, failures_to_open=breaker_failures,
                                       probe_interval_s=probe_interval_s, call_timeout_s=request_timeout_s)
        self._reconciler = Reconciler(
            ledger, counters, timeout_s=request_timeout_s,
            queue_size=reconcile_queue_size, batch=reconcile_batch, retry_delays_s=reconcile_retry_delays_s,
        )
        self._keeper = ReservationKeeper(ledger, counters, self._breaker, call_timeout_s=request_timeout_s)
        self._batcher: AdmitBatcher[Metered] = AdmitBatcher(ledger, self._breaker, self._reconciler, counters,
                                                            self._decide)
        self._leases = None if lease is None else LeaseBook(lease, ledger, self._batcher, self._breaker,
                                                            self._keeper, self._reconciler, counters, self._ids)
        # The open blocks (always empty without leases): one truth test per request when there are none.
        self._open_leases = {} if self._leases is None else self._leases.open
        self._metered: dict[tuple[str, str | None], Metered | None] = {}

    @classmethod
    def from_config(cls, ledger: QuotaLedger, config: Config, *, generation: int, slot: int) -> QuotaGate:
        """The gate of the worker (``generation``, ``slot``) of this process, as ``config.quota`` says."""
        quota = config.quota
        assert quota is not None
        return cls(
            ledger,
            rules_from_config(quota),
            on_backend_error=quota.on_backend_error,
            breaker_failures=quota.breaker.failures,
            probe_interval_s=float(quota.breaker.probe_interval),
            owner=owner_tag(generation, slot, os.getpid()),
            tenants=configured_tenants(config),
            lease=None if quota.lease is None else LeaseSpec(quota.lease.tokens, float(quota.lease.ttl),
                                                             quota.lease.headroom),
        )

    @property
    def breaker(self) -> BackendBreaker:
        return self._breaker

    async def start(self) -> None:
        """Load the script and start the background parts. Call once in the worker, on its event loop. A
        backend that is down now opens the breaker: the probe closes it once the backend answers."""
        self._batcher.start()
        try:
            async with asyncio.timeout(max(self._timeout_s, 1.0)):
                await self._ledger.load_script()
        except BACKEND_ERRORS as exc:
            self._breaker.down(describe_error(exc))
        self._reconciler.start()
        self._keeper.start()

    async def drain(self) -> None:
        """Wait until every settlement queued so far has been reconciled (or given up on)."""
        await self._reconciler.drain()

    async def close(self, drain_timeout_s: float = 5.0) -> None:
        """Settle what is queued (bounded by ``drain_timeout_s``), stop the background parts, close the
        client. Unsettled reservations are charged at their estimate by the supervisor's sweep or on
        expiry. Blocks still held are settled now, their requests in flight charged at their estimate."""
        self._keeper.stop()
        if self._leases is not None:
            self._leases.close()
            await self._batcher.settled(min(drain_timeout_s, 1.0))  # blocks granted meanwhile go straight back
        await self._reconciler.stop(drain_timeout_s)
        self._batcher.close()
        self._breaker.stop()
        await self._ledger.close()

    async def quota_report(self, tenant: str) -> dict[str, Any]:
        """What the ledger holds for ``tenant`` (``report.quota_report``), through this gate's client."""
        return await quota_report(self._ledger, self._rules, tenant, max(self._timeout_s, 1.0))

    # -- the two verbs of the request path

    def admission(self, tenant: str, model: str | None, body_len: int,
                  completion_allowance: int | None) -> Admission | Awaitable[Admission] | None:
        """None when no rule applies (unmetered: nothing to settle); an ``Admission`` decided here (from
        a worker-held block, or by the breaker's policy) with no await; else the awaitable of the ledger's
        decision (this loop tick's batch). ``completion_allowance``: the largest the body names
        (``estimate.completion_allowance``), None for the rule's default."""
        try:
            metered = self._metered[(tenant, model)]
        except KeyError:
            metered = self._meter(tenant, model)
        if metered is None:
            self.counters.unmetered += 1
            return None
        account = metered[0]
        # ``estimate.estimate_prompt_tokens`` written out (two calls fewer per request): ``body_len`` is a
        # body's length, never negative.
        estimate = -(-body_len // PROMPT_BYTES_PER_TOKEN) + (
            account.rule.default_max_tokens if completion_allowance is None else completion_allowance)
        if self._open_leases:
            admission = self._leases.take(account, metered[1], estimate)  # type: ignore[union-attr]
            if admission is not None:
                return admission
        if self._breaker.is_open:
            return self._breaker.unavailable()
        return self._batcher.submit(self._ledger.admit_command(account, estimate, self._ids.next()), metered)

    def settle(self, admission: Admission, actual_tokens: int | None, prompt_tokens: int | None = None,
               completion_tokens: int | None = None) -> None:
        """The request ended: charge ``actual_tokens`` (0: nothing reached a provider, release it; None:
        charge its estimate) and, when the provider reported them, count the tenant's tokens in/out. Never
        blocks; settles once, however often it is called; an unmetered admission settles nothing."""
        lease: Lease | None = admission.lease
        if lease is not None:  # a block's share: counted here, settled with the block
            admission.lease = None
            self._leases.end(lease, admission.estimate, actual_tokens)  # type: ignore[union-attr]
        else:
            reservation = admission.reservation
            if reservation is None:
                return
            admission.reservation = None
            self._keeper.discard(reservation)
            self._reconciler.enqueue(reservation, reservation.estimate if actual_tokens is None else actual_tokens)
        if prompt_tokens is not None or completion_tokens is not None:
            self.tenant_tokens.add(admission.tenant_slot, prompt_tokens, completion_tokens, actual_tokens)

    # --

    def _meter(self, tenant: str, model: str | None) -> Metered | None:
        rule = self._rules.match(tenant, model)
        metered = None if rule is None else (self._ledger.account(rule, tenant), self.tenant_tokens.slot(tenant))
        if len(self._metered) >= _MAX_METERED:
            self._metered.clear()
        self._metered[(tenant, model)] = metered
        return metered

    def _decide(self, command: AdmitCommand, reply: bytes, metered: Metered) -> Admission:
        """A request's Admission from its admit's reply (the batcher's ``decide``)."""
        decision = QuotaLedger.decision(command, reply)
        estimate = command.estimate
        counters = self.counters
        limit = (H_LIMIT, b"%d" % decision.limit)
        remaining = (H_REMAINING, b"%d" % max(0, decision.remaining))
        reset = (H_RESET, duration_text(decision.reset_ms))
        if decision.verdict == ADMITTED:
            counters.admitted += 1
            counters.tokens_estimated += estimate
            if self._leases is not None:
                self._leases.want(metered[0], metered[1], decision.remaining)
            self._keeper.add(decision.reservation)  # type: ignore[arg-type]
            return Admission(True, "admitted", None, (limit, remaining, reset), decision.reservation, estimate,
                             metered[1], metered=True)
        if decision.verdict == DENIED_BUDGET:
            counters.denied += 1
            if estimate > decision.limit:  # the ledger reports a budget smaller than the estimate
                counters.denied_never_fits += 1
                message = never_fits_message(metered[0].rule, estimate, decision.limit)
                return Admission(False, "denied_never_fits", 429, (limit, remaining, reset), None, estimate,
                                 message=message)
            # The retry is the end of the blocking window.
            reason, retry_after = "denied", max(1, -(-decision.reset_ms // 1000))
        else:
            # The concurrency cap: a guess (one second), since we cannot know when a request in
            # flight will finish.
            counters.denied_concurrency += 1
            reason, retry_after = "denied_concurrency", 1
        headers = ((H_RETRY_AFTER, b"%d" % retry_after), limit, remaining, reset)
        return Admission(False, reason, 429, headers, None, estimate)
