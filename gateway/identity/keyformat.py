"""Managed API key format (docs/keys.md): ``gg-<kid>-<secret>``.

``kid`` is 12 base62 characters, the key's public id (it names the key in the admin API, the CLI,
the audit log and quota rules); ``secret`` is 32 random bytes written in base62 (43 characters). Only
the SHA-256 digest of the whole key is ever stored; the key itself is shown once, when it is made.
"""

from __future__ import annotations

import hashlib
import re
import secrets

BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
KEY_PREFIX = "gg"
KID_LENGTH = 12
SECRET_BYTES = 32
SECRET_LENGTH = 43  # 62**43 > 2**256 > 62**42
KID_PATTERN = re.compile(r"[0-9A-Za-z]{12}")
_KEY_LIKE = re.compile(r"gg-([0-9A-Za-z]{12})-[0-9A-Za-z]{8,}")


def base62(number: int, width: int) -> str:
    """``number`` in base62, left-padded with ``0`` to ``width`` characters."""
    digits = []
    while number:
        number, rest = divmod(number, 62)
        digits.append(BASE62[rest])
    return "".join(reversed(digits)).rjust(width, "0")


def new_kid() -> str:
    return "".join(secrets.choice(BASE62) for _ in range(KID_LENGTH))


def new_key(kid: str) -> str:
    """A fresh key for ``kid``: 32 bytes from the OS's CSPRNG, base62."""
    secret = base62(int.from_bytes(secrets.token_bytes(SECRET_BYTES), "big"), SECRET_LENGTH)
    return f"{KEY_PREFIX}-{kid}-{secret}"


def key_digest(key: str | bytes) -> bytes:
    """The 32-byte SHA-256 of the whole key: what the store and the host tables hold."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def is_kid(text: str) -> bool:
    return KID_PATTERN.fullmatch(text) is not None


def redact(text: str) -> str:
    """``text`` with anything shaped like a managed key cut to its kid (``gg-<kid>-***``): for messages
    that quote what a caller sent, in case a key was pasted into the wrong place."""
    return _KEY_LIKE.sub(r"gg-\1-***", text)
