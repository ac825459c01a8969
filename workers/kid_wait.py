"""Waits on an unknown kid (docs/identity.md, "Rotation"): one shared wait per issuer and kid per worker.

A token naming a kid its issuer's key set lacks has already asked the supervisor for a refetch
(workers/jwt_gate.py, ``JwksWanted``); with ``auth.jwt[].unknown_kid_wait`` its request waits, on
the head and before its body is read, until that issuer's key set changes (the supervisor wrote the
refetched set and the worker read it) or the bound passes; then it is verified again. Every request
naming that kid meanwhile waits on the same future (no herd: one refetch, one wake-up), and the waits
are bounded (``MAX_KIDS`` distinct kids, ``MAX_WAITERS`` requests per kid): past that, a request is
refused at once, as with no wait at all, so made-up kids cannot pile up waiting connections.
"""

from __future__ import annotations

import asyncio

MAX_KIDS = 32  # distinct (issuer, kid) waits at once per worker
MAX_WAITERS = 256  # requests waiting on one kid at once


class _Wait:
    __slots__ = ("future", "timer", "waiters")

    def __init__(self, future: asyncio.Future[None], timer: asyncio.TimerHandle) -> None:
        self.future = future
        self.timer = timer
        self.waiters = 0


class KidWaits:
    """One worker's waits; ``bounds``: each issuer's ``unknown_kid_wait`` in seconds (0: none)."""

    __slots__ = ("bounds", "_waits")

    def __init__(self, bounds: dict[str, float]) -> None:
        self.bounds = {name: bound for name, bound in bounds.items() if bound > 0}
        self._waits: dict[tuple[str, str], _Wait] = {}

    def __len__(self) -> int:
        return len(self._waits)

    def wait_for(self, issuer: str | None, kid: str) -> asyncio.Future[None] | None:
        """What a request naming ``kid`` of ``issuer`` waits on (done when the issuer's key set changed
        or the bound passed), or None: no wait (none configured, or the bounds are reached)."""
        bound = self.bounds.get(issuer) if issuer is not None else None
        if bound is None:
            return None
        key = (issuer, kid)
        wait = self._waits.get(key)
        if wait is None:
            if len(self._waits) >= MAX_KIDS:
                return None
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop to wait on (a gate driven synchronously): no wait
                return None
            wait = self._waits[key] = _Wait(loop.create_future(), loop.call_later(bound, self._end, key))
        if wait.waiters >= MAX_WAITERS:
            return None
        wait.waiters += 1
        return wait.future

    def keys_changed(self, issuer: str) -> None:
        """The issuer's key set changed: every request waiting on one of its kids is verified again."""
        for key in [key for key in self._waits if key[0] == issuer]:
            self._end(key)

    def _end(self, key: tuple[str, str]) -> None:
        wait = self._waits.pop(key, None)
        if wait is not None:
            wait.timer.cancel()
            if not wait.future.done():
                wait.future.set_result(None)
