"""A worker's lookup of managed keys in the host table: digest -> ``KeyEntry`` (docs/keys.md).

The request path's one call (the head gate makes it after the YAML keys missed, with the digest
those were probed with: ``gateway.identity.auth.presented_digest``)::

    entry = lookup.use(digest)  # lookup(digest), and an active key without expiry marked used

One ``find`` in shared memory (``shm.keys``), then the entry this worker decoded for that slot's
current version: a blob is copied and decoded only the first time a worker sees it after a change.
While the table has not changed at all since a digest's last lookup (its seqlock word reads the same),
that lookup's entry is the answer again, without a ``find``: one word read and one dict probe for a
key in steady use; any change anywhere in the table (a block, a revoke) sends every digest back to
``find``.
The cache is bounded (``MAX_CACHED``; cleared when full, so a scan of many keys costs decodes, never
memory). A table that stays mid-write past its read budget answers None: the key is refused (401),
never admitted on a torn read.
"""

from __future__ import annotations

from gateway.keys.view import KeyEntry, decode_entry
from shm.keys import H_MINUTE, H_SEQ, KeyTable

MAX_CACHED = 65_536


class KeyLookup:
    """One per worker, over the table the supervisor created before fork."""

    __slots__ = ("_table", "_words", "_used", "_cache", "_seen")

    def __init__(self, table: KeyTable) -> None:
        self._table = table
        self._words, self._used = table.words, table.used  # read (and marked) here: a call fewer each
        self._cache: dict[int, tuple[int, KeyEntry]] = {}
        self._seen: dict[bytes, tuple[int, KeyEntry]] = {}  # digest -> (seq of its lookup, its entry)

    def __call__(self, digest: bytes) -> KeyEntry | None:
        """The entry for a presented key's 32-byte SHA-256, or None (not a managed key this host knows).

        The caller checks its status and expiry (``answers.refusal``) and marks an admitted use
        (``mark_used``)."""
        seq = self._words[H_SEQ]  # ``KeyTable.seq`` written out
        seen = self._seen.get(digest)
        if seen is not None and seen[0] == seq:
            return seen[1]  # the table did not change since this digest's last lookup
        try:
            found = self._table.find(digest)
            if found is None:
                return None
            slot, version = found
            cached = self._cache.get(slot)
            entry = cached[1] if cached is not None and cached[0] == version else self._decode(digest, slot, version)
        except TimeoutError:
            return None
        if entry is not None and not seq & 1:  # found after an even seq: valid while it reads the same
            if len(self._seen) >= MAX_CACHED:
                self._seen.clear()
            self._seen[digest] = (seq, entry)
        return entry

    def use(self, digest: bytes) -> KeyEntry | None:
        """``self(digest)``, with a ``plain`` entry (active, no expiry: usable) marked used already: the
        request path's one call for a key in steady use. Any other entry the caller checks, and marks
        used if it admits it."""
        seen = self._seen.get(digest)
        if seen is not None and seen[0] == self._words[H_SEQ]:
            entry: KeyEntry | None = seen[1]  # the table did not change since this digest's last lookup
        else:
            entry = self(digest)
        if entry is not None and entry.plain:
            self._used[entry.slot] = self._words[H_MINUTE]  # ``mark_used`` written out
        return entry

    def mark_used(self, entry: KeyEntry) -> None:
        """Mark ``entry``'s key used this minute (one 4-byte store; the supervisor writes
        ``last_used_at`` from the marks once a minute)."""
        self._used[entry.slot] = self._words[H_MINUTE]  # ``KeyTable.mark_used`` written out

    def _decode(self, digest: bytes, slot: int, version: int) -> KeyEntry | None:
        """Copy and decode the blob of ``(slot, version)``; if the writer changed the slot meanwhile,
        find the digest again (a few times at most: one admin change is one write)."""
        for _ in range(8):
            blob = self._table.blob(slot, version)
            if blob is not None:
                entry = decode_entry(blob, slot)
                cache = self._cache
                if len(cache) >= MAX_CACHED:
                    cache.clear()
                cache[slot] = (version, entry)
                return entry
            found = self._table.find(digest)
            if found is None:
                return None
            slot, version = found
        return None
