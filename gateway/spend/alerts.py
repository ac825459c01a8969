"""Spend alerts (docs/pricing.md, "Alerts"): a budget threshold crossed for the first time in its period.

A worker calls ``publish_alert`` where it detects the crossing (the settlement of the request that
crossed it). The alert goes to the supervisor over the worker's status pipe (a ``spend_alert``
message, gateway/process_protocol.py) and the supervisor posts it to ``pricing.alerts_webhook``, with
retries (gateway/supervisor/spend_alerts.py). Nothing here blocks or raises: an alert the pipe cannot
take now waits in the worker's outbox (bounded, ``OUTBOX_SIZE``) and is sent again each heartbeat.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

OUTBOX_SIZE = 1024


class SpendAlert(msgspec.Struct, frozen=True):
    """One threshold crossing: ``budget`` names the limit (a rule's or a key's), ``scope`` what it
    counts (tenant, key, ...), ``threshold`` the fraction of ``limit_nusd`` that ``spent_nusd`` reached,
    ``period_start`` the start of the budget's period (RFC 3339)."""

    tenant: str
    scope: str  # "rule team-a" | "key <kid or alias>"
    budget: str  # "$5.00/1d"
    period_start: str  # RFC 3339
    threshold: float
    spent_nusd: int
    limit_nusd: int


class AlertOutbox:
    """A worker's alerts not yet taken by its status pipe. ``send`` writes one message and says whether
    the pipe took it (it never blocks)."""

    def __init__(self, send: Callable[[SpendAlert], bool], size: int = OUTBOX_SIZE,
                 noted: Callable[[SpendAlert], None] | None = None) -> None:
        self._send = send
        self._noted = noted  # told of each alert once, as it is put (the worker's access log)
        self._pending: deque[SpendAlert] = deque()
        self._size = size
        self.dropped = 0  # alerts lost because the outbox was full (the supervisor was not reading)

    def put(self, alert: SpendAlert) -> None:
        if self._noted is not None:
            self._noted(alert)
        if self._pending or not self._send(alert):
            if len(self._pending) >= self._size:
                self.dropped += 1
                return
            self._pending.append(alert)

    def retry(self) -> None:
        """Send what waits, in order, until the pipe refuses one (each heartbeat, and at drain)."""
        pending = self._pending
        while pending and self._send(pending[0]):
            pending.popleft()

    def __len__(self) -> int:
        return len(self._pending)


def alert_text(alert: SpendAlert) -> str:
    """The access log's ``spend_alert``: ``rule team-a spend $5.00/1d 80%``."""
    return f"{alert.scope} spend {alert.budget} {alert.threshold * 100:g}%"


_outbox: AlertOutbox | None = None
# The last alerts this process published (at most ``PUBLISHED_KEPT``; oldest first): for logs of a
# worker run on its own, and for tests that drive the quota gate without a supervisor.
published: list[SpendAlert] = []
PUBLISHED_KEPT = 256


def install_outbox(outbox: AlertOutbox | None) -> None:
    """The worker's outbox (workers/spend_tracker.py installs it at start); None: alerts go nowhere."""
    global _outbox
    _outbox = outbox


def publish_alert(alert: SpendAlert) -> None:
    """Report a threshold crossing to the supervisor; never blocks, never raises."""
    published.append(alert)
    if len(published) > PUBLISHED_KEPT:
        del published[:PUBLISHED_KEPT // 2]
    outbox = _outbox
    if outbox is not None:
        outbox.put(alert)

