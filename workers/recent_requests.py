"""The last requests' route evidence for the console (docs/console.md#requests): a bounded ring per
worker, on only while the console is (``admin.tokens`` set).

On the request path ``add`` puts the closed record in a bounded deque: one C call, nothing built. A closed
record holds no body, headers or exchange any more (``RequestRecord.close`` lets go of them; the access
log keeps records the same way), only the few fields its line needs. Once a second the worker's
background task (``report``) turns the records added since into ``RecentRequest`` messages for the
supervisor, as many per message as fit one atomic pipe write, and so at most ``RING_SIZE`` a second
whatever the rate.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from gateway.process_protocol import RecentRequest, RecentRequests, encode_status, try_send_status
from workers.request_record import RequestRecord

RING_SIZE = 64
_PER_MESSAGE = 16  # entries of at most ~230 bytes each stay well inside PIPE_BUF


class RequestRing:
    """``add`` is the bound ``append`` of a ``deque(maxlen=RING_SIZE)``: on the request path one C call,
    no Python frame, no counter (the oldest entry drops out by itself). The report finds where the
    new entries start by the identity of the last one it reported."""

    __slots__ = ("_entries", "add", "_last")

    def __init__(self) -> None:
        self._entries: deque[RequestRecord] = deque(maxlen=RING_SIZE)
        self.add: Callable[[RequestRecord], None] = self._entries.append
        self._last: RequestRecord | None = None  # the newest entry reported (held: its identity stays unique)

    def pending(self) -> list[RecentRequest]:
        """The entries added since the last call, oldest first (at most the ring's size), as messages' rows."""
        entries = list(self._entries)
        last = self._last
        if last is not None:
            for at in range(len(entries) - 1, -1, -1):
                if entries[at] is last:
                    del entries[: at + 1]
                    break  # not found: it was overwritten, so every entry held is new
        if not entries:
            return []
        self._last = entries[-1]
        offset = time.time() - time.perf_counter()  # perf_counter seconds -> Unix seconds
        return [_row(record, offset) for record in entries]

    def report(self, fd: int) -> None:
        """Send what was added since the last report; a full pipe drops the rest of it (the console shows
        the last requests, not every one)."""
        rows = self.pending()
        for start in range(0, len(rows), _PER_MESSAGE):
            message = RecentRequests(rows[start:start + _PER_MESSAGE])
            if encode_status(message) is None:  # oversized names: send them one by one, skip what cannot go
                for row in message.requests:
                    try_send_status(fd, RecentRequests([row]))
            elif not try_send_status(fd, message):
                return


def _row(record: RequestRecord, offset: float) -> RecentRequest:
    ended, t_start, request_id, route = record.ended, record.t_start, record.request_id, record.route
    return RecentRequest(
        ended_at=round(ended + offset, 3), request_id=None if request_id is None else request_id.decode("latin-1"),
        tenant=record.tenant, model=record.served, provider=record.provider,
        group=None if route is None else route.selection_group, status=record.status,
        latency_ms=None if t_start is None else round((ended - t_start) * 1000, 3),
        tokens_prompt=record.tokens_prompt, tokens_completion=record.tokens_completion, cost_nusd=record.cost_nusd,
        attempts=record.attempts, error=record.error)
