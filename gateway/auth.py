"""Client identity: API keys -> tenant.

Keys live in the config only as ``sha256:<64 hex>`` digests (``gridgate keys hash`` makes them), so a
leaked config does not leak credentials. A presented key is hashed once (SHA-256, ~1 µs for a
typical key) and the digest is looked up in a dict.

Why a dict lookup by digest is constant-time with respect to the secret: the lookup compares the
SHA-256 of the *presented* key with the stored digests. Timing can at most reveal how many leading
bytes of the attacker's own digest match a stored digest; because SHA-256 is preimage resistant,
learning a prefix of a digest tells nothing usable about a key that produces it, so an attacker cannot
steer the search byte by byte the way they could against a plaintext ``==``. We still confirm the hit
with ``hmac.compare_digest`` so the one comparison that matters is explicitly constant-time.

The key itself is never stored, logged or put in an exception message.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable

KEY_DIGEST_PREFIX = "sha256:"
_DIGEST_FORM = re.compile(r"sha256:[0-9a-f]{64}")
_BEARER = b"bearer "


def hash_api_key(key: str) -> str:
    """Return the config form (``sha256:<hex>``) of an API key.

    ``gridgate keys hash`` reads the key on stdin; a single trailing newline (``\\n`` or ``\\r\\n``) is
    stripped so ``echo KEY | gridgate keys hash`` does what users expect. Inner whitespace is kept:
    it is part of the key.
    """
    if key.endswith("\r\n"):
        key = key[:-2]
    elif key.endswith("\n"):
        key = key[:-1]
    return KEY_DIGEST_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def is_key_digest(value: str) -> bool:
    """True if ``value`` is a well-formed ``sha256:<64 lowercase hex>`` digest (config validation)."""
    return _DIGEST_FORM.fullmatch(value) is not None


class Authenticator:
    """Maps presented API keys to tenants.

    Built once per config load; ``authenticate`` is the per-request call (a few µs).
    """

    __slots__ = ("_tenant_by_digest",)

    def __init__(self, keys: Iterable[tuple[str, str]]) -> None:
        """``keys``: ``(tenant, "sha256:<hex>")`` pairs. Several keys may map to one tenant."""
        table: dict[bytes, tuple[str, bytes]] = {}
        for tenant, digest in keys:
            if not is_key_digest(digest):
                # Never echo the value: if someone pasted a plaintext key here it must not be logged.
                raise ValueError(f"auth key for tenant {tenant!r} is not of the form sha256:<64 hex>")
            raw = bytes.fromhex(digest[len(KEY_DIGEST_PREFIX) :])
            other = table.get(raw)
            if other is not None and other[0] != tenant:
                raise ValueError(f"the same auth key is configured for tenants {other[0]!r} and {tenant!r}")
            table[raw] = (tenant, raw)
        self._tenant_by_digest = table

    def __len__(self) -> int:
        return len(self._tenant_by_digest)

    def authenticate(self, authorization: bytes | None, x_api_key: bytes | None) -> str | None:
        """Return the tenant for the presented key, or None (missing, malformed or unknown -> 401).

        ``Authorization: Bearer <key>`` wins over ``X-Api-Key`` when both are present. Header values
        are the raw bytes h11 hands over; the key is compared as bytes (no decoding).
        """
        key = _presented_key(authorization, x_api_key)
        if not key:
            return None
        digest = hashlib.sha256(key).digest()
        entry = self._tenant_by_digest.get(digest)
        if entry is None:
            return None
        tenant, stored = entry
        # The dict matched on the digest; confirm with an explicitly constant-time comparison.
        return tenant if hmac.compare_digest(stored, digest) else None

    def tenant_of_digest(self, digest: bytes) -> str | None:
        """The tenant of a presented key's SHA-256 (``presented_digest``), or None. The head gate's
        entry point when managed keys are on: the same digest then probes the host's key table, so a
        presented key is hashed once whichever table knows it (docs/keys.md)."""
        entry = self._tenant_by_digest.get(digest)
        if entry is None:
            return None
        tenant, stored = entry
        return tenant if hmac.compare_digest(stored, digest) else None


def presented_digest(authorization: bytes | None, x_api_key: bytes | None) -> bytes | None:
    """The SHA-256 of the presented key (``Authenticator.authenticate``'s header rules), or None when no
    key was presented."""
    key = _presented_key(authorization, x_api_key)
    return hashlib.sha256(key).digest() if key else None


def _presented_key(authorization: bytes | None, x_api_key: bytes | None) -> bytes | None:
    if authorization:
        value = authorization.strip()
        # The scheme is case-insensitive (RFC 9110 §11.1). A non-Bearer Authorization (e.g. Basic for
        # some proxy in front) does not hide an X-Api-Key.
        if len(value) > len(_BEARER) and value[: len(_BEARER)].lower() == _BEARER:
            return value[len(_BEARER) :].strip()
    if x_api_key:
        return x_api_key.strip()
    return None
