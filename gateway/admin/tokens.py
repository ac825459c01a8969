"""Admin API tokens (``admin.tokens``, docs/keys.md): who is calling, with which scopes, and the brake
on an address that keeps presenting bad tokens.

A presented token is hashed once and compared with every configured digest in constant time, with
no early exit, so the time taken says nothing about which token (or which prefix) came close. Only
digests are configured; the token itself is never stored, logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config import AdminToken
from gateway.identity.auth import KEY_DIGEST_PREFIX

_BEARER = b"bearer "


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated admin caller: the token's name (the audit log's actor) and its scopes."""

    name: str
    scopes: frozenset[str]


class AdminTokens:
    """The configured tokens of one config; built once per config."""

    def __init__(self, tokens: Sequence[AdminToken]) -> None:
        self._tokens = [(bytes.fromhex(t.key[len(KEY_DIGEST_PREFIX):]), Caller(t.name, frozenset(t.scopes)))
                        for t in tokens]

    @property
    def configured(self) -> bool:
        return bool(self._tokens)

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller a ``Authorization: Bearer <token>`` header names, or None (missing or unknown)."""
        token = bearer_token(authorization)
        return None if token is None else self.caller_by_digest(token_digest(token))

    def caller_by_digest(self, digest: bytes) -> Caller | None:
        """The caller whose token hashes to ``digest`` (a console session keeps only the digest)."""
        found = None
        for stored, caller in self._tokens:  # every digest is compared: no early exit
            if hmac.compare_digest(stored, digest):
                found = caller
        return found


def token_digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def bearer_token(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    value = authorization.strip().encode("latin-1", "replace")
    if len(value) <= len(_BEARER) or value[: len(_BEARER)].lower() != _BEARER:
        return None
    return value[len(_BEARER):].strip() or None


class FailedTokenThrottle:
    """Slows an address that presents bad tokens: after ``limit`` failures within ``window_s``, every
    request from it gets 429 until that window ends. Bounded to ``max_addresses`` addresses (the
    oldest windows are forgotten first), so a flood from many addresses cannot grow it."""

    def __init__(self, *, limit: int = 10, window_s: float = 60.0, max_addresses: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit
        self._window_s = window_s
        self._max = max_addresses
        self._clock = clock
        self._windows: dict[str, tuple[float, int]] = {}  # address -> (window start, failures)

    def retry_after(self, address: str) -> int | None:
        """Seconds until ``address`` may try again, or None when it is not being slowed."""
        window = self._windows.get(address)
        if window is None:
            return None
        start, failures = window
        left = start + self._window_s - self._clock()
        if left <= 0:
            del self._windows[address]
            return None
        return max(1, int(left + 0.999)) if failures >= self._limit else None

    def failed(self, address: str) -> None:
        now = self._clock()
        start, failures = self._windows.pop(address, (now, 0))
        if now - start >= self._window_s:
            start, failures = now, 0
        self._windows[address] = (start, failures + 1)  # re-inserted: the dict stays oldest-first
        while len(self._windows) > self._max:
            del self._windows[next(iter(self._windows))]
