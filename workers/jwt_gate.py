"""JWT bearer tokens on the request path (docs/identity.md): the head gate's verifier and the key sets it
reads.

Each ``auth.jwt`` entry's key set is a JWKS file: the entry's own ``jwks_file``, or the file the
supervisor writes what it fetched from the IdP into (``gateway/supervisor/jwks_feed.py``, which hands
the workers a config naming it). The worker's background task stats those files (``poll``) and
re-reads one that changed; a file that does not parse keeps the last good set (logged once per state
change). Nothing here talks to the IdP.

A token naming an unknown ``kid`` asks the supervisor to refetch that issuer (``JwksWanted`` on the
status pipe), at most once per ``_ASK_EVERY_S`` per issuer from one worker; the supervisor itself
refetches at most once per 30 s per issuer. With ``unknown_kid_wait``, its request waits for the
issuer's next key set (``waits``: workers/kid_wait.py; a new set read by ``poll`` ends the waits).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from gateway.identity.jwt_keys import KeySet, KeySetError, parse_key_set
from gateway.identity.jwt_verify import JwtGrant, JwtRefusal, JwtVerifier
from gateway.process_protocol import JwksWanted, send_status
from workers.kid_wait import KidWaits

log = logging.getLogger("gridgate.jwt")

_ASK_EVERY_S = 5.0
FileStamp = tuple[int, int, int]  # (inode, size, mtime_ns)


class KeyFile:
    """One issuer's JWKS file and what was last read of it."""

    __slots__ = ("name", "path", "stamp", "broken")

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.stamp: FileStamp | None = None
        self.broken = False  # the last read failed (logged once until it reads again)


class JwtGate:
    """One per worker: ``grant`` on a token-shaped bearer value, ``poll`` from the background task."""

    __slots__ = ("verifier", "files", "counts", "waits", "_status_fd", "_asked", "_logged_paths")

    def __init__(self, entries: list[Any], paths: dict[str, str], status_fd: int | None = None) -> None:
        """``entries``: the config's ``auth.jwt``; ``paths``: each entry's key file by name."""
        self.verifier = JwtVerifier(entries, self._unknown_kid)
        self.waits = KidWaits({entry.name: float(getattr(entry, "unknown_kid_wait", 0)) for entry in entries})
        self.files = [KeyFile(name, path) for name, path in paths.items()]
        self._status_fd = status_fd
        self._asked: dict[str, float] = {}
        self.counts: dict[str, int] = {}  # gateway.metrics.catalogue.JWT_EVENTS -> count (this process)
        self._logged_paths: set[tuple[str, str]] = set()
        self.poll()

    @classmethod
    def from_config(cls, config: Any, status_fd: int | None = None) -> JwtGate | None:
        auth = config.auth
        if auth is None or not auth.jwt:
            return None
        paths = {entry.name: config.file_path(entry.jwks_file) for entry in auth.jwt if entry.jwks_file is not None}
        return cls(auth.jwt, paths, status_fd)

    def grant(self, token: bytes) -> JwtGrant | JwtRefusal:
        """The token's grant, or its refusal (a value: the head gate answers it)."""
        try:
            return self.verifier.grant(token, time.time())
        except JwtRefusal as refusal:
            return refusal

    def poll(self) -> bool:
        """Re-read every key file that changed, and report unusable limit claims; True when a key set
        changed."""
        self._report_limit_claims()
        changed = False
        for file in self.files:
            try:
                info = os.stat(file.path)
            except OSError:
                continue  # not written yet (the supervisor's first fetch), or gone: keep the last good set
            stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
            if stamp != file.stamp:
                file.stamp = stamp
                keys = self._read(file)
                if keys is not None:
                    self.verifier.set_keys(file.name, keys)
                    self.waits.keys_changed(file.name)
                    changed = True
        return changed

    def _report_limit_claims(self) -> None:
        """Count tokens whose ``limits_from_claims`` values were unusable, and log each claim once."""
        ignored = 0
        for issuer in self.verifier.by_name.values():
            ignored += issuer.bad_limit_claims
            for path in issuer.bad_limit_paths:
                if (issuer.name, path) not in self._logged_paths:
                    self._logged_paths.add((issuer.name, path))
                    log.warning("auth.jwt %s: a token's claim %r is not a whole number within the limit's bounds; "
                                "the configured limits apply (counted in gridgate_jwt_limit_claims_ignored_total)",
                                issuer.name, path)
        self.counts["limit_claims_ignored"] = ignored

    def _read(self, file: KeyFile) -> KeySet | None:
        try:
            with open(file.path, "rb") as handle:
                keys = parse_key_set(handle.read())
        except (OSError, KeySetError) as exc:
            if not file.broken:
                log.warning("auth.jwt %s: %s: %s; keeping the last good key set", file.name, file.path,
                            getattr(exc, "strerror", None) or exc)
            file.broken = True
            return None
        if file.broken:
            log.info("auth.jwt %s: %s reads again (%d keys)", file.name, file.path, len(keys))
        file.broken = False
        return keys

    def _unknown_kid(self, name: str) -> None:
        if self._status_fd is None:
            return
        now = time.monotonic()
        if now - self._asked.get(name, -_ASK_EVERY_S) >= _ASK_EVERY_S:
            self._asked[name] = now
            send_status(self._status_fd, JwksWanted(issuer=name))
