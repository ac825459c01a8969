"""Cheap unique ids without a syscall per call: a random per-process prefix and a counter.

Build the generator in the process that uses it (after the fork), so no two processes share a prefix.
"""

from __future__ import annotations

import itertools
import os


class CounterIds:
    __slots__ = ("_prefix", "_counter")

    def __init__(self, separator: bytes = b"", prefix: bytes | None = None) -> None:
        """``prefix`` replaces the random one when the caller has a unique name of its own."""
        self._prefix = (os.urandom(6).hex().encode() if prefix is None else prefix) + separator
        self._counter = itertools.count(1)

    def next(self) -> bytes:
        return b"%s%x" % (self._prefix, next(self._counter))
