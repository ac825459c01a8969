"""Who holds a reservation: the worker identity every reservation id starts with. Pure.

A reservation id is ``<owner tag><counter>``. The tag names the gateway instance, the worker's
generation and slot, and its pid: a replacement in the same slot and generation is another process,
and its reservations must survive the sweep of its dead predecessor. When the supervisor reaps a
worker it settles the reservations whose ids start with that worker's tag (``QuotaLedger.sweep``),
instead of leaving them to hold budget and concurrency slots until ``reservation_timeout``.

``GATEWAY_INSTANCE`` is random and made when this module is first imported. The supervisor imports
it before it forks (``gateway.supervisor.quota_backend``), so its workers inherit the same value;
two gateways sharing one Valkey never share it, so neither can sweep the other's reservations.
"""

from __future__ import annotations

import os

GATEWAY_INSTANCE = os.urandom(4).hex()


def owner_tag(generation: int, slot: int, pid: int, instance: str = GATEWAY_INSTANCE) -> bytes:
    """The prefix of every reservation id of one worker process. Ends with ``.`` so that no tag is
    the prefix of another (pid 42 vs 421); digits, hex and dots only (safe in a ``MATCH`` glob)."""
    return b"%s.%d.%d.%d." % (instance.encode(), generation, slot, pid)
