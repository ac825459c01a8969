"""What the workers report and what the supervisor vouches for: readiness, heartbeats, sd_notify.

``Readiness`` keeps what the status messages say about each worker (its ``Child`` record), answers
``/readyz`` and ``/admin/overlay``, and owns every systemd notification: READY/STATUS once the serving
workers are ready, RELOADING/STOPPING, and the watchdog, which it feeds only while the workers'
heartbeats are fresh (a supervisor whose workers are hung must be restarted).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from gateway.notify import Notifier
from gateway.process_protocol import Heartbeat, OverlayRejected, Ready
from gateway.supervisor.lifecycle import Child
from gateway.supervisor.policy import HEARTBEAT_STALE_AFTER
from gateway.supervisor.worker_set import WorkerSet

log = logging.getLogger("gridgate.supervisor")


def readiness_of(serving: Sequence[Child], now: float) -> tuple[bool, str]:
    """(ready, reason) of a serving generation: every worker reported ready, none is stale."""
    if not serving:
        return False, "no worker is running"
    booting = [c for c in serving if not c.ready]
    if booting:
        return False, f"{len(booting)} of {len(serving)} workers have not reported ready"
    stale = [c for c in serving if c.heartbeat_age(now) > HEARTBEAT_STALE_AFTER]
    if stale:
        return False, f"worker pid {stale[0].pid} sent no heartbeat for {stale[0].heartbeat_age(now):.1f}s"
    return True, "ok"


def serving_revision(serving: Sequence[Child]) -> str | None:
    """The overlay revision most ready workers serve (they converge on one)."""
    revisions = Counter(c.revision for c in serving if c.ready and c.revision)
    return revisions.most_common(1)[0][0] if revisions else None


class Readiness:
    def __init__(self, workers: WorkerSet, notifier: Notifier, wake: Callable[[], None]) -> None:
        self._workers = workers
        self._notifier = notifier
        self._wake = wake
        self.ever_ready = False  # some generation was ready once: later crashes are not start-up failures
        self.last_overlay_rejection: dict[str, Any] | None = None
        self._stopping = False
        self._last_status = ""
        self._next_watchdog = 0.0
        self._watchdog_withheld = False

    # ------------------------------------------------------------------ status messages

    def on_ready(self, child: Child, message: Ready, now: float) -> None:
        first = not child.ready
        child.ready, child.last_heartbeat = True, now
        child.revision, child.mode = message.revision, message.mode
        if message.capabilities is not None:
            child.capabilities = message.capabilities
        if first:
            log.info("%s pid %d ready (overlay %s)", child.role, child.pid, child.revision[:12])
            self._wake()  # readiness and reloads advance without waiting for a tick

    def on_heartbeat(self, child: Child, message: Heartbeat, now: float) -> None:
        child.last_heartbeat = now

    def on_overlay_rejected(self, child: Child, message: OverlayRejected, now: float) -> None:
        self.last_overlay_rejection = {
            "pid": child.pid, "reason": message.reason, "retained_revision": message.retained_revision,
        }
        log.warning(
            "worker pid %d rejected the overlay (%s); still serving %s",
            child.pid, message.reason, message.retained_revision,
        )

    # ------------------------------------------------------------------ what the supervisor vouches for

    def readiness(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down"
        return readiness_of(self._workers.serving(), time.monotonic())

    def heartbeats_fresh(self, now: float) -> bool:
        return all(c.heartbeat_age(now) <= HEARTBEAT_STALE_AFTER for c in self._workers.serving() if c.ready)

    def status_text(self) -> str:
        serving = self._workers.serving()
        ready = sum(1 for c in serving if c.ready)
        revision = (serving_revision(serving) or "-")[:12]
        return f"{ready}/{len(serving)} workers ready, generation {self._workers.generation}, overlay {revision}"

    def overlay_report(self) -> dict[str, Any]:
        serving = self._workers.serving()
        ready = [c for c in serving if c.ready]
        revision = serving_revision(serving)
        leader = next((c for c in ready if c.revision == revision), None)
        return {
            "serving_revision": revision,
            "mode": leader.mode if leader else None,
            "capabilities": leader.capabilities if leader else [],
            "converged": len({c.revision for c in ready}) <= 1 and len(ready) == len(serving),
            "workers": [{"pid": c.pid, "serving_revision": c.revision} for c in serving],
            "last_rejection": self.last_overlay_rejection,
        }

    # ------------------------------------------------------------------ systemd

    def reloading(self) -> None:
        self._notifier.reloading("reloading configuration")

    def reloaded(self) -> None:
        """A reload ended (applied or refused): systemd expects READY=1 again."""
        self._notifier.ready(self.status_text())

    def stopping(self) -> None:
        self._stopping = True
        self._notifier.stopping("draining")

    def notify(self, now: float) -> None:
        """Every tick: READY=1 the first time all workers are ready, STATUS when it changes, the watchdog."""
        if not self._stopping:
            ready, _ = self.readiness()
            if ready and not self.ever_ready:
                self.ever_ready = True
                log.info("all %d workers ready", len(self._workers.serving()))
                self._notifier.ready(self.status_text())
            status = self.status_text()
            if status != self._last_status:
                self._last_status = status
                self._notifier.status(status)
        interval = self._notifier.watchdog_interval
        if interval is None:
            return
        fresh = self.heartbeats_fresh(now)
        self._note_watchdog(fresh, now)
        if fresh and now >= self._next_watchdog:
            self._notifier.watchdog()
            self._next_watchdog = now + interval

    def _note_watchdog(self, fresh: bool, now: float) -> None:
        """One line when the watchdog stops being fed (systemd will restart the service) and one when it resumes."""
        if not fresh and not self._watchdog_withheld:
            _, reason = readiness_of(self._workers.serving(), now)
            log.warning("watchdog: not pinging systemd (%s); it restarts the service after WatchdogSec unless the "
                        "worker recovers or is replaced first", reason)
        elif fresh and self._watchdog_withheld:
            log.info("watchdog: every worker's heartbeat is fresh again; pinging systemd")
        self._watchdog_withheld = not fresh

