"""The order in which requests waiting for a scarce slot are served (docs/configuration.md,
``tenants[].priority``).

Two classes: every interactive waiter goes before any batch waiter. Inside a class tenants take turns:
each waiting tenant has its own FIFO, and a ring of turns rotates over the tenants that are waiting. A
tenant that starts waiting joins the end of the ring, so a burst from one tenant delays another
tenant's first request by at most one turn of the bursting tenant (each tenant ahead in the ring gets
at most one turn first).

Pure: it orders opaque items (the upstream pool queues futures) and holds at most ``capacity`` of them.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class _Class(Generic[T]):
    """One priority class: a FIFO per waiting tenant and the ring of their turns."""

    __slots__ = ("queues", "turns")

    def __init__(self) -> None:
        self.queues: dict[str, deque[T]] = {}  # only tenants with at least one waiter
        self.turns: deque[str] = deque()  # the same tenants; the first one is served next

    def push(self, item: T, tenant: str) -> None:
        queue = self.queues.get(tenant)
        if queue is None:
            self.queues[tenant] = deque((item,))
            self.turns.append(tenant)
        else:
            queue.append(item)

    def pop(self) -> T:
        turns = self.turns
        tenant = turns.popleft()
        queue = self.queues[tenant]
        item = queue.popleft()
        if queue:
            turns.append(tenant)  # its next waiter comes after every other waiting tenant's
        else:
            del self.queues[tenant]
        return item

    def remove(self, item: T, tenant: str) -> bool:
        queue = self.queues.get(tenant)
        if queue is None:
            return False
        try:
            queue.remove(item)
        except ValueError:
            return False
        if not queue:
            del self.queues[tenant]
            self.turns.remove(tenant)
        return True


class FairQueue(Generic[T]):
    """Waiters by priority class (interactive, then batch) and, inside a class, round-robin by tenant.

    ``size`` is a plain attribute so a caller's "anyone waiting?" check costs one attribute read.
    """

    __slots__ = ("capacity", "size", "_classes")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.size = 0
        self._classes: tuple[_Class[T], _Class[T]] = (_Class(), _Class())  # indexed by ``batch``

    def __len__(self) -> int:
        return self.size

    def push(self, item: T, tenant: str, batch: bool = False) -> bool:
        """Queue ``item`` for ``tenant``; False (nothing queued) when ``capacity`` items already wait."""
        if self.size >= self.capacity:
            return False
        self._classes[batch].push(item, tenant)
        self.size += 1
        return True

    def pop(self) -> T | None:
        """The next item to serve, or None when nobody waits."""
        if not self.size:
            return None
        interactive, batch = self._classes
        self.size -= 1
        return interactive.pop() if interactive.turns else batch.pop()

    def remove(self, item: T, tenant: str, batch: bool = False) -> bool:
        """Take back a waiter that gave up; False when it is not queued (already served or removed)."""
        if self._classes[batch].remove(item, tenant):
            self.size -= 1
            return True
        return False
