"""Each provider's share of the last minutes' traffic, from the host's cumulative request counters.

The console samples the per-cluster request totals (shared memory, summed over workers) whenever it
is looked at, keeps a bounded series of them, and reports each cluster's part of the requests between
the oldest sample still inside the window and now. Pure: the caller passes the totals and the clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

WINDOW_S = 300.0
MIN_STEP_S = 2.0  # at most one kept sample per this many seconds: the series stays under 151 entries


@dataclass(frozen=True, slots=True)
class Shares:
    by_cluster: dict[str, float]  # 0..1; empty when no request was counted in the window
    requests: int  # requests counted in the window, all clusters together
    window_s: float  # how many seconds the window really covers (less right after start)


class TrafficShare:
    def __init__(self, *, window_s: float = WINDOW_S, min_step_s: float = MIN_STEP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._min_step_s = min_step_s
        self._clock = clock
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def observe(self, totals: Mapping[str, int]) -> Shares:
        """Record ``totals`` (cumulative requests per cluster) and answer the shares up to them."""
        now = self._clock()
        current = dict(totals)
        if not self._samples or now - self._samples[-1][0] >= self._min_step_s:
            self._samples.append((now, current))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self._window_s:
            self._samples.popleft()  # the oldest kept sample is the last one at or before the window start
        start, base = self._samples[0]
        counted = {name: max(0, count - base.get(name, 0)) for name, count in current.items()}
        total = sum(counted.values())
        shares = {} if total == 0 else {name: count / total for name, count in counted.items()}
        return Shares(shares, total, min(self._window_s, now - start))
