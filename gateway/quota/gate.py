"""The quota façade a worker calls: ``admit`` before routing, ``settle`` when the response ends.

Request path: rule lookup (memoised) -> estimate -> breaker check -> at most one Valkey round trip
(the ledger script) under a short deadline. Settling never waits: it enqueues into a bounded queue
that a background task drains in pipelined batches with retries. A dropped or failed settlement is
counted and costs the tenant at most its estimate (the reservation times out and is charged).

Backend failures follow ``on_backend_error``: ``reject`` (the worker answers 503) or ``allow``
(admitted unmetered, counted). After ``breaker_failures`` consecutive failures the breaker opens and
the policy applies immediately for ``breaker_cooldown_s``; then one request probes the backend and a
success closes the breaker again.

Concurrency cap: ``QuotaRule.max_in_flight`` is enforced by the same script call, counting the live
reservations of the (rule, tenant) in its reservation set, so it holds across every worker and every
gateway sharing the Valkey, and costs no extra round trip. An abandoned request stops counting when
its reservation times out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from valkey.exceptions import ValkeyError

from gateway.quota.estimate import estimate_tokens
from gateway.quota.ledger import (
    ADMITTED,
    DENIED_BUDGET,
    SETTLE_APPLIED,
    SETTLE_EXPIRED,
    SETTLE_NOOP,
    QuotaLedger,
    Reservation,
)
from gateway.quota.rules import QuotaRule, RuleSet

log = logging.getLogger("gridgate.quota")

BackendPolicy = Literal["reject", "allow"]
BACKEND_ERRORS = (ValkeyError, OSError, TimeoutError)

# An admit whose reply was lost is cancelled after these pauses (the backend was slow or down);
# a bound on such pending cancels keeps a dead backend from piling up tasks.
_CANCEL_DELAYS_S = (0.5, 2.0, 5.0, 15.0)
_MAX_PENDING_CANCELS = 1024

_H_RETRY_AFTER = b"retry-after"
_H_LIMIT = b"x-ratelimit-limit-tokens"
_H_REMAINING = b"x-ratelimit-remaining-tokens"
_H_RESET = b"x-ratelimit-reset-tokens"


class QuotaBackendUnavailable(Exception):
    """Raised by ``quota_report`` when Valkey cannot be reached (the admin page answers 503)."""


@dataclass(slots=True)
class QuotaCounters:
    """Per-worker monotonic counters (the metrics module sums them over workers)."""

    admitted: int = 0
    denied: int = 0
    denied_concurrency: int = 0
    backend_error_rejected: int = 0
    backend_error_allowed: int = 0
    unmetered: int = 0  # no rule matched (no default rule)
    tokens_estimated: int = 0
    tokens_actual: int = 0
    tokens_refunded: int = 0
    tokens_overage: int = 0
    reservations_expired: int = 0  # charged at the estimate because they outlived the timeout
    backend_errors: int = 0
    reconcile_drops: int = 0  # queue full
    reconcile_failures: int = 0  # retries exhausted
    reconcile_duplicates: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


class Admission:
    """The verdict the worker acts on.

    ``allowed`` False -> answer ``status`` (429 or 503) with ``headers``, send nothing upstream.
    ``allowed`` True -> forward; add ``headers`` to the response; when the request ends call one of
    ``QuotaGate.release`` / ``charge_estimate`` / ``charge`` (settling an unmetered admission is a no-op).
    """

    __slots__ = ("allowed", "reason", "status", "headers", "reservation", "estimate")

    def __init__(
        self,
        allowed: bool,
        reason: str,
        status: int | None,
        headers: tuple[tuple[bytes, bytes], ...],
        reservation: Reservation | None = None,
        estimate: int = 0,
    ) -> None:
        self.allowed = allowed
        self.reason = reason  # admitted|unmetered|denied|denied_concurrency|backend_error_*
        self.status = status
        self.headers = headers
        self.reservation = reservation
        self.estimate = estimate

    @property
    def error(self) -> tuple[str, str, str] | None:
        """(message, type, code) for the worker's OpenAI-style error body when not allowed."""
        return _ERRORS.get(self.reason)

    def __repr__(self) -> str:
        return f"Admission({self.reason}, status={self.status}, estimate={self.estimate})"


_ERRORS = {
    "denied": (
        "Token quota exceeded for this API key; retry after the Retry-After delay.",
        "tokens",
        "rate_limit_exceeded",
    ),
    "denied_concurrency": (
        "Too many concurrent requests for this API key.",
        "requests",
        "rate_limit_exceeded",
    ),
    "backend_error_rejected": (
        "The token quota service is unavailable; retry shortly.",
        "server_error",
        "quota_unavailable",
    ),
}


_UNMETERED = Admission(True, "unmetered", None, ())


class Breaker:
    """Consecutive-failure circuit breaker. Pure: the caller passes the monotonic time."""

    __slots__ = ("failures_to_open", "cooldown_s", "_failures", "_open_until", "_probing")

    def __init__(self, failures_to_open: int = 3, cooldown_s: float = 2.0) -> None:
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self._failures = 0
        self._open_until = 0.0
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._failures >= self.failures_to_open

    def retry_after_s(self, now: float) -> int:
        return max(1, int(self._open_until - now + 0.999))

    def allow(self, now: float) -> bool:
        """May this request try the backend? While open: no, except one probe after the cool-down."""
        if self._failures < self.failures_to_open:
            return True
        if self._probing or now < self._open_until:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._failures = 0
        self._probing = False

    def abandoned(self) -> None:
        """The attempt was cancelled (client went away): no verdict, but free the probe slot."""
        self._probing = False

    def failure(self, now: float) -> None:
        self._failures += 1
        self._probing = False
        if self._failures >= self.failures_to_open:
            self._open_until = now + self.cooldown_s


class QuotaGate:
    def __init__(
        self,
        ledger: QuotaLedger,
        rules: Sequence[QuotaRule],
        *,
        on_backend_error: BackendPolicy = "reject",
        request_timeout_s: float = 0.25,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 2.0,
        reconcile_queue_size: int = 10000,
        reconcile_batch: int = 128,
        reconcile_retry_delays_s: Sequence[float] = (0.05, 0.25, 1.0),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if on_backend_error not in ("reject", "allow"):
            raise ValueError("quota.on_backend_error: must be reject or allow")
        self._ledger = ledger
        self._rules = RuleSet(rules)
        self._policy = on_backend_error
        self._timeout_s = request_timeout_s
        self._breaker = Breaker(breaker_failures, breaker_cooldown_s)
        self._clock = clock
        self._queue: asyncio.Queue[tuple[Reservation, int]] = asyncio.Queue(reconcile_queue_size)
        self._cancels: set[asyncio.Task] = set()
        self._batch = reconcile_batch
        self._retry_delays = tuple(reconcile_retry_delays_s)
        self._drainer: asyncio.Task[None] | None = None
        self.counters = QuotaCounters()

    @property
    def breaker(self) -> Breaker:
        return self._breaker

    @property
    def reconcile_backlog(self) -> int:
        return self._queue.qsize()

    async def start(self) -> None:
        """Load the script (best effort: a backend that is down now is handled per request) and start
        the reconciler. Call once in the worker, on its event loop."""
        try:
            async with asyncio.timeout(max(self._timeout_s, 1.0)):
                await self._ledger.load_script()
        except BACKEND_ERRORS as exc:
            self.counters.backend_errors += 1
            log.warning(
                "quota backend unavailable at start (%s); policy %s applies", _describe(exc), self._policy
            )
        self._drainer = asyncio.get_running_loop().create_task(self._reconcile_forever())

    async def drain(self) -> None:
        """Wait until every settlement queued so far has been reconciled (or given up on)."""
        await self._queue.join()

    async def close(self, drain_timeout_s: float = 5.0) -> None:
        """Settle what is queued (bounded by ``drain_timeout_s``), stop the reconciler, close the client."""
        if self._drainer is not None:
            try:
                async with asyncio.timeout(drain_timeout_s):
                    await self._queue.join()
            except TimeoutError:
                log.warning("quota: %d settlements not reconciled at shutdown", self._queue.qsize())
            self._drainer.cancel()
            try:
                await self._drainer
            except asyncio.CancelledError:
                pass
            self._drainer = None
        for task in list(self._cancels):
            task.cancel()  # unfinished: those reservations are charged at their estimate on expiry
        await self._ledger.client.aclose()

    async def admit(
        self,
        tenant: str,
        model: str | None,
        body_len: int,
        max_tokens: int | None,
        max_completion_tokens: int | None,
    ) -> Admission:
        rule = self._rules.match(tenant, model)
        if rule is None:
            self.counters.unmetered += 1
            return _UNMETERED
        estimate = estimate_tokens(body_len, max_tokens, max_completion_tokens, rule.default_max_tokens)
        now = self._clock()
        if not self._breaker.allow(now):
            return self._backend_unavailable(now, estimate)
        reservation_id = self._ledger.new_id()
        try:
            # No asyncio.timeout here (it costs a timer per request): the client enforces
            # ``timeout_s`` itself (RespClient's watchdog, ValkeyCluster's socket timeout).
            decision = await self._ledger.reserve(rule, tenant, estimate, reservation_id)
        except BACKEND_ERRORS as exc:
            self._breaker.failure(now)
            self.counters.backend_errors += 1
            # The admit may still run once the backend catches up: undo it then (off the request path).
            self._cancel_later(rule.name, tenant, reservation_id)
            if self._breaker.is_open:
                log.warning("quota backend failing (%s); breaker open", _describe(exc))
            return self._backend_unavailable(now, estimate)
        except BaseException:  # cancelled: a stuck probe flag would keep the breaker open forever
            self._breaker.abandoned()
            raise
        self._breaker.success()
        counters = self.counters
        limit = (_H_LIMIT, b"%d" % decision.limit)
        remaining = (_H_REMAINING, b"%d" % max(0, decision.remaining))
        reset = (_H_RESET, duration_text(decision.reset_ms))
        if decision.verdict == ADMITTED:
            counters.admitted += 1
            counters.tokens_estimated += estimate
            return Admission(
                True, "admitted", None, (limit, remaining, reset), decision.reservation, estimate
            )
        # Denied. For a budget the retry is the end of the blocking window; for the concurrency cap it
        # is a guess (one second), since we cannot know when a request in flight will finish.
        if decision.verdict == DENIED_BUDGET:
            counters.denied += 1
            reason, retry_after = "denied", max(1, -(-decision.reset_ms // 1000))
        else:
            counters.denied_concurrency += 1
            reason, retry_after = "denied_concurrency", 1
        headers = ((_H_RETRY_AFTER, b"%d" % retry_after), limit, remaining, reset)
        return Admission(False, reason, 429, headers, None, estimate)

    def release(self, admission: Admission) -> None:
        """Nothing reached a provider: give the whole reservation back. Never blocks."""
        self._settle(admission, 0)

    def charge_estimate(self, admission: Admission) -> None:
        """A provider may have worked but reported no usage (non-2xx, cut, disconnect): charge the estimate."""
        self._settle(admission, None)

    def charge(self, admission: Admission, tokens: int) -> None:
        """A complete response reported its usage: charge exactly that (refunding or adding the difference)."""
        self._settle(admission, tokens)

    def _settle(self, admission: Admission, tokens: int | None) -> None:
        """Queue the reconciliation (settled once, however often it is called)."""
        reservation = admission.reservation
        if reservation is None:
            return
        admission.reservation = None
        try:
            self._queue.put_nowait((reservation, reservation.estimate if tokens is None else tokens))
        except asyncio.QueueFull:
            self.counters.reconcile_drops += 1

    async def quota_report(self, tenant: str) -> dict[str, Any]:
        """``/admin/quota?tenant=T``: per rule that can apply to T, per window: used, reserved,
        remaining, reset (seconds). Raises ``QuotaBackendUnavailable`` if Valkey cannot answer."""
        rules = []
        try:
            async with asyncio.timeout(max(self._timeout_s, 1.0)):
                for rule in self._rules.rules_for_tenant(tenant):
                    report = await self._ledger.report(rule, tenant)
                    rules.append(
                        {
                            "rule": report.rule,
                            "in_flight": report.in_flight,
                            "max_in_flight": report.max_in_flight,
                            "windows": [
                                {
                                    "window_s": w.window_s,
                                    "limit": w.limit,
                                    "used": w.used,
                                    "reserved": w.reserved,
                                    "remaining": w.remaining,
                                    "reset_s": w.reset_s,
                                }
                                for w in report.windows
                            ],
                        }
                    )
        except BACKEND_ERRORS as exc:
            raise QuotaBackendUnavailable(_describe(exc)) from None
        return {"tenant": tenant, "rules": rules}

    def _backend_unavailable(self, now: float, estimate: int) -> Admission:
        if self._policy == "allow":
            self.counters.backend_error_allowed += 1
            return Admission(True, "backend_error_allowed", None, (), None, estimate)
        self.counters.backend_error_rejected += 1
        retry_after = self._breaker.retry_after_s(now) if self._breaker.is_open else 1
        return Admission(
            False, "backend_error_rejected", 503, ((_H_RETRY_AFTER, b"%d" % retry_after),), None, estimate
        )

    def _cancel_later(self, rule_name: str, tenant: str, reservation_id: bytes) -> None:
        if len(self._cancels) >= _MAX_PENDING_CANCELS:
            self.counters.reconcile_drops += 1  # charged at the estimate when it expires
            return
        task = asyncio.get_running_loop().create_task(self._cancel(rule_name, tenant, reservation_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel(self, rule_name: str, tenant: str, reservation_id: bytes) -> None:
        """Retry until the lost admit is found and released, or long enough that it never ran."""
        for delay in _CANCEL_DELAYS_S:
            await asyncio.sleep(delay)
            try:
                if await self._ledger.cancel(rule_name, tenant, reservation_id):
                    return
            except BACKEND_ERRORS:
                continue

    async def _reconcile_forever(self) -> None:
        queue = self._queue
        while True:
            batch = [await queue.get()]
            while len(batch) < self._batch and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await self._reconcile(batch)
            except Exception:  # never let one bad batch kill the reconciler
                log.exception("quota: reconciliation batch failed")
                self.counters.reconcile_failures += len(batch)
            finally:
                for _ in batch:
                    queue.task_done()

    async def _reconcile(self, batch: list[tuple[Reservation, int]]) -> None:
        pending = batch
        for delay in (0.0, *self._retry_delays):
            if delay:
                await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(max(self._timeout_s * 4, 1.0)):
                    results = await self._ledger.settle_many(pending)
            except BACKEND_ERRORS as exc:
                self.counters.backend_errors += 1
                log.debug("quota: settle batch failed: %s", _describe(exc))
                continue
            retry = []
            for item, result in zip(pending, results, strict=True):
                if isinstance(result, Exception):
                    retry.append(item)
                else:
                    self._count_settled(item, result)
            if not retry:
                return
            self.counters.backend_errors += 1
            pending = retry
        self.counters.reconcile_failures += len(pending)
        log.warning(
            "quota: %d settlements failed after retries (charged at estimate on expiry)", len(pending)
        )

    def _count_settled(self, item: tuple[Reservation, int], result: tuple[int, int]) -> None:
        outcome, _ = result
        reservation, actual = item
        counters = self.counters
        if outcome == SETTLE_APPLIED:
            counters.tokens_actual += actual
            if actual < reservation.estimate:
                counters.tokens_refunded += reservation.estimate - actual
            else:
                counters.tokens_overage += actual - reservation.estimate
        elif outcome == SETTLE_EXPIRED:
            counters.reservations_expired += 1
        elif outcome == SETTLE_NOOP:
            counters.reconcile_duplicates += 1


def duration_text(ms: int) -> bytes:
    """``x-ratelimit-reset-tokens`` in the duration form OpenAI uses (``250ms``, ``17.5s``, ``6m0s``,
    ``1h2m3s``), so clients that already parse OpenAI's headers parse ours."""
    ms = max(0, ms)
    if ms < 1000:
        return b"%dms" % ms
    minutes, ms = divmod(ms, 60000)
    hours, minutes = divmod(minutes, 60)
    seconds = (b"%d.%03d" % divmod(ms, 1000)).rstrip(b"0").rstrip(b".") + b"s"
    if hours:
        return b"%dh%dm" % (hours, minutes) + seconds
    if minutes:
        return b"%dm" % minutes + seconds
    return seconds


def _describe(exc: BaseException) -> str:
    # Exception text from valkey-py never includes the password; keep it to the class + message.
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
