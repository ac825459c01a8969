"""A clock a test moves by hand: ``QuotaLedger(clock=...)`` passes it to the ledger's script as its now (instead
of Valkey's ``TIME``), so a test rolls windows and passes deadlines by advancing it, never by waiting."""

from __future__ import annotations

import time


class TestClock:
    """Unix seconds, standing still until ``advance``. It starts at a whole second of the real clock (keys'
    TTLs are Valkey's real time: a clock near the real one keeps them meaningful)."""

    __test__ = False  # not a pytest test class

    def __init__(self, start: float | None = None) -> None:
        self.now = float(int(time.time())) if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now

    def to_next(self, window_s: float, into: float = 0.0) -> float:
        """Move to ``into`` seconds past the start of the next epoch-aligned ``window_s`` window."""
        self.now = (self.now // window_s + 1) * window_s + into
        return self.now
