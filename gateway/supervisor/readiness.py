"""What the workers tell the supervisor, and what it vouches for: readiness, heartbeats, sd_notify.

``ReadinessMixin`` is one part of ``Supervisor`` (arbiter.py). Each child writes status messages to a
pipe (workers/status.py) read on the loop; ``/readyz``, the systemd READY/STATUS lines and the
watchdog all follow from them.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any

from gateway.supervisor.lifecycle import Child
from gateway.supervisor.policy import HEARTBEAT_STALE_AFTER, KILL_GRACE, WAKE

log = logging.getLogger("gridgate.supervisor")


class ReadinessMixin:
    """Status pipes in; readiness, heartbeat freshness and systemd notifications out."""

    # ------------------------------------------------------------------ status pipes

    def _read_status(self, child: Child) -> None:
        try:
            data = os.read(child.status_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # EOF: the child is gone; not ready from now on, even before SIGCHLD reaps it
            assert self._loop is not None
            self._loop.remove_reader(child.status_fd)
            child.ready = False
            return
        now = time.monotonic()
        for message in child.reader.feed(data):
            self._apply_status(child, message, now)

    def _apply_status(self, child: Child, message: dict[str, Any], now: float) -> None:
        kind = message.get("kind")
        if kind == "heartbeat":
            child.last_heartbeat = now
        elif kind == "ready":
            first = not child.ready
            child.ready, child.last_heartbeat = True, now
            child.revision = message.get("revision")
            self.last_good_overlay.observe(self.config, child.revision)
            child.mode = message.get("mode")
            if "capabilities" in message:
                child.capabilities = list(message["capabilities"])
            if first:
                log.info("%s pid %d ready (overlay %s)", child.role, child.pid, (child.revision or "-")[:12])
                if self._events is not None:
                    self._events.put_nowait(WAKE)  # readiness and reloads advance without waiting a tick
        elif kind == "overlay_rejected":
            self.last_overlay_rejection = {
                "pid": child.pid,
                "reason": message.get("reason"),
                "retained_revision": message.get("retained_revision"),
            }
            log.warning(
                "worker pid %d rejected the overlay (%s); still serving %s",
                child.pid, message.get("reason"), message.get("retained_revision"),
            )
        elif kind == "draining":
            child.retiring = True
            if child.kill_at is None:  # the worker decided to drain on its own
                child.kill_at = now + self.config.timeouts.graceful_shutdown + KILL_GRACE

    # ------------------------------------------------------------------ readiness

    def readiness(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down"
        serving = self._serving()
        if not serving:
            return False, "no worker is running"
        booting = [c for c in serving if not c.ready]
        if booting:
            return False, f"{len(booting)} of {len(serving)} workers have not reported ready"
        now = time.monotonic()
        stale = [c for c in serving if c.heartbeat_age(now) > HEARTBEAT_STALE_AFTER]
        if stale:
            return False, f"worker pid {stale[0].pid} sent no heartbeat for {stale[0].heartbeat_age(now):.1f}s"
        return True, "ok"

    def heartbeats_fresh(self) -> bool:
        now = time.monotonic()
        return all(c.heartbeat_age(now) <= HEARTBEAT_STALE_AFTER for c in self._serving() if c.ready)

    def _status_text(self) -> str:
        serving = self._serving()
        ready = [c for c in serving if c.ready]
        revisions = Counter(c.revision for c in ready if c.revision)
        revision = revisions.most_common(1)[0][0][:12] if revisions else "-"
        return f"{len(ready)}/{len(serving)} workers ready, generation {self.generation}, overlay {revision}"

    # ------------------------------------------------------------------ systemd

    def _notify_systemd(self, now: float) -> None:
        if not self._stopping:
            ready, _ = self.readiness()
            if ready and not self._announced_ready:
                self._announced_ready = self._ever_ready = True
                self._startup_failures = 0
                log.info("all %d workers ready", len(self._serving()))
                self.notifier.ready(self._status_text())
            elif ready:
                self._ever_ready = True
            status = self._status_text()
            if status != self._last_status:
                self._last_status = status
                self.notifier.status(status)
        interval = self.notifier.watchdog_interval
        # The watchdog vouches for the workers too: a supervisor whose workers are hung must be restarted.
        if interval is not None and now >= self._next_watchdog and self.heartbeats_fresh():
            self.notifier.watchdog()
            self._next_watchdog = now + interval
