"""Overlay files at the edge: read, write atomically, watch, keep the last-known-good
(docs/overlay.md#reload).

- :func:`write_atomically` is how every overlay file is written (the control plane's
  output, the supervisor's cache of a Valkey-sourced overlay): readers see the old
  file or the new one, never a mix, and a crash leaves no renamed but empty file.
- :func:`load_overlay_file` reads with the 2 MiB bound and turns every failure (I/O,
  empty file, bad JSON, contract violations) into one :class:`OverlayRejected`.
- :class:`OverlayWatcher` is a cheap stat poller: it reports a change once the file's
  identity has been stable for the debounce. It looks at both the path itself
  (``lstat``: a symlink being replaced) and what it resolves to (``stat`` and
  ``realpath``: atomic rename, Kubernetes ``..data`` symlink swaps).
- :class:`SnapshotHolder` serves the current snapshot and swaps it only for a valid
  overlay with a *different* semantic revision, so an equivalent rewrite keeps the
  serving object and therefore the router's picker state.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from gateway.overlay.contract import EMPTY, MAX_OVERLAY_BYTES, TOO_LARGE, UNREADABLE, OverlayRejected
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes, snapshot_from_object

_Signature = tuple[Any, ...]
FILE_MODE = 0o644  # the gateway may run as another (dynamic) user: an overlay must be world-readable


def check_overlay_bytes(data: bytes, where: str, max_bytes: int = MAX_OVERLAY_BYTES) -> bytes:
    """``data`` if it is within the size bound and not blank; raises :class:`OverlayRejected`."""
    if len(data) > max_bytes:
        raise OverlayRejected(TOO_LARGE, f"{where}: larger than {max_bytes} bytes")
    if not data.strip():
        raise OverlayRejected(EMPTY, f"{where}: empty")
    return data


def read_overlay_bytes(path: str | os.PathLike[str], max_bytes: int = MAX_OVERLAY_BYTES) -> bytes:
    """The file's bytes, at most ``max_bytes``; raises :class:`OverlayRejected`."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)  # one byte more tells "too large" without reading it all
    except OSError as exc:
        raise OverlayRejected(UNREADABLE, f"{os.fspath(path)}: {exc.strerror or exc}") from None
    return check_overlay_bytes(data, os.fspath(path), max_bytes)


def write_atomically(path: str, data: bytes, mode: int = FILE_MODE) -> os.stat_result:
    """Temp file in the same directory, fsync, rename over ``path``, fsync the directory. Returns the
    written file's stat (taken before the rename, so it is ours even if the file is replaced at once)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp_path = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
            written = os.fstat(handle.fileno())
        os.replace(temp_path, path)
    except BaseException:
        try:
            os.unlink(temp_path)
        except OSError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)
    return written



def load_overlay_file(path: str | os.PathLike[str], expected_scope: Any = None) -> Snapshot:
    """Read, validate and index an overlay file. Raises :class:`OverlayRejected`."""
    return snapshot_from_bytes(read_overlay_bytes(path), expected_scope)


def _stat_key(result: os.stat_result) -> tuple[int, int, int, int]:
    return (result.st_dev, result.st_ino, result.st_mtime_ns, result.st_size)


def file_signature(path: str | os.PathLike[str]) -> _Signature:
    """Identity of the path and of what it resolves to; errors are part of the identity."""
    try:
        link: tuple[Any, ...] = _stat_key(os.lstat(path))
    except OSError as exc:
        link = ("missing", exc.errno)
    try:
        target: tuple[Any, ...] = (*_stat_key(os.stat(path)), os.path.realpath(path))
    except OSError as exc:
        target = ("missing", exc.errno)
    return (link, target)


class OverlayWatcher:
    """Polls a file; ``poll(now)`` is True once per change, after it was stable for ``debounce_s``.

    The signature at construction counts as already seen: create the watcher *before*
    the first load, so a change racing that load is still reported (an extra reload of
    an unchanged revision is a no-op). ``now`` is any monotonic clock in seconds.
    """

    __slots__ = ("path", "debounce_s", "_seen", "_pending", "_pending_since")

    def __init__(self, path: str | os.PathLike[str], debounce_s: float) -> None:
        self.path = path
        self.debounce_s = debounce_s
        self._seen = file_signature(path)
        self._pending: _Signature | None = None
        self._pending_since = 0.0

    def poll(self, now: float) -> bool:
        current = file_signature(self.path)
        if current == self._seen:
            self._pending = None  # changed and changed back: nothing to do
            return False
        if current != self._pending:
            self._pending, self._pending_since = current, now  # (re)start the debounce
        if now - self._pending_since < self.debounce_s:
            return False
        self._seen, self._pending = current, None
        return True

    def mark_seen(self) -> None:
        """Take the file as it is now as seen (after a SIGHUP-driven reload)."""
        self._seen, self._pending = file_signature(self.path), None


class SnapshotHolder:
    """Last-known-good holder for one overlay file.

    ``SnapshotHolder.open(path, scope)`` raises :class:`OverlayRejected` (an invalid overlay
    at startup is a startup error); afterwards ``reload()`` never raises.
    """

    __slots__ = ("path", "expected_scope", "snapshot", "last_error")

    def __init__(self, path: str | os.PathLike[str], expected_scope: Any, snapshot: Snapshot) -> None:
        self.path = path
        self.expected_scope = expected_scope
        self.snapshot = snapshot
        self.last_error: OverlayRejected | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], expected_scope: Any = None) -> SnapshotHolder:
        return cls(path, expected_scope, load_overlay_file(path, expected_scope))

    def reload(self) -> tuple[bool, OverlayRejected | None]:
        """Re-read the file. Returns (serving snapshot replaced?, rejection or None).

        On rejection the serving snapshot stays. A valid file with the serving semantic
        revision keeps the serving object (and the picker state tied to it).
        """
        try:
            candidate = load_overlay_file(self.path, self.expected_scope)
        except OverlayRejected as exc:
            self.last_error = exc
            return False, exc
        self.last_error = None
        if candidate.revision == self.snapshot.revision:
            return False, None
        self.snapshot = candidate
        return True, None


INLINE_LOCAL_SITE = "inline"


def load_inline_overlay(candidates: list[Any], expected_scope: Any = None) -> Snapshot:
    """The config's inline ``routing.candidates`` as a legacy overlay document, validated the same way."""
    return snapshot_from_object({"local_site": INLINE_LOCAL_SITE, "candidates": candidates}, expected_scope)
