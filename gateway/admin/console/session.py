"""Console sessions (docs/console.md#security): a signed-in admin token becomes a random session id in
an HttpOnly, SameSite=Strict cookie, with a CSRF token of its own for every change.

Pure bookkeeping, no I/O. The book keeps, per session, the token's digest (never the token) so the
caller and its scopes are looked up in the running config on every request: a token removed from
``admin.tokens`` ends its sessions at once. Sessions are keyed by a hash of their id, expire after
``ttl_s`` however busy, and are bounded in number (the oldest go first).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE_NAME = "console_session"
COOKIE_PATH = "/console"
DEFAULT_TTL_S = 8 * 3600
MAX_SESSIONS = 1024


@dataclass(frozen=True, slots=True)
class Session:
    token_digest: bytes  # sha256 of the admin token signed in with
    csrf: str  # sent back on every change (header X-CSRF-Token or form field csrf)
    expires_at: float  # on the book's clock


class SessionBook:
    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._max = max_sessions
        self._clock = clock
        self._sessions: dict[bytes, Session] = {}  # sha256(session id) -> session, oldest first
        self._expired: list[Session] = []  # ended by their expiry since the last take_expired()

    def open(self, token_digest: bytes) -> str:
        """A new session for the token; returns its id (the cookie's value, not kept here)."""
        session_id = secrets.token_urlsafe(32)
        self._sweep()
        self._sessions[_key(session_id)] = Session(token_digest, secrets.token_urlsafe(32),
                                                   self._clock() + self.ttl_s)
        while len(self._sessions) > self._max:
            del self._sessions[next(iter(self._sessions))]
        return session_id

    def find(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        key = _key(session_id)
        session = self._sessions.get(key)
        if session is not None and session.expires_at <= self._clock():
            del self._sessions[key]
            self._expired.append(session)
            return None
        return session

    def take_expired(self) -> list[Session]:
        """The sessions that ended by expiry since the last call (for the audit log), found when their
        cookie came back or a sign-in swept them."""
        self._sweep()
        expired, self._expired = self._expired, []
        return expired

    def _sweep(self) -> None:
        """Drop the expired sessions at the front (every session lives ``ttl_s``: oldest first)."""
        now = self._clock()
        while self._sessions:
            key = next(iter(self._sessions))
            if self._sessions[key].expires_at > now:
                return
            self._expired.append(self._sessions.pop(key))

    def close(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(_key(session_id), None)

    def __len__(self) -> int:
        return len(self._sessions)


def _key(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("utf-8", "replace")).digest()


def csrf_matches(session: Session, presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(session.csrf.encode(), presented.encode("utf-8", "replace"))


def session_cookie(session_id: str, max_age_s: int, secure: bool) -> str:
    """The Set-Cookie value: HttpOnly (no script reads it), SameSite=Strict (no other site sends it),
    Secure behind HTTPS, scoped to the console's path, with an expiry."""
    flags = f"; Path={COOKIE_PATH}; Max-Age={max_age_s}; HttpOnly; SameSite=Strict"
    return f"{COOKIE_NAME}={session_id}{flags}{'; Secure' if secure else ''}"


def cleared_cookie(secure: bool) -> str:
    return session_cookie("", 0, secure)


def cookie_value(header: str | None, name: str = COOKIE_NAME) -> str | None:
    """The value of cookie ``name`` in a Cookie header, or None."""
    if not header:
        return None
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value.strip() or None
    return None
