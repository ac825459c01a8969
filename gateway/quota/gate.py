"""The quota façade a worker calls: ``admission`` before routing, one settle operation when the response ends.

Request path: rule lookup (memoised) -> estimate -> an open worker-held block of the (rule, tenant)
admits at once, with no await (``quota.lease``, opt-in: ``lease.py``) -> else breaker check -> the
admit joins this loop tick's batch. Every admit of one event-loop tick goes to Valkey in one pipelined write (the ledger script
once per request, one round trip for all), scheduled with ``call_soon`` and resolved request by
request from its own reply; the client's progress watchdog bounds the wait (no timer per request).
``admission`` returns None when no rule applies, so unmetered requests pay no coroutine either.

Settling never waits: ``release`` (nothing reached a provider), ``charge_estimate`` (it may have,
the outcome is unknown or failed) and ``charge`` (the usage the provider reported) enqueue into a
bounded queue that a background task drains in pipelined batches with retries. A dropped or failed
settlement is counted and costs the tenant at most its estimate (the reservation times out).

Backend failures follow ``on_backend_error``: ``reject`` (the worker answers 503) or ``allow``
(admitted unmetered, counted). ``breaker_failures`` consecutive failed round trips open the breaker
(``breaker.py``): the policy then applies without a round trip, and one task per worker probes the
backend every ``probe_interval_s``; the first answer closes the breaker, so admissions succeed again
within about one probe interval of the backend answering.

Concurrency cap: ``QuotaRule.max_in_flight`` is enforced by the same script call, counting the live
reservations of the (rule, tenant) in its reservation set, so it holds across every worker and every
gateway sharing the Valkey, and costs no extra round trip. A request that runs longer than the
reservation timeout keeps its reservation live (``keeper.py``); the reservations of a worker that dies
are settled by the supervisor's sweep (``owner.py``), lost ones when their timeout passes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from valkey.exceptions import NoScriptError

from gateway.ids import CounterIds
from gateway.quota.admission import (
    ALLOWED_UNMETERED,
    H_LIMIT,
    H_REMAINING,
    H_RESET,
    H_RETRY_AFTER,
    REJECTED,
    UNMETERED,
    Admission,
    duration_text,
    never_fits_message,
)
from gateway.quota.backend import BACKEND_ERRORS, describe_error
from gateway.quota.breaker import Breaker
from gateway.quota.counters import QuotaCounters, TenantTokens, configured_tenants
from gateway.quota.estimate import estimate_prompt_tokens
from gateway.quota.keeper import ReservationKeeper
from gateway.quota.lease import Lease, LeaseReservation, LeaseSpec, leasable, ms_to_window_end
from gateway.quota.ledger import ADMITTED, DENIED_BUDGET, AdmitCommand, QuotaLedger
from gateway.quota.owner import owner_tag
from gateway.quota.reconcile import Reconciler
from gateway.quota.report import quota_report
from gateway.quota.rules import QuotaRule, RuleSet, rules_from_config

if TYPE_CHECKING:
    from gateway.config import Config

log = logging.getLogger("gridgate.quota")
_monotonic = time.monotonic

# What a request's Admission is decided from, once its admit's reply is in: (rule, tenant, estimate).
_AdmitContext = tuple[QuotaRule, str, int]


class _Batch(NamedTuple):
    """One tick's admits, in the order sent."""

    commands: list[AdmitCommand]
    futures: list[asyncio.Future[Any]]
    contexts: list[_AdmitContext | None]


BackendPolicy = Literal["reject", "allow"]

# An admit whose reply was lost is cancelled after these pauses (the backend was slow or down);
# a bound on such pending cancels (one per failed batch) keeps a dead backend from piling up tasks.
_CANCEL_DELAYS_S = (0.5, 2.0, 5.0, 15.0)
_MAX_PENDING_CANCELS = 1024
# A block's successor is asked for this long before the block expires (at most a quarter of its life).
_RENEW_LEAD_S = 0.1


class QuotaGate:
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
        if on_backend_error not in ("reject", "allow"):
            raise ValueError("quota.on_backend_error: must be reject or allow")
        self._ledger = ledger
        self._rules = RuleSet(rules)
        self._policy = on_backend_error
        self._timeout_s = request_timeout_s
        self._breaker = Breaker(breaker_failures)
        self._probe_interval_s = probe_interval_s
        self._ids = CounterIds(prefix=owner)
        self._loop: asyncio.AbstractEventLoop | None = None
        # This tick's admits, sent by one _flush: their commands, the futures their requests await, and
        # what each request's Admission is decided from (None: a block's grant, which takes the raw reply).
        self._commands: list[AdmitCommand] = []
        self._futures: list[asyncio.Future[Any]] = []
        self._contexts: list[_AdmitContext | None] = []
        self._tasks: set[asyncio.Task] = set()  # probe, script reloads, cancels of lost admits
        self._cancels = 0
        self._probe: asyncio.Task[None] | None = None
        self.counters = QuotaCounters()
        self._keeper = ReservationKeeper(ledger, self.counters, self._breaker, call_timeout_s=request_timeout_s)
        self._reconciler = Reconciler(
            ledger, self.counters, timeout_s=request_timeout_s,
            queue_size=reconcile_queue_size, batch=reconcile_batch, retry_delays_s=reconcile_retry_delays_s,
        )
        self._lease_spec = lease
        self._leases: dict[tuple[str, str], Lease] = {}  # the open block of each (rule name, tenant)
        self._lease_asked: set[tuple[str, str]] = set()  # blocks asked for, not granted yet
        self._held: set[Lease] = set()  # every block not settled yet (open, or closed with requests)
        self._closing = False
        self.tenant_tokens = TenantTokens([*tenants, *(r.match_tenant for r in rules if r.match_tenant)])

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
    def breaker(self) -> Breaker:
        return self._breaker

    @property
    def reconcile_backlog(self) -> int:
        return self._reconciler.backlog

    async def start(self) -> None:
        """Load the script and start the reconciler. Call once in the worker, on its event loop. A
        backend that is down now opens the breaker: the probe closes it once the backend answers."""
        self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(self._timeout_s, 1.0)):
                await self._ledger.load_script()
        except BACKEND_ERRORS as exc:
            log.warning("quota backend unavailable at start (%s); policy %s applies",
                        describe_error(exc), self._policy)
            self.counters.backend_errors += 1
            if self._breaker.trip():
                self._opened()
        self._reconciler.start()
        self._keeper.start()

    async def drain(self) -> None:
        """Wait until every settlement queued so far has been reconciled (or given up on)."""
        await self._reconciler.drain()

    async def close(self, drain_timeout_s: float = 5.0) -> None:
        """Settle what is queued (bounded by ``drain_timeout_s``), stop the background tasks, close
        the client. Unsettled reservations are charged at their estimate by the supervisor's sweep or
        on expiry. Blocks still held are settled now, their requests in flight charged at their estimate."""
        self._closing = True
        self._keeper.stop()
        self._leases.clear()
        for lease in list(self._held):
            lease.close()
            self._return_lease(lease)
        await self._reconciler.stop(drain_timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await self._ledger.client.aclose()

    # -- admission (request path)

    def admission(self, tenant: str, model: str | None, body_len: int,
                  completion_allowance: int | None) -> Admission | Awaitable[Admission] | None:
        """None when no rule applies (unmetered: nothing to settle); an ``Admission`` decided here,
        from a worker-held block (``quota.lease``), with no await; else the awaitable of the ledger's
        decision (this loop tick's batch). ``completion_allowance``: the largest the body names
        (``estimate.completion_allowance``), None for the rule's default."""
        rule = self._rules.match(tenant, model)
        if rule is None:
            self.counters.unmetered += 1
            return None
        estimate = estimate_prompt_tokens(body_len) + (
            rule.default_max_tokens if completion_allowance is None else completion_allowance)
        if self._leases:
            key = (rule.name, tenant)
            lease = self._leases.get(key)
            if lease is not None:
                headers = lease.take(estimate, _monotonic())
                if headers is not None:
                    counters = self.counters
                    counters.admitted += 1
                    counters.leased += 1
                    counters.tokens_estimated += estimate
                    return Admission(True, "admitted", None, headers, None, estimate, lease.tenant_slot, None, lease,
                                     True)
                if lease.closed:
                    del self._leases[key]  # its requests still end and settle into it
                    if lease.in_flight == 0:
                        self._return_lease(lease)
                    self._lease(rule, tenant, lease.remaining)
        return self._admit(rule, tenant, estimate)

    async def admit(self, tenant: str, model: str | None, body_len: int, completion_allowance: int | None) -> Admission:
        """``admission`` awaited: always an ``Admission`` (``UNMETERED`` when no rule applies)."""
        admission = self.admission(tenant, model, body_len, completion_allowance)
        if admission is None:
            return UNMETERED
        if admission.__class__ is not Admission:
            admission = await admission  # type: ignore[misc]
        return admission  # type: ignore[return-value]

    def _admit(self, rule: QuotaRule, tenant: str, estimate: int) -> Admission | asyncio.Future[Admission]:
        """An Admission now (the breaker is open), else the future of this tick's batch, resolved with
        the request's Admission when the replies arrive (``_decide``, for the whole batch in one loop:
        no coroutine per request)."""
        if self._breaker.is_open:
            return self._backend_unavailable()
        command = self._ledger.admit_command(rule, tenant, estimate, self._ids.next())
        return self._enqueue(command, (rule, tenant, estimate))

    def _decide(self, command: AdmitCommand, reply: Any, context: _AdmitContext) -> Admission:
        """A request's Admission from its admit's reply (bytes; anything else: the backend failed)."""
        if reply.__class__ is not bytes:  # the batch failed, or this command did (counted per batch)
            return self._backend_unavailable()
        rule, tenant, estimate = context
        decision = QuotaLedger.decision(command, reply)
        counters = self.counters
        limit = (H_LIMIT, b"%d" % decision.limit)
        remaining = (H_REMAINING, b"%d" % max(0, decision.remaining))
        reset = (H_RESET, duration_text(decision.reset_ms))
        if decision.verdict == ADMITTED:
            counters.admitted += 1
            counters.tokens_estimated += estimate
            if self._lease_spec is not None:
                self._lease(rule, tenant, decision.remaining)
            self._keeper.add(decision.reservation)  # type: ignore[arg-type]
            return Admission(
                True, "admitted", None, (limit, remaining, reset), decision.reservation, estimate,
                self.tenant_tokens.slot(tenant), metered=True,
            )
        if decision.verdict == DENIED_BUDGET:
            counters.denied += 1
            if estimate > decision.limit:  # the ledger reports a budget smaller than the estimate
                counters.denied_never_fits += 1
                message = never_fits_message(rule, estimate, decision.limit)
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

    def _enqueue(self, command: AdmitCommand, context: _AdmitContext | None = None) -> asyncio.Future[Any]:
        """Add an admit to this loop tick's batch. The future gets the request's Admission (decided from
        ``context``), or without a context the raw reply (or the batch's error)."""
        loop = self._loop or asyncio.get_running_loop()
        future = loop.create_future()
        if not self._futures:
            loop.call_soon(self._flush)
        self._commands.append(command)
        self._futures.append(future)
        self._contexts.append(context)
        return future

    # -- worker-held blocks (quota.lease)

    def _lease(self, rule: QuotaRule, tenant: str, room: int, renewing: bool = False) -> None:
        """Ask for a block of (rule, tenant) in this tick's batch, if leases are on, the rule may
        lease, the budget has the headroom, and no block of the pair is asked for, nor open (unless
        ``renewing``: the open one is about to expire)."""
        spec = self._lease_spec
        if spec is None or not spec.wanted(room) or not leasable(rule) or self._breaker.is_open:
            return
        key = (rule.name, tenant)
        if (key in self._leases and not renewing) or key in self._lease_asked:
            return
        self._lease_asked.add(key)
        command = self._ledger.admit_command(rule, tenant, spec.tokens, self._ids.next())
        self._enqueue(command).add_done_callback(partial(self._lease_granted, rule, key, command))

    def _lease_granted(self, rule: QuotaRule, key: tuple[str, str], command: AdmitCommand,
                       future: asyncio.Future[Any]) -> None:
        self._lease_asked.discard(key)
        reply = None if future.cancelled() else future.result()
        if reply.__class__ is not bytes:
            return  # the batch failed: counted there; requests go to the ledger one by one
        decision = QuotaLedger.decision(command, reply)
        if decision.verdict != ADMITTED or decision.reservation is None:
            return  # no room for a block: requests go to the ledger one by one
        spec = self._lease_spec
        assert spec is not None
        if self._closing:  # granted while the gate shuts down: give it straight back
            self._reconciler.enqueue(LeaseReservation(*decision.reservation), 0)
            return
        now = _monotonic()
        window_end_s = ms_to_window_end(rule, decision.now_ms) / 1000
        life_s = min(spec.ttl_s, window_end_s)
        lease = Lease(LeaseReservation(*decision.reservation), spec.tokens, now + life_s, decision.limit,
                      decision.remaining, now + decision.reset_ms / 1000, self.tenant_tokens.slot(key[1]))
        replaced = self._leases.get(key)
        self._leases[key] = lease
        self._held.add(lease)
        self._keeper.add(lease.reservation)
        self.counters.leases_granted += 1
        if replaced is not None and replaced.close():  # renewed: the old block takes no more requests
            self._return_lease(replaced)
        loop = self._loop or asyncio.get_running_loop()
        loop.call_later(life_s, self._lease_expired, key, lease)
        if spec.ttl_s < window_end_s:
            # The next block is asked for shortly before this one expires, so the pair's requests never
            # wait on a round trip in between. Not across a window's end: a block reserved now would
            # count in the window that is ending.
            loop.call_later(max(0.0, life_s - min(life_s / 4, _RENEW_LEAD_S)), self._renew, rule, key, lease)

    def _renew(self, rule: QuotaRule, key: tuple[str, str], lease: Lease) -> None:
        """Ask for the successor of a block that is still open and was used: an idle pair lets its
        block expire and holds nothing."""
        if self._leases.get(key) is lease and not lease.closed and lease.committed and not self._closing:
            self._lease(rule, key[1], lease.remaining, renewing=True)

    def _lease_expired(self, key: tuple[str, str], lease: Lease) -> None:
        if self._leases.get(key) is lease:
            del self._leases[key]
            if lease.close():
                self._return_lease(lease)

    def _return_lease(self, lease: Lease) -> None:
        """Settle a block with what its requests were charged (once: the block leaves ``_held``)."""
        if lease in self._held:
            self._held.discard(lease)
            self._keeper.discard(lease.reservation)
            self._reconciler.enqueue(lease.reservation, lease.committed)

    def _backend_unavailable(self) -> Admission:
        if self._policy == "allow":
            self.counters.backend_error_allowed += 1
            return ALLOWED_UNMETERED
        self.counters.backend_error_rejected += 1
        return REJECTED

    def _flush(self) -> None:
        """Send this tick's admits in one round trip."""
        batch = _Batch(self._commands, self._futures, self._contexts)
        self._commands, self._futures, self._contexts = [], [], []
        try:
            sent = asyncio.ensure_future(self._ledger.send_admits(batch.commands))
        except BACKEND_ERRORS as exc:  # e.g. too many commands pending on a stuck connection
            self._batch_failed(batch, exc)
            return
        sent.add_done_callback(partial(self._batch_sent, batch))

    def _batch_sent(self, batch: _Batch, sent: asyncio.Future[list[Any]]) -> None:
        if sent.cancelled():  # the gate is closing
            self._batch_failed(batch, ConnectionError("quota gate closed"))
            return
        error = sent.exception()
        if error is not None:
            self._batch_failed(batch, error)
            return
        replies = sent.result()
        lost = [i for i, reply in enumerate(replies) if reply.__class__ is NoScriptError]
        if lost:  # the server restarted with an empty script cache: those admits did not run
            self._spawn(self._readmit(batch, replies, lost))
            return
        self._resolve(batch, replies)

    async def _readmit(self, batch: _Batch, replies: list[Any], lost: list[int]) -> None:
        commands = batch.commands
        try:
            await self._ledger.load_script()
            again = await self._ledger.send_admits([commands[i] for i in lost])
        except BACKEND_ERRORS as exc:
            again = [exc] * len(lost)
        for i, reply in zip(lost, again, strict=True):
            replies[i] = reply
        self._resolve(batch, replies)

    def _resolve(self, batch: _Batch, replies: list[Any]) -> None:
        failed = False
        for command, future, context, reply in zip(batch.commands, batch.futures, batch.contexts, replies,
                                                   strict=True):
            if reply.__class__ is not bytes:
                failed = True
            if future.cancelled():  # the request gave up waiting: free what the admit reserved
                if reply.__class__ is bytes and reply.startswith(b"1 "):
                    reservation = QuotaLedger.decision(command, reply).reservation
                    self._reconciler.enqueue(reservation, 0)  # type: ignore[arg-type]
            else:
                future.set_result(reply if context is None else self._decide(command, reply, context))
        if failed:
            errors = sum(reply.__class__ is not bytes for reply in replies)
            self._backend_failed(f"{errors} admit(s) answered with errors")
        elif self._breaker.success():
            self._closed()

    def _batch_failed(self, batch: _Batch, error: BaseException) -> None:
        for future, context in zip(batch.futures, batch.contexts, strict=True):
            if not future.done():  # a result, not an exception: one object, many requests
                future.set_result(error if context is None else self._backend_unavailable())
        commands = batch.commands
        self._backend_failed(describe_error(error))
        # The admits may still run once the backend catches up: undo them then (off the request path).
        if self._cancels >= _MAX_PENDING_CANCELS:
            self.counters.reconcile_drops += len(commands)  # charged at their estimate on expiry
            return
        self._cancels += 1
        self._spawn(self._cancel_lost(commands))

    # -- the breaker and its probe

    def _backend_failed(self, why: str) -> None:
        self.counters.backend_errors += 1
        if self._breaker.failure():
            log.warning("quota backend failing (%s); breaker open, policy %s applies", why, self._policy)
            self._opened()

    def _opened(self) -> None:
        self.counters.breaker_opened += 1
        if self._probe is None or self._probe.done():
            self._probe = self._spawn(self._probe_until_closed())

    def _closed(self) -> None:
        self.counters.breaker_closed += 1
        log.warning("quota backend answers again; breaker closed")

    async def _probe_until_closed(self) -> None:
        """One cheap command every probe interval while the breaker is open; the first answer closes
        it (after reloading the script: a restarted server has lost it)."""
        while self._breaker.is_open:
            await asyncio.sleep(self._probe_interval_s)
            try:
                async with asyncio.timeout(max(self._timeout_s * 4, 1.0)):
                    await self._ledger.ping()
                    await self._ledger.load_script()
            except BACKEND_ERRORS:
                self.counters.backend_errors += 1
                continue
            if self._breaker.success():
                self._closed()

    # -- settling (off the request path)

    def release(self, admission: Admission) -> None:
        """Nothing reached a provider: give the whole reservation back. Never blocks."""
        self.settle(admission, 0)

    def charge_estimate(self, admission: Admission) -> None:
        """A provider may have worked but reported no usage (non-2xx, cut, disconnect): charge the estimate."""
        self.settle(admission, None)

    def charge(
        self,
        admission: Admission,
        total_tokens: int,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """A completed response with the usage the provider reported: charge ``total_tokens`` (the
        difference to the estimate is refunded or charged) and count the tenant's tokens in/out."""
        self.settle(admission, total_tokens, prompt_tokens, completion_tokens)

    def settle(self, admission: Admission, actual: int | None, prompt_tokens: int | None = None,
               completion_tokens: int | None = None) -> None:
        """The request ended: charge ``actual`` tokens (0: nothing reached a provider; None: its estimate)
        and, when the provider reported them, count the tenant's tokens in/out. Never blocks; settles
        once, however often it is called; an unmetered admission settles nothing."""
        lease = admission.lease
        if lease is not None:  # a block's share: counted here, settled with the block
            admission.lease = None
            estimate = admission.estimate
            charged = estimate if actual is None else actual if actual > 0 else 0
            self.counters.count_settled(estimate, charged)
            if lease.end(estimate, charged):
                self._return_lease(lease)
        else:
            reservation = admission.reservation
            if reservation is None:
                return
            admission.reservation = None
            self._keeper.discard(reservation)
            self._reconciler.enqueue(reservation, reservation.estimate if actual is None else actual)
        self.tenant_tokens.add(admission.tenant_slot, prompt_tokens, completion_tokens, actual)

    async def quota_report(self, tenant: str) -> dict[str, Any]:
        """What the ledger holds for ``tenant`` (``report.quota_report``), through this gate's client."""
        return await quota_report(self._ledger, self._rules, tenant, max(self._timeout_s, 1.0))

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task = (self._loop or asyncio.get_running_loop()).create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _cancel_lost(self, commands: list[AdmitCommand]) -> None:
        """Retry until each lost admit is found and released, or long enough that it never ran."""
        try:
            pending = commands
            for delay in _CANCEL_DELAYS_S:
                await asyncio.sleep(delay)
                if self._breaker.is_open:
                    continue  # no round trips against a backend known to be down
                try:
                    results = await self._ledger.cancel_many(pending)
                except BACKEND_ERRORS:
                    continue
                pending = [c for c, found in zip(pending, results, strict=True) if found is not True]
                if not pending:
                    return
        finally:
            self._cancels -= 1
