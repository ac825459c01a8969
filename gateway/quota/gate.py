"""The quota as a worker sees it: ``admission`` before routing, ``settle`` when the request ends.

Request path: what meters the (tenant, model, key) (memoised: its rule, the key's own limits, their admit
call) -> the estimate -> an open worker-held block admits at once, with no await (``lease_book.py``,
``quota.lease``) -> else, the breaker closed, the admit joins this loop tick's batch (``batcher.py``: one
pipelined write for every admit of the tick) and the request awaits its own Admission (``verdict.py``).
``admission`` returns None when nothing meters the request, so unmetered requests pay no coroutine either.

Every limit that applies (the key's and the rule's request rates, token budgets and in-flight caps) is
checked and taken by that one call, all or nothing, so it holds across every worker and every gateway
sharing the Valkey (``ledger.py``, ``ledger_script.py``).

Settling never waits: ``settle`` hands the reservation to the reconciler (``reconcile.py``), which
settles in pipelined batches with retries; a block's share is counted into its block, settled with it.
A dropped or failed settlement costs the tenant at most its estimate (the reservation times out).

The parts, each in its own module: the ledger and its transport (``ledger.py``, ``transport.py``: the
key layout and the one Lua script), the admit batcher, the lease book, the backend breaker with its probe
and the ``on_backend_error`` policy (``breaker.py``), the reconciler, and the reservation keeper
(``keeper.py``: a request that outlives the reservation timeout keeps its reservation live). The
reservations of a worker that dies are settled by the supervisor's sweep (``owner.py``).

USD budgets (docs/limits.md, "USD budgets") are limits of the same call: the admit carries the request's
worst-case cost (``PriceBook.worst_case_cost`` of the model it asks for), which a hard budget reserves;
settling carries its real cost (``workers/outcomes.py`` prices the usage) and returns the alert
thresholds it crossed, once per period across every gateway (``_alerted``: counted, logged and handed to
``gateway.spend.alerts.publish_alert``). A worker-held block of an account with USD budgets holds
nano-USD too (``lease.SpendAllowance``): its requests take their worst case from it and end charging
their real cost into it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.identity.limits import Scope
from gateway.ids import CounterIds
from gateway.pricing.period import rfc3339
from gateway.quota.admission import Admission
from gateway.quota.batcher import AdmitBatcher
from gateway.quota.breaker import BackendBreaker, BackendPolicy
from gateway.quota.counters import QuotaCounters, TenantTokens, configured_tenants
from gateway.quota.keeper import ReservationKeeper
from gateway.quota.lease import Lease, LeaseSpec
from gateway.quota.lease_book import LeaseBook
from gateway.quota.ledger import (
    F_RQ_REMAINING,
    F_SHADOW,
    F_SPEND_ROOM,
    F_TK_REMAINING,
    Account,
    AdmitCommand,
    QuotaLedger,
    Reservation,
    scopes_of,
)
from gateway.quota.owner import owner_tag
from gateway.quota.reconcile import Reconciler
from gateway.quota.report import key_scopes_by_tenant, quota_report
from gateway.quota.rules import QuotaRule, RuleSet, rules_from_config
from gateway.quota.verdict import rate_headers, refused, shadow_names
from gateway.request.estimate import PROMPT_BYTES_PER_TOKEN
from gateway.spend.alerts import SpendAlert, publish_alert
from gateway.spend.price_book import PriceBook
from gateway.valkey.client import BACKEND_ERRORS, describe_error

if TYPE_CHECKING:
    from gateway.config import Config
    from gateway.identity.auth import KeyIdentity

__all__ = ["Admission", "QuotaGate"]

log = logging.getLogger("gridgate.quota")
_time = time.time
_monotonic = time.monotonic

# What meters a (tenant, model, key): its account in the ledger and the tenant's TenantTokens slot.
Metered = tuple[Account, int]

_MAX_METERED = 4096  # (tenant, model, key) remembered; hostile model names cannot grow it further


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
        prices: PriceBook | None = None,
    ) -> None:
        """``owner``: the worker's ``owner_tag`` (every reservation id starts with it, so the supervisor
        can sweep a dead worker's reservations); None for a gate outside a supervised worker.
        ``tenants``: the configured tenant names, the label set of ``tenant_tokens``. ``prices``: the
        worker's price book (the worst case a hard USD budget reserves; None: every request costs 0)."""
        self._ledger = ledger
        self._prices = prices
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
            on_crossings=self._alerted,
        )
        self._keeper = ReservationKeeper(ledger, counters, self._breaker, call_timeout_s=request_timeout_s)
        self._batcher: AdmitBatcher[Metered] = AdmitBatcher(ledger, self._breaker, self._reconciler, counters,
                                                            self._decide)
        self._leases = None if lease is None else LeaseBook(lease, ledger, self._batcher, self._breaker,
                                                            self._keeper, self._reconciler, counters, self._ids)
        # The open blocks (always empty without leases): one truth test per request when there are none.
        self._open_leases = {} if self._leases is None else self._leases.open
        self._metered: dict[tuple[str, str | None, object], Metered | None] = {}
        self.key_scopes: dict[str, tuple[Scope, ...]] = {}  # the configured keys' limits (the report)

    @classmethod
    def from_config(cls, ledger: QuotaLedger, config: Config, *, generation: int, slot: int,
                    prices: PriceBook | None = None) -> QuotaGate:
        """The gate of the worker (``generation``, ``slot``) of this process, as ``config.quota`` says."""
        quota = config.quota
        assert quota is not None
        gate = cls(
            ledger,
            rules_from_config(quota),
            on_backend_error=quota.on_backend_error,
            breaker_failures=quota.breaker.failures,
            probe_interval_s=float(quota.breaker.probe_interval),
            owner=owner_tag(generation, slot, os.getpid()),
            tenants=configured_tenants(config),
            lease=lease_spec(quota),
            prices=prices,
        )
        gate.key_scopes = key_scopes_by_tenant(config.auth)
        return gate

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
        return await quota_report(self._ledger, self._rules, tenant, max(self._timeout_s, 1.0),
                                  self.key_scopes.get(tenant, ()))

    async def key_report(self, key: KeyIdentity) -> dict[str, Any]:
        """What the ledger holds for one key: its own limits and the rules that can apply to it (``GET
        /v1/gridgate/key``, docs/keys.md); ``QuotaBackendUnavailable`` as ``quota_report``."""
        return await quota_report(self._ledger, self._rules, key.tenant, max(self._timeout_s, 1.0),
                                  scopes_of(None, key), key)

    # -- the two verbs of the request path

    def admission(self, tenant: str, model: str | None, body_len: int, completion_allowance: int | None,
                  key: KeyIdentity | None = None) -> Admission | Awaitable[Admission] | None:
        """None when nothing meters the request (no rule applies and its key has no limits: nothing to
        settle); an ``Admission`` decided here (from a worker-held block, or by the breaker's policy)
        with no await; else the awaitable of the ledger's decision (this loop tick's batch).
        ``completion_allowance``: the largest the body names (``estimate.completion_allowance``), None for
        the rule's default. ``key``: who the request is (``gateway.identity.auth.KeyIdentity``; None without auth)."""
        try:
            metered = self._metered[(tenant, model, key)]
        except KeyError:
            metered = self._meter(tenant, model, key)
        if metered is None:
            self.counters.unmetered += 1
            return None
        account = metered[0]
        # ``estimate.estimate_prompt_tokens`` written out (two calls fewer per request): ``body_len`` is a
        # body's length, never negative.
        prompt = -(-body_len // PROMPT_BYTES_PER_TOKEN)
        completion = account.default_max_tokens if completion_allowance is None else completion_allowance
        estimate = prompt + completion
        worst = 0
        if account.spend:  # USD budgets: the period may have ended, and the admit carries the worst case
            if _time() >= account.spend_until:
                metered = self._meter(tenant, model, key)
                if metered is None:
                    return None
                account = metered[0]
            prices = self._prices
            if prices is not None and model is not None:
                worst = prices.worst_case_cost(model, prompt, completion)
        open_leases = self._open_leases
        if open_leases:
            lease = open_leases.get(account.lease_key)
            if lease is not None:
                # ``LeaseBook.take`` written out for a block that admits (every request but a few per
                # block): one call fewer on the request path. A block of tokens and request slots only (the
                # production config's) takes its own path: no allowance tested for None.
                headers = (lease.take_tokens_and_slot(estimate, _monotonic()) if lease.tokens_and_slots
                           else lease.take(estimate, _monotonic(), worst))
                if headers is not None:
                    counters = self.counters
                    counters.admitted += 1
                    counters.leased += 1
                    counters.tokens_estimated += estimate
                    return Admission(True, "admitted", None, headers, None, estimate, lease.tenant_slot, None, lease,
                                     True, worst_nusd=worst)
                self._leases.missed(account, metered[1], estimate, worst, lease)  # type: ignore[union-attr]
        if self._breaker.is_open:
            return self._breaker.unavailable()
        return self._batcher.submit(self._ledger.admit_command(account, estimate, self._ids.next(), 1, worst), metered)

    def admit_into(self, record: Any, tenant: str, model: str | None, body_len: int,
                   completion_allowance: int | None, key: KeyIdentity | None = None) -> Admission | Awaitable[Admission] | None:
        """``admission`` for the proxy's admit step: a request an open block of tokens and request slots admits
        (the production config's nearly every one) is decided here in one frame, and its Admission set as
        ``record.admission`` (None returned: go on); anything else is ``admission``'s (None: nothing meters it).
        ``Lease.take_tokens_and_slot`` written out: the same checks, counts and headers; a request it would not
        admit (a closed or full block, past its deadline, larger than its tokens) goes to ``admission``, which
        decides it as before (and closes the block as ``take`` does). tests/integration/test_quota_admit_into.py
        holds the two equal."""
        metered = self._metered.get((tenant, model, key))
        if metered is not None:
            account = metered[0]
            lease = self._open_leases.get(account.lease_key) if self._open_leases and not account.spend else None
            if lease is not None and lease.tokens_and_slots and not lease.closed:
                # ``estimate.estimate_prompt_tokens`` written out, as in ``admission``
                estimate = -(-body_len // PROMPT_BYTES_PER_TOKEN) + (
                    account.default_max_tokens if completion_allowance is None else completion_allowance)
                tokens: Any = lease.tokens
                slots: Any = lease.slots
                committed = tokens.committed + estimate
                used = slots.committed
                now = _monotonic()
                if committed <= tokens.capacity and used < slots.capacity and now < lease.closes_at:
                    tokens.committed = committed
                    lease.last_estimate = estimate
                    slots.committed = used = used + 1
                    lease.in_flight += 1
                    lease.taken += 1
                    counters = self.counters
                    counters.admitted += 1
                    counters.leased += 1
                    counters.tokens_estimated += estimate
                    record.admission = Admission(
                        True, "admitted", None,
                        (tokens.limit_header, (tokens.remaining_name, b"%d" % (tokens.room - committed)),
                         tokens._reset_header if now <= tokens._reset_until else tokens.reset_header(now),
                         slots.limit_header, (slots.remaining_name, b"%d" % (slots.room - used)),
                         slots._reset_header if now <= slots._reset_until else slots.reset_header(now)),
                        None, estimate, lease.tenant_slot, None, lease, True)
                    return None
        return self.admission(tenant, model, body_len, completion_allowance, key)

    def admit_hit(self, tenant: str, model: str | None, key: KeyIdentity | None = None) -> bool:
        """A response cache hit's admission and settlement at once, when a worker-held block takes it (the
        request limits' one slot; no tokens, no nano-USD, nothing left in flight): True. False when this
        cannot decide it here (no open block, a block without room, a USD period over, nothing meters it
        either way): then ``admission`` with no estimate decides, and ``settle`` with 0 ends it. The same
        outcome as that pair for a block that admits; without its rate-limit headers (a hit sends none)."""
        metered = self._metered.get((tenant, model, key))
        open_leases = self._open_leases
        if metered is None or not open_leases:
            return False
        account = metered[0]
        if account.spend and _time() >= account.spend_until:
            return False
        lease = open_leases.get(account.lease_key)
        if lease is None or not lease.take_hit(_monotonic()):
            return False
        counters = self.counters
        counters.admitted += 1
        counters.leased += 1
        return True

    def settle(self, admission: Admission, actual_tokens: int | None, prompt_tokens: int | None = None,
               completion_tokens: int | None = None, *, reached: bool = True, cost_nusd: int | None = None) -> None:
        """The request ended: charge ``actual_tokens`` (0: release it; None: charge its estimate) and
        ``cost_nusd`` to its USD budgets (None: its worst case) and, when the provider reported them,
        count the tenant's tokens in/out. ``reached`` False: it never reached a provider, so nothing is
        charged and its request slots go back too. Never blocks; settles once, however often it is
        called; an unmetered admission settles nothing."""
        lease: Lease | None = admission.lease
        if lease is not None:  # a block's share: counted here, settled with the block
            admission.lease = None
            estimate = admission.estimate
            charged = estimate if actual_tokens is None else actual_tokens if actual_tokens > 0 else 0
            # ``QuotaCounters.count_settled`` written out: one call fewer per request
            counters = self.counters
            counters.tokens_actual += charged
            if charged < estimate:
                counters.tokens_refunded += estimate - charged
            else:
                counters.tokens_overage += charged - estimate
            if reached and lease.spend is None:
                # ``Lease.end`` written out for a request that reached its provider, without USD budgets
                # (nearly every one): one call fewer per request
                tokens = lease.tokens
                if tokens is not None:
                    tokens.committed += charged - estimate
                lease.in_flight -= 1
                idle = lease.closed and lease.in_flight == 0
            else:
                idle = lease.end(estimate, charged, reached, admission.worst_nusd, cost_nusd if reached else 0)
            if idle:  # the block is closed and its last request ended
                self._leases.settle(lease)  # type: ignore[union-attr]
        else:
            reservation = admission.reservation
            if reservation is None:
                return
            admission.reservation = None
            self._keeper.discard(reservation)
            self._reconciler.enqueue(reservation, reservation.estimate if actual_tokens is None else actual_tokens,
                                     0 if reached else reservation.slots, cost_nusd if reached else 0)
        if prompt_tokens is not None and completion_tokens is not None:
            # ``TenantTokens.add`` written out for a usage that reported both sides (nearly every one)
            tenant_tokens = self.tenant_tokens
            slot = admission.tenant_slot
            tenant_tokens.tokens_in[slot] += prompt_tokens
            tenant_tokens.tokens_out[slot] += completion_tokens
        elif prompt_tokens is not None or completion_tokens is not None:
            self.tenant_tokens.add(admission.tenant_slot, prompt_tokens, completion_tokens, actual_tokens)

    # --

    def _alerted(self, reservation: Reservation, crossings: list[bytes]) -> None:
        """Thresholds of USD budgets this reservation's settle crossed (``b"<window>:<t>:<spent>"``, the
        window numbered in the reservation's ``spend``): each reported once per period by the ledger."""
        for crossing in crossings:
            number, threshold, spent = (int(part) for part in crossing.split(b":"))
            window = reservation.spend[number - 1]
            budget = window.budget
            alert = SpendAlert(window.tenant, window.scope.owner(), budget.budget_text, rfc3339(window.span.start),
                               threshold / 1000, spent, budget.nusd)
            self.counters.spend_alerts += 1
            log.warning("spend alert: tenant %s %s spend %s %g%% reached (%s of %s nano-USD)", alert.tenant,
                        alert.scope, budget.text, threshold / 10, spent, budget.nusd)
            publish_alert(alert)

    def _meter(self, tenant: str, model: str | None, key: KeyIdentity | None) -> Metered | None:
        rule = self._rules.match(tenant, model, key)
        account = self._ledger.account(tenant, rule, key)
        metered = None if account is None else (account, self.tenant_tokens.slot(tenant, -1 if key is None
                                                                                 else key.tenant_index))
        if len(self._metered) >= _MAX_METERED:
            self._metered.clear()
        self._metered[(tenant, model, key)] = metered
        return metered

    def _decide(self, command: AdmitCommand, reply: bytes, metered: Metered) -> Admission:
        """A request's Admission from its admit's reply (the batcher's ``decide``; a reply the script
        cannot have written raises ValueError, which the batcher answers as a backend error)."""
        answer = QuotaLedger.read(command, reply)
        account = metered[0]
        estimate = command.estimate
        counters = self.counters
        if not answer.admitted:
            return refused(account, answer, estimate, counters, command.worst)
        fields = answer.fields
        counters.admitted += 1
        counters.tokens_estimated += estimate
        shadow = None
        if fields[F_SHADOW] != b"-":
            shadow = shadow_names(account, fields)
            counters.shadow_refusals += len(shadow)  # type: ignore[arg-type]
        if self._leases is not None and account.leasable:
            self._leases.want(account, metered[1], estimate, int(fields[F_TK_REMAINING]), int(fields[F_RQ_REMAINING]),
                              worst=command.worst, spend_room=int(fields[F_SPEND_ROOM]))
        reservation = answer.reservation
        self._keeper.add(reservation)  # type: ignore[arg-type]
        return Admission(True, "admitted", None, rate_headers(account, fields), reservation, estimate, metered[1],
                         None, None, True, shadow, worst_nusd=command.worst)


def lease_spec(quota: Any) -> LeaseSpec | None:
    """``quota.lease`` (gateway.config, duck-typed): None when blocks are off (``null``, ``enabled: false``)."""
    lease = quota.lease
    if lease is None or not lease.enabled:
        return None
    return LeaseSpec(float(lease.ttl), lease.headroom, lease.tokens, lease.requests)
