"""Seqlock: one writer publishes a multi-word record, readers never see it torn.

A record is ``[seq, word_1 .. word_n]`` of int64 in a shared ``memoryview.cast("q")``. The writer makes
``seq`` odd, writes the words, then makes it even again; a reader copies the words and accepts the copy
only if ``seq`` was even and unchanged around it. Readers never block the writer and never write.

Ordering: CPython stores/loads an aligned int64 element with one machine access, and x86-64 (TSO) keeps
stores and loads in program order, which is all a seqlock needs. On weakly ordered CPUs we add a
best-effort fence (an uncontended mutex round trip); the records are read off the request path, so
the cost does not matter there.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from array import array
from collections.abc import Sequence

_STRONGLY_ORDERED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}
_fence_lock = threading.Lock()

# How long a reader waits for a busy record: a writer that died mid-publish leaves ``seq`` odd until
# a new writer repairs it, and a reader must not hang a worker in the meantime.
DEFAULT_READ_TIMEOUT_S = 0.05


class SeqlockBusy(RuntimeError):
    """The record stayed mid-write for the whole read budget (its writer likely died mid-publish)."""


def _fence() -> None:
    if not _STRONGLY_ORDERED:
        with _fence_lock:
            pass


def write_record(words: memoryview, offset: int, values: Sequence[int]) -> None:
    """Publish ``values`` into the record whose sequence word is ``words[offset]`` (single writer)."""
    packed = array("q", values)  # build before going odd: keep the busy window to one memcpy
    seq = words[offset]
    if seq & 1:  # a previous writer died mid-publish: close its odd phase first
        seq += 1
    words[offset] = seq + 1
    _fence()
    words[offset + 1 : offset + 1 + len(packed)] = packed
    _fence()
    words[offset] = seq + 2


def read_record(words: memoryview, offset: int, length: int, *, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> list[int]:
    """Return a consistent copy of the ``length`` words after the sequence word at ``offset``."""
    start = offset + 1
    end = start + length
    deadline = 0.0
    attempt = 0
    while True:
        before = words[offset]
        if not before & 1:
            _fence()
            values = words[start:end].tolist()
            _fence()
            if words[offset] == before:
                return values
        attempt += 1
        if attempt & 63 == 0:
            # The writer may be preempted mid-publish (or on our core): yield, and bound the wait.
            now = time.monotonic()
            if not deadline:
                deadline = now + timeout_s
            elif now > deadline:
                raise SeqlockBusy(f"seqlock at word {offset} stayed busy for {timeout_s}s")
            os.sched_yield()
