"""The quota backend's circuit breaker, its probe, and the ``on_backend_error`` policy.

Closed: admissions go to the backend; ``failures_to_open`` consecutive failed round trips open it.
Open: no admission touches the backend (the gate answers with its ``on_backend_error`` policy at once,
so a dead backend sees no thundering herd); meanwhile one task per worker probes the backend every
``probe_interval_s``, and the first answer closes the breaker again. There is no fixed cool-down: an
outage costs what it lasts plus at most one probe interval.

``Breaker`` is the state alone (pure: its owner reports how round trips went); ``BackendBreaker`` is the
one a worker runs: the state, the counters, the policy's answer and the probe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Literal

from gateway.quota.admission import ALLOWED_UNMETERED, REJECTED, Admission
from gateway.quota.counters import QuotaCounters
from gateway.valkey.client import BACKEND_ERRORS

if TYPE_CHECKING:
    from gateway.quota.ledger import QuotaLedger

log = logging.getLogger("gridgate.quota")

BackendPolicy = Literal["reject", "allow"]


class Breaker:
    __slots__ = ("failures_to_open", "is_open", "_failures")

    def __init__(self, failures_to_open: int = 3) -> None:
        if failures_to_open < 1:
            raise ValueError("failures_to_open must be >= 1")
        self.failures_to_open = failures_to_open
        self.is_open = False
        self._failures = 0

    def failure(self) -> bool:
        """A round trip failed; True when this failure opened the breaker."""
        self._failures += 1
        if self.is_open or self._failures < self.failures_to_open:
            return False
        self.is_open = True
        return True

    def trip(self) -> bool:
        """Open now (e.g. the backend is unusable at start); True if it was closed."""
        opened = not self.is_open
        self.is_open = True
        self._failures = max(self._failures, self.failures_to_open)
        return opened

    def success(self) -> bool:
        """The backend answered; True when this closed the breaker."""
        self._failures = 0
        closed = self.is_open
        self.is_open = False
        return closed


class BackendBreaker(Breaker):
    """A worker's breaker: every failed round trip (an admit batch, a settle batch, a probe) is reported
    here, counted, and may open it; while it is open ``unavailable`` is every admission's answer and the
    probe runs. ``call_timeout_s``: the client's reply timeout (a probe may take a few of them)."""

    __slots__ = ("_ledger", "_counters", "policy", "_probe_interval_s", "_probe_timeout_s", "_probe")

    def __init__(self, ledger: QuotaLedger, counters: QuotaCounters, *, policy: BackendPolicy = "reject",
                 failures_to_open: int = 3, probe_interval_s: float = 0.1, call_timeout_s: float = 0.25) -> None:
        if policy not in ("reject", "allow"):
            raise ValueError("quota.on_backend_error: must be reject or allow")
        super().__init__(failures_to_open)
        self._ledger = ledger
        self._counters = counters
        self.policy = policy
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = max(call_timeout_s * 4, 1.0)
        self._probe: asyncio.Task[None] | None = None

    def unavailable(self) -> Admission:
        """The policy's answer to an admission the backend cannot decide (counted)."""
        if self.policy == "allow":
            self._counters.backend_error_allowed += 1
            return ALLOWED_UNMETERED
        self._counters.backend_error_rejected += 1
        return REJECTED

    def failed(self, why: str) -> None:
        """A round trip failed (``why``: for the log line when this opens the breaker)."""
        self._counters.backend_errors += 1
        if self.failure():
            log.warning("quota backend failing (%s); breaker open, policy %s applies", why, self.policy)
            self._opened()

    def down(self, why: str) -> None:
        """The backend is unusable now (at start): open at once."""
        log.warning("quota backend unavailable at start (%s); policy %s applies", why, self.policy)
        self._counters.backend_errors += 1
        if self.trip():
            self._opened()

    def answered(self) -> None:
        """A round trip succeeded."""
        if self.success():
            self._closed()

    def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None

    def _opened(self) -> None:
        self._counters.breaker_opened += 1
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_closed())

    def _closed(self) -> None:
        self._counters.breaker_closed += 1
        log.warning("quota backend answers again; breaker closed")

    async def _probe_until_closed(self) -> None:
        """One cheap command every probe interval while the breaker is open; the first answer closes
        it (after reloading the script: a restarted server has lost it)."""
        while self.is_open:
            await asyncio.sleep(self._probe_interval_s)
            try:
                async with asyncio.timeout(self._probe_timeout_s):
                    await self._ledger.ping()
                    await self._ledger.load_script()
            except BACKEND_ERRORS:
                self._counters.backend_errors += 1
                continue
            self.answered()
