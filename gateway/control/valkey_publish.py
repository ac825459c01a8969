"""Publish overlays to one Valkey key, holding a lease so that one control-plane instance publishes.

docs/fleet.md: gateways with ``routing.overlay_source: {kind: valkey, url, key}`` read ``key`` and
re-read it when ``<key>:events`` carries a message. Each round the instance that holds the lease:

1. renews the lease (``<key>:lease``, value = this instance's id, ``PX lease_ttl``); an instance
   without it tries ``SET <lease> <id> NX PX <ttl>``, so a standby takes over at its first round
   after the holder's lease expired (a holder that stops cleanly deletes it: the next round);
2. reads the key and publishes only when it does not already say what this round decided
   (semantic revision and envelope identity, the same guard as the file:
   :func:`gateway.control.publish.is_current`): ``SET key <envelope>``, then
   ``PUBLISH <key>:events <revision>``. The generation continues from what the key holds.

Every instance keeps observing and deciding while it stands by, so its stabilization memory is
warm when it takes over. The lease is checked just before the write, not fenced inside it: an
instance paused for longer than the lease between the two could write one stale revision, which
the new holder's next round replaces (it compares the key with its own decision every round).

Valkey errors raise :class:`ValkeyUnavailable`; the caller logs and retries next round. The
client is the quota backend's (:func:`gateway.valkey.client.create_client`), so URLs mean the
same there and here: ``valkeys://`` for TLS, ``user:password@`` for auth, ``/db``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from datetime import datetime
from typing import Any

from valkey.exceptions import ValkeyError

from gateway.control.publish import (
    NOTHING_PUBLISHED,
    Published,
    PublishResult,
    envelope_identity,
    is_current,
    judge_published,
    render_checked,
)
from gateway.control.spec import ControlSpec, ValkeyTarget
from gateway.overlay.valkey_source import events_channel, lease_key, redact_url
from gateway.valkey.client import create_client

log = logging.getLogger("gridgate.control")

VALKEY_TIMEOUT_S = 2.0  # per command; a round is never stuck on Valkey for long

# Renew only a lease we hold; release only a lease we hold (compare and act, atomically).
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class ValkeyUnavailable(Exception):
    """Valkey could not be reached or refused a command; the message says which and why."""


def instance_id() -> str:
    """Who holds the lease, readable in ``GET <key>:lease``: host, pid and a random tag."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Lease:
    """``SET NX PX`` lease with compare-and-renew and compare-and-release."""

    def __init__(self, client: Any, key: str, owner: str, ttl_s: float) -> None:
        self.client = client
        self.key = key
        self.owner = owner
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.held = False

    async def hold(self) -> bool:
        """Renew the lease if it is ours, else try to take it. True when we hold it now."""
        if self.held and await self.client.execute_command("EVAL", _RENEW, 1, self.key, self.owner, self.ttl_ms) == 1:
            return True
        taken = await self.client.execute_command("SET", self.key, self.owner, "NX", "PX", self.ttl_ms)
        self.held = taken is not None
        return self.held

    async def holder(self) -> str | None:
        value = await self.client.execute_command("GET", self.key)
        return None if value is None else value.decode(errors="replace")

    async def release(self) -> None:
        if self.held:
            self.held = False
            await self.client.execute_command("EVAL", _RELEASE, 1, self.key, self.owner)


class ValkeyPublisher:
    """Publishes to ``publish.valkey`` while holding its lease; see the module docstring."""

    def __init__(self, spec: ControlSpec, target: ValkeyTarget, *, owner: str | None = None) -> None:
        self.spec = spec
        self.key = target.key
        self.where = f"{redact_url(target.url)} key {target.key}"
        self.client = create_client(target.url, timeout_s=min(VALKEY_TIMEOUT_S, spec.interval))
        self.lease = Lease(self.client, lease_key(target.key), owner or instance_id(), spec.lease_ttl)
        self.held: Published = NOTHING_PUBLISHED  # what the key held at our last look (or our write)
        self._standing_by_for: str | None = None

    async def publish(self, document: dict[str, Any], now: datetime) -> PublishResult | None:
        """One round; None when nothing was written (the key is current, or another instance leads).

        Raises :class:`ValkeyUnavailable`, or :class:`~gateway.overlay.reasons.OverlayRejected`
        when the render does not validate.
        """
        try:
            return await self._publish(document, now)
        except (ValkeyError, OSError) as exc:
            raise ValkeyUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from None

    async def _publish(self, document: dict[str, Any], now: datetime) -> PublishResult | None:
        was_leading = self.lease.held
        if not await self.lease.hold():
            holder = await self.lease.holder()
            if was_leading or holder != self._standing_by_for:
                log.info("standing by: the lease %s is held by %s", self.lease.key, holder or "nobody (expired)")
            self._standing_by_for = holder
            return None
        if not was_leading:
            self._standing_by_for = None
            log.info("lease %s acquired as %s: publishing to %s", self.lease.key, self.lease.owner, self.where)
        data = await self.client.execute_command("GET", self.key)
        found = NOTHING_PUBLISHED if data is None else judge_published(data, self.where)
        # The generation never goes back, even if the key was deleted or overwritten.
        self.held = Published(found.revision, max(found.generation, self.held.generation), found.identity,
                              found.rendered_at)
        if is_current(self.spec, self.held, document, now):
            return None
        generation = self.held.generation + 1
        data, revision = render_checked(self.spec, document, generation, now)
        await self.client.execute_command("SET", self.key, data)
        await self.client.execute_command("PUBLISH", events_channel(self.key), revision)
        previous = self.held.revision
        self.held = Published(revision, generation, envelope_identity(self.spec), now)
        return PublishResult(revision, generation, previous)

    async def close(self) -> None:
        """Release the lease (so a standby takes over at its next round) and close the connection."""
        try:
            await self.lease.release()
        except (ValkeyError, OSError) as exc:
            log.warning("could not release the lease %s (it expires by itself): %s", self.lease.key, exc)
        finally:
            await self.client.aclose()
