"""What the supervisor and its children agree on: exit codes, the context a child is forked with, and
the status messages a worker sends back.

Both sides import this module and nothing else of each other, so the supervisor never loads the data
plane (uvloop, the proxy, the quota client) and the workers never load the supervisor.

The status channel is one pipe per child, written by the child, read on the supervisor's loop. Each
message is one JSON line tagged by ``kind`` (msgspec's tagged union). A write is one ``os.write`` of
at most ``PIPE_BUF`` bytes, so it is atomic; the write end is non-blocking and a full pipe drops the
message: a stuck supervisor must never stall a worker (heartbeats are resent every second anyway).
"""

from __future__ import annotations

import os
import select
from dataclasses import dataclass

import msgspec

from gateway.config import Config
from gateway.spend.alerts import SpendAlert
from shm.cache_index import CacheIndex
from shm.keys import KeyTable
from shm.segment import Segment

# ---------------------------------------------------------------------------------------- exit codes

EXIT_OK = 0  # drained and stopped as asked
EXIT_CRASHED = 1  # an unexpected error
EXIT_CANNOT_BIND = 3  # a worker run on its own cannot bind its listening socket (the port is taken)


# ---------------------------------------------------------------------------------------- fork context


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """Everything a child process starts from, handed over at fork time (nothing is pickled)."""

    config: Config
    # Row index in shared memory; unique among the live workers (old and new generations included).
    # -1 for the health process, which has no worker row.
    slot: int
    # Numbers the config generations; lets the supervisor tell old workers from new ones.
    generation: int
    # The shared-memory segment created before fork; None for a worker run on its own (profiling).
    segment: Segment | None
    # Write end of this child's status pipe (``send_status``).
    status_fd: int
    # The data-plane listening socket the supervisor bound for this worker's position; the previous
    # generation's worker at that position serves on the same socket until it drains, so a reload
    # closes no listener. None: bind your own (a worker run on its own; the health process has none).
    listen_fd: int | None
    # The quota backend (the embedded Valkey's URL when quota.backend.kind is embedded); None: no quota.
    quota_url: str | None
    # Extra regions of the segment and how they were sized: a reload cannot resize shared memory, so
    # a worker of a newer config must use the sizes the segment was created with, not its config's.
    affinity_region: str
    affinity_capacity: int
    metrics_region: str
    # The supervisor's cluster registry at fork time: position = the cluster's metrics index. It only
    # ever grows, so every worker's copy is a prefix of the one the supervisor renders /metrics with.
    metric_clusters: tuple[str, ...]
    # The last overlay the workers accepted, for a worker that starts while the file is invalid.
    overlay_fallback: bytes | None = None
    # The supervisor's tenant registry at fork time (the same rules as ``metric_clusters``): position =
    # the tenant's slot in the per-tenant token counters. Empty: a worker run alone uses its config's.
    metric_tenants: tuple[str, ...] = ()
    # The supervisor's fallback-edge registry at fork time (same rules): position = the (from, to) edge's
    # index in the fallback counters (docs/models.md). Empty: a worker run alone uses its config's.
    metric_fallbacks: tuple[str, ...] = ()
    # The host's managed-key table (shm.keys), created before the first fork; None: managed keys are
    # off (no store configured at start) or a worker runs on its own. Read it with gateway.keys.lookup.
    key_table: KeyTable | None = None
    # The response cache's host index (shm.cache_index), created before the first fork; None: the cache or its
    # index is off, its Valkey is a Cluster, or a worker runs on its own. Read it in workers/response_cache.py.
    cache_index: CacheIndex | None = None
    # Where the daily spend rollups go (docs/pricing.md): the quota backend's Valkey, else the managed
    # keys' ``auth.store``; None: rollups are off (no store configured).
    spend_url: str | None = None


# ---------------------------------------------------------------------------------------- status messages


class Ready(msgspec.Struct, tag="ready", tag_field="kind", frozen=True, omit_defaults=True):
    """Serving a snapshot: sent at start and after every overlay change."""

    revision: str
    mode: str
    # None when the list did not fit in one atomic write: the supervisor keeps the previous one.
    capabilities: list[str] | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="kind", frozen=True):
    """Once a second while the worker's event loop is responsive."""


class OverlayRejected(msgspec.Struct, tag="overlay_rejected", tag_field="kind", frozen=True):
    """An overlay reload was refused; the worker keeps serving ``retained_revision``."""

    reason: str
    retained_revision: str


class Draining(msgspec.Struct, tag="draining", tag_field="kind", frozen=True):
    """Stopped accepting; finishing the requests in flight."""


class SpendAlertReport(msgspec.Struct, tag="spend_alert", tag_field="kind", frozen=True):
    """A spend threshold was crossed (gateway/spend/alerts.py): the supervisor posts it to the webhook."""

    alert: SpendAlert


class SpendCounts(msgspec.Struct, tag="spend_counts", tag_field="kind", frozen=True, omit_defaults=True):
    """The worker's spend counters that changed (cumulative for its life: a lost message loses nothing):
    ``series`` as (tenant, model, key or "", nano-USD); ``unpriced`` the price book's counts (zero,
    estimated, rejected); ``alerts_dropped`` alerts its outbox could not keep; ``rollups_dropped``
    requests not rolled up (its batch was full), ``rollup_flushes_failed`` flushes the store refused."""

    series: list[tuple[str, str, str, int]] = []
    unpriced: tuple[int, int, int] | None = None
    alerts_dropped: int = 0
    rollups_dropped: int = 0
    rollup_flushes_failed: int = 0


class RecentRequest(msgspec.Struct, array_like=True, frozen=True):
    """One ended request's route evidence for the console (docs/console.md#requests): never a prompt,
    a body or a key. ``ended_at``: Unix seconds; ``latency_ms``: None when it never started."""

    ended_at: float
    request_id: str | None
    tenant: str | None
    model: str | None
    provider: str | None
    group: int | None
    status: int
    latency_ms: float | None
    tokens_prompt: int | None
    tokens_completion: int | None
    cost_nusd: int | None
    attempts: int
    error: str | None


class RecentRequests(msgspec.Struct, tag="recent_requests", tag_field="kind", frozen=True):
    """Requests that ended since the worker's last report, oldest first (its ring holds the last few)."""

    requests: list[RecentRequest]



class JwksWanted(msgspec.Struct, tag="jwks_wanted", tag_field="kind", frozen=True):
    """A token named a kid the issuer's key set lacks (docs/identity.md): the supervisor refetches that
    issuer's JWKS, at most once per 30 s per issuer however many workers ask."""

    issuer: str  # the auth.jwt entry's name


StatusMessage = (Ready | Heartbeat | OverlayRejected | Draining | SpendAlertReport | SpendCounts | JwksWanted
                 | RecentRequests)

PIPE_BUF = select.PIPE_BUF
_REASON_LIMIT = 1024  # an overlay rejection reason is cut to this many characters if it would not fit

_encode = msgspec.json.Encoder().encode
_decode_line = msgspec.json.Decoder(StatusMessage).decode


def encode_status(message: StatusMessage) -> bytes | None:
    """One JSON line of at most PIPE_BUF bytes, shortening the bulky field if needed; None if it cannot fit."""
    data = _encode(message) + b"\n"
    if len(data) <= PIPE_BUF:
        return data
    if isinstance(message, Ready):
        data = _encode(msgspec.structs.replace(message, capabilities=None)) + b"\n"
    elif isinstance(message, OverlayRejected):
        data = _encode(msgspec.structs.replace(message, reason=message.reason[:_REASON_LIMIT] + "...")) + b"\n"
    return data if len(data) <= PIPE_BUF else None


def send_status(fd: int, message: StatusMessage) -> None:
    """Write one message to the status pipe; never blocks, never raises (a full or closed pipe drops it)."""
    try_send_status(fd, message)


def try_send_status(fd: int, message: StatusMessage) -> bool:
    """``send_status`` that says whether the message is done with: False only when the pipe is full now
    (the caller may send it again later); a message too large or a closed pipe count as done."""
    data = encode_status(message)
    if data is None:
        return True
    try:
        os.write(fd, data)
    except BlockingIOError:
        return False
    except OSError:  # BrokenPipeError (supervisor gone), EBADF
        pass
    return True


class StatusReader:
    """Splits the bytes read from one status pipe into messages; undecodable lines are skipped."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[StatusMessage]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        messages: list[StatusMessage] = []
        for line in lines:
            try:
                messages.append(_decode_line(line))
            except msgspec.DecodeError:  # includes ValidationError: an unknown kind or a wrong field
                continue
        return messages
