"""Session-affinity table shared by every worker of a host (docs/overlay.md#session-affinity).

The supervisor allocates an anonymous shared mapping *before* forking::

    mm = mmap.mmap(-1, AffinityTable.required_bytes(capacity))   # MAP_SHARED on Unix
    table = AffinityTable(memoryview(mm), capacity)                # in every worker too

Layout: a 64-byte header, then fixed 64-byte records grouped into buckets of
``WAYS`` records (set-associative). A key (the session id bytes) is hashed with
xxh3-128: the low half picks the bucket and is the tag, both halves identify it.
Nothing grows: a full bucket evicts the record that expires first, which is an
expired one if there is any (bindings carry an absolute expiry), else the oldest.

Concurrency without locks: writers are different processes and Python has no
compare-and-swap on shared memory, so two writers may race on one record. Each record
carries a sequence counter (odd while being written) and an xxh3 checksum over its
payload (key, stable id, capability, expiry). A reader accepts a record only when the
sequence is even and unchanged around the read *and* the checksum matches; a torn read
or an interleaving of two writers therefore reads as "absent" (the session is simply
re-bound), never as a binding that was not written for that key. Lost updates under a
write race are possible and harmless: affinity is a preference, not a guarantee.

Each process remembers the bindings it read (``key -> (record, sequence, binding)``): a record's
sequence only grows, with every write to it, so while it is unchanged the remembered binding is
exactly what the record holds, and a lookup costs one word read instead of a hash, a bucket scan
and a checksum. A rebind or an eviction by any worker changes the sequence and forces a fresh read.
``seen`` and ``words`` are public so the router can make that check without a call per request
(gateway/routing/router.py); ``lookup`` is the same check followed by ``read``.

Record words (little-endian u64; expiry is a float64 of the caller's clock)::

    0 seq | 1 key_lo | 2 key_hi | 3 stable_id_hash | 4 capability_hash | 5 expires_at | 6 checksum | 7 unused
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

WAYS = 8
RECORD_BYTES = 64
HEADER_BYTES = 64
_WORDS = RECORD_BYTES // 8
_HEADER_WORDS = HEADER_BYTES // 8
_MAGIC = int.from_bytes(b"GGAFFIN1", "little")
_LAYOUT_VERSION = 1
_MASK64 = (1 << 64) - 1
_PAYLOAD = struct.Struct("<QQQQd")  # words 1..5
_PAYLOAD_OFFSET = 8
_PAYLOAD_END = _PAYLOAD_OFFSET + _PAYLOAD.size
_READ_ATTEMPTS = 2
_RECORD = struct.Struct("<QQQQQdQ")  # words 0..6: seq, key_lo, key_hi, stable, capability, expiry, checksum
_BUCKET_TAGS = struct.Struct("<" + "8xQ48x" * WAYS)  # word 1 (key_lo) of each record of a bucket
_BUCKET_WORDS = WAYS * _WORDS
# Bindings this process remembers. Past the bound the memory starts over (sessions come back).
SEEN_LIMIT = 8192

_xxh3_128 = xxhash.xxh3_128_intdigest
_xxh3_64 = xxhash.xxh3_64_intdigest


class Binding(NamedTuple):
    stable_id_hash: int
    capability_hash: int
    expires_at: float


# ``Binding(a, b, c)`` as its generated ``__new__`` makes it, without that Python-level call: a read builds one.
_new_tuple = tuple.__new__


class AffinityTable:
    """Bounded key -> (stable_id_hash, capability_hash, expires_at) map in shared memory."""

    __slots__ = ("capacity", "_buckets", "_bytes", "words", "_floats", "seen", "_seen_limit")

    @staticmethod
    def bucket_count(capacity: int) -> int:
        if capacity < 1:
            raise ValueError("affinity capacity must be >= 1")
        return -(-capacity // WAYS)

    @staticmethod
    def required_bytes(capacity: int) -> int:
        """Bytes of shared memory for ``capacity`` bindings (rounded up to whole buckets)."""
        return HEADER_BYTES + AffinityTable.bucket_count(capacity) * WAYS * RECORD_BYTES

    def __init__(self, buf: memoryview, capacity: int) -> None:
        buckets = self.bucket_count(capacity)
        size = self.required_bytes(capacity)
        view = memoryview(buf).cast("B")
        if len(view) < size:
            raise ValueError(f"affinity table needs {size} bytes, buffer has {len(view)}")
        view = view[:size]
        self._bytes = view
        self.words = view.cast("Q")
        self._floats = view.cast("d")
        self._buckets = buckets
        self.capacity = buckets * WAYS
        self.seen: dict[bytes, tuple[int, int, Binding]] = {}
        self._seen_limit = min(self.capacity, SEEN_LIMIT)
        header = (_MAGIC, _LAYOUT_VERSION, WAYS, buckets)
        current = tuple(self.words[0:4])
        if current == (0, 0, 0, 0):
            # Fresh zeroed mapping: every worker may race here, all writing the same values.
            self.words[1], self.words[2], self.words[3] = _LAYOUT_VERSION, WAYS, buckets
            self.words[0] = _MAGIC
        elif current != header:
            raise ValueError("shared memory does not hold an affinity table of this capacity")

    def _locate(self, key: bytes) -> tuple[int, int, int]:
        """The key's halves (key_lo, key_hi) and the word index of the first record of its bucket: one call
        for the three, which every read and bind of a key needs."""
        digest = _xxh3_128(key)
        key_lo = (digest & _MASK64) or 1  # tag 0 marks a never-written slot, so a live key's is never 0
        return key_lo, digest >> 64, _HEADER_WORDS + (key_lo % self._buckets) * _BUCKET_WORDS

    def _read(self, rec: int, key_lo: int, key_hi: int) -> tuple[int, Binding] | None:
        """(sequence, binding) of record ``rec`` if it holds the key, read consistently; else None."""
        start = rec * 8
        words = self.words
        for _ in range(_READ_ATTEMPTS):
            seq = words[rec]  # before the payload, and again after it: a seqlock
            if seq & 1:
                continue  # a writer is inside this record
            _, lo, hi, stable, capability, expires_at, checksum = _RECORD.unpack_from(self._bytes, start)
            if words[rec] != seq:
                continue
            if lo != key_lo or hi != key_hi:
                return None
            if _xxh3_64(self._bytes[start + _PAYLOAD_OFFSET : start + _PAYLOAD_END]) != checksum:
                return None  # torn, interleaved by two writers, or never written
            return seq, _new_tuple(Binding, (stable, capability, expires_at))
        return None

    def lookup(self, key: bytes, now: float) -> Binding | None:
        """The live binding of ``key`` at ``now``, or None (absent, expired or unreadable)."""
        seen = self.seen.get(key)
        if seen is not None and self.words[seen[0]] == seen[1]:
            found = seen[2]  # the record has not been written since this process read it
            return found if found.expires_at > now else None
        return self.read(key, now)

    def read(self, key: bytes, now: float) -> Binding | None:
        """``lookup`` from shared memory, past this process's memory (which it updates)."""
        key_lo, key_hi, base = self._locate(key)
        tags = _BUCKET_TAGS.unpack_from(self._bytes, base * 8)
        if key_lo not in tags:
            return None
        if tags.count(key_lo) == 1:
            rec = base + tags.index(key_lo) * _WORDS
            read = self._read(rec, key_lo, key_hi)
            if read is None:
                return None
            seen = self.seen
            if len(seen) >= self._seen_limit:
                seen.clear()
            sequence, binding = read
            seen[key] = (rec, sequence, binding)
            return binding if binding.expires_at > now else None
        # Two racing writers can leave one key in two ways: the later binding wins (not remembered:
        # a rebind rewrites only the first of them).
        best: Binding | None = None
        for way, tag in enumerate(tags):
            if tag == key_lo:
                read = self._read(base + way * _WORDS, key_lo, key_hi)
                if read is not None and read[1].expires_at > now and (best is None or read[1].expires_at > best.expires_at):
                    best = read[1]
        return best

    def bind(self, key: bytes, stable_id_hash: int, capability_hash: int, expires_at: float) -> None:
        """Bind ``key`` until ``expires_at`` (absolute, same clock as ``lookup``'s ``now``)."""
        # Forget what this process read: after a write race left the key in two ways, the one
        # remembered may not be the one rewritten here.
        self.seen.pop(key, None)
        key_lo, key_hi, base = self._locate(key)
        words = self.words
        tags = _BUCKET_TAGS.unpack_from(self._bytes, base * 8)
        if key_lo in tags:
            way = tags.index(key_lo)  # re-bind in place
        elif 0 in tags:
            way = tags.index(0)
        else:
            expiries = self._floats[base + 5 : base + _BUCKET_WORDS : _WORDS].tolist()
            way = min(range(WAYS), key=expiries.__getitem__)  # expired first, else the oldest
        rec = base + way * _WORDS
        payload = _PAYLOAD.pack(key_lo, key_hi, stable_id_hash, capability_hash, expires_at)
        odd = ((words[rec] + 1) | 1) & _MASK64
        words[rec] = odd
        start = rec * 8
        self._bytes[start + _PAYLOAD_OFFSET : start + _PAYLOAD_END] = payload
        words[rec + 6] = _xxh3_64(payload)
        words[rec] = (odd + 1) & _MASK64

    def release(self) -> None:
        """Drop the views so the owner can close the mapping."""
        for view in (self._floats, self.words, self._bytes):
            view.release()
