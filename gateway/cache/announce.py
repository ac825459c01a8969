"""The cache's announcements (docs/cache.md, "The host index"): every claim of a key is published on one
channel, so each host's index learns the keys that exist or are about to, anywhere in the fleet. Pure.

A payload is ``<known for, ms>:`` then the 32 hex digits of each key announced (a worker's claims of one
loop tick in one message). The key's 128-bit digest is the hex part of its Valkey name.
"""

from __future__ import annotations

CHANNEL = b"gridgate:cache:announce"
KEY_PATTERN = b"gridgate:cache:*"  # the entries (and pending markers) a scan of the store finds
DIGEST_HEX = 32


def key_digest(name: bytes) -> bytes:
    """The 16-byte digest of a cache key's Valkey name (``gridgate:cache:<32 hex>``); ValueError if none."""
    return bytes.fromhex(name[-DIGEST_HEX:].decode("ascii"))


def announcement(known_ms: int, digests: list[bytes]) -> bytes:
    """One payload announcing the keys of ``digests`` (16 bytes each) as known for ``known_ms`` from now."""
    return b"%d:%b" % (known_ms, b"".join(digests).hex().encode())


def parse_announcement(payload: bytes) -> tuple[int, list[bytes]]:
    """``(known for ms, the keys' digests)``; ValueError for a payload that is not one."""
    head, sep, digests = payload.partition(b":")
    if not sep or len(digests) % DIGEST_HEX:
        raise ValueError("not a cache announcement")
    known_ms = int(head)
    raw = bytes.fromhex(digests.decode("ascii"))
    return known_ms, [raw[i:i + 16] for i in range(0, len(raw), 16)]
