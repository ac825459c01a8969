"""Pure bookkeeping of the supervisor's children: slots, crash backoff, start-up failures, child
records, pending reloads, and the references that keep fire-and-forget tasks alive.

Nothing here forks, signals or reads a pipe; the worker set (worker_set.py) does that with these.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway.config import Config
from gateway.process_protocol import StatusReader
from gateway.supervisor.policy import (
    RESTART_BACKOFF_BASE,
    RESTART_BACKOFF_CAP,
    STABLE_AFTER,
    STARTUP_FAILURE_LIMIT,
)
from shm.segment import MAX_WORKERS_LIMIT


def max_workers_for(target: int) -> int:
    """The most workers one generation may have (SIGTTIN and reloads included); rows cover two."""
    headroom = min(max(2 * target, target + 8), MAX_WORKERS_LIMIT // 2)
    return max(target, headroom)


class CrashBackoff:
    """Delay before replacing a crashed worker: 0, base, 2*base, ... capped; reset by a stable worker."""

    def __init__(self, base: float | None = None, cap: float | None = None) -> None:
        self.base = RESTART_BACKOFF_BASE if base is None else base
        self.cap = RESTART_BACKOFF_CAP if cap is None else cap
        self.streak = 0

    def next_delay(self, lifetime: float) -> float:
        if lifetime >= STABLE_AFTER:
            self.streak = 0
        self.streak += 1
        return 0.0 if self.streak == 1 else min(self.cap, self.base * 2 ** (self.streak - 2))


class StartupGuard:
    """Gives up when workers keep dying before any of them ever became ready (a broken deployment)."""

    def __init__(self, limit: int = STARTUP_FAILURE_LIMIT) -> None:
        self.limit = limit
        self.failures = 0

    def boot_failed(self) -> bool:
        """Count one worker that died before it was ready; True once that happened ``limit`` times."""
        self.failures += 1
        return self.failures >= self.limit


class SlotPool:
    """Shared-memory row indexes; the lowest free one is handed out so rows stay dense."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = set(range(capacity))

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("no free shared-memory worker row")
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def release(self, slot: int) -> None:
        if 0 <= slot < self.capacity:
            self._free.add(slot)


@dataclass(eq=False)
class Child:
    """A forked process (a worker, or the health prober) and what it last told us."""

    role: str  # "worker" | "health"
    pid: int
    slot: int
    generation: int
    status_fd: int
    started_at: float
    reader: StatusReader = field(default_factory=StatusReader)
    ready: bool = False
    revision: str | None = None
    mode: str | None = None
    capabilities: list[str] = field(default_factory=list)
    last_heartbeat: float | None = None
    retiring: bool = False
    kill_at: float | None = None
    # A worker's listening socket: (listen address, position in its generation); None for the prober.
    listener: tuple[str, int] | None = None

    def heartbeat_age(self, now: float) -> float:
        return now - (self.last_heartbeat if self.last_heartbeat is not None else self.started_at)


@dataclass(eq=False)
class PendingGeneration:
    """A reload in progress: the new config's workers booting next to the serving ones."""

    config: Config
    generation: int
    deadline: float
    admin_sock: socket.socket | None  # bound early when admin.listen changes, swapped in on promotion
    workers: int  # how many the new generation runs (SIGTTIN/SIGTTOU adjustments carried over)


_BACKGROUND: set[asyncio.Task] = set()


def in_background(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run a fire-and-forget coroutine, keeping a reference so the task is not collected mid-way."""
    task = asyncio.ensure_future(coroutine)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task
