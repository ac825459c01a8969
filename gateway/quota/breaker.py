"""The quota backend's circuit breaker. Pure: the gate reports how its round trips went.

Closed: admissions go to the backend; ``failures_to_open`` consecutive failed round trips open it.
Open: no admission touches the backend (the gate answers with its ``on_backend_error`` policy at once,
so a dead backend sees no thundering herd); meanwhile the gate probes the backend, and the first
answer closes the breaker again. There is no fixed cool-down: an outage costs what it lasts plus at
most one probe interval.
"""

from __future__ import annotations


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
