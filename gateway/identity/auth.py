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

What a key proves is a ``KeyIdentity``: its tenant, its name (the YAML key's ``alias``; a managed key's
``kid`` once those exist) and its own limits (docs/limits.md). One is made per key when the table is
built, so a request carries a reference, never a new object.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.identity.key_limits import KeyLimits
    from gateway.identity.limits import Limits

KEY_DIGEST_PREFIX = "sha256:"
# A spend rollup's key column for a subject (a JWT's key claim, a certificate's value): ``<via>`` RS
# ``<subject>``, so the report tells a subject from an API key's alias of the same name (group_by=subject).
SUBJECT_SEPARATOR = "\x1e"
# The spend rollups' separators (this one, and the field separator "\x1f"), never in a subject's name.
_NO_ROLLUP_SEPARATORS = str.maketrans({"\x1e": "\ufffd", "\x1f": "\ufffd"})
NO_NAME = "-"  # the key column of a request without a key name (gateway.spend.rollups.NO_KEY)
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


def is_subject_via(via: str | None) -> bool:
    """True for the ``via`` of an identity named by a subject: a JWT's (``jwt:<issuer>``), a certificate's."""
    return via is not None and (via.startswith("jwt:") or via == "mtls")


class KeyIdentity:
    """Who a request is: the tenant its key belongs to, the key's name and its own limits.

    ``kid`` is a managed key's public id (none for YAML keys), ``alias`` its configured name; quota rules
    match either (``match.key``), and the key's own limits count under ``name`` (kid, else alias).
    ``limits`` is None when the key has none. ``tenant_index``: the supervisor's metrics index of the
    tenant, which a managed key's table entry carries (its tenant may be new since the worker forked);
    -1 for a YAML key, whose tenant the worker knows from its config. Compared and hashed by identity:
    one object per key.
    """

    __slots__ = ("tenant", "kid", "alias", "limits", "tenant_index", "written", "via", "rule", "rollup_name")

    def __init__(self, tenant: str, alias: str | None = None, kid: str | None = None,
                 limits: Limits | None = None, tenant_index: int = -1, written: KeyLimits | None = None,
                 via: str | None = None, rule: str | None = None) -> None:
        self.tenant = tenant
        self.alias = alias
        self.kid = kid
        self.limits = limits
        self.tenant_index = tenant_index
        self.written = written  # a YAML key's limits as configured (what GET /v1/gridgate/key shows)
        # A JWT's identity (docs/identity.md): ``via`` is ``jwt:<issuer name>`` (None for an API key), the
        # alias its subject (the key claim), ``rule`` the quota rule its claims name (None: rules match).
        self.via = via
        self.rule = rule
        # The spend rollups' key column (made once here, not per request): a subject's ``via`` RS subject.
        # A subject comes from a token or a certificate: the rollup field's separators in it are replaced,
        # or "a\x1fb" would split into the model column (docs/identity.md, subject).
        name = kid or alias or NO_NAME
        self.rollup_name = (f"{via}{SUBJECT_SEPARATOR}{name.translate(_NO_ROLLUP_SEPARATORS)}"
                            if is_subject_via(via) else name)

    @property
    def name(self) -> str | None:
        return self.kid if self.kid is not None else self.alias

    @property
    def limit_tag(self) -> str:
        """The kind of name the key's own limits count under: ``k`` kid, ``a`` alias, ``j.<issuer>``
        a JWT subject, else ``via`` (so a subject never shares a counter with a YAML alias of its name)."""
        if self.kid is not None:
            return "k"
        if self.via is None:
            return "a"
        return "j." + self.via[4:] if self.via.startswith("jwt:") else self.via

    def __repr__(self) -> str:
        return f"KeyIdentity({self.tenant!r}, name={self.name!r})"


class Authenticator:
    """Maps presented API keys to who they are.

    Built once per config load; ``identify`` is the per-request call (a few µs).
    """

    __slots__ = ("_by_digest",)

    def __init__(self, keys: Iterable[tuple[str, str] | tuple[str, str, KeyIdentity]]) -> None:
        """``keys``: ``(tenant, "sha256:<hex>")`` pairs, or triples with the key's ``KeyIdentity``. Several
        keys may map to one tenant."""
        table: dict[bytes, tuple[KeyIdentity, bytes]] = {}
        for tenant, digest, *identity in keys:
            if not is_key_digest(digest):
                # Never echo the value: if someone pasted a plaintext key here it must not be logged.
                raise ValueError(f"auth key for tenant {tenant!r} is not of the form sha256:<64 hex>")
            raw = bytes.fromhex(digest[len(KEY_DIGEST_PREFIX) :])
            other = table.get(raw)
            if other is not None and other[0].tenant != tenant:
                raise ValueError(f"the same auth key is configured for tenants {other[0].tenant!r} and {tenant!r}")
            table[raw] = (identity[0] if identity else KeyIdentity(tenant), raw)
        self._by_digest = table

    @classmethod
    def from_config(cls, auth: Any) -> Authenticator:
        """The config's ``auth.keys`` (gateway.config structs, duck-typed; their ``limits`` are
        ``key_limits.KeyLimits``), aliases and limits included."""
        entries: list[tuple[str, str, KeyIdentity]] = []
        for key in auth.keys:
            own = None if key.limits is None else key.limits.counted()
            entries.append((key.tenant, key.key, KeyIdentity(key.tenant, key.alias, None, own, written=key.limits)))
        return cls(entries)

    def __len__(self) -> int:
        return len(self._by_digest)

    def identities(self) -> list[KeyIdentity]:
        """Every key's identity, in the order configured."""
        return [identity for identity, _ in self._by_digest.values()]

    def identify(self, authorization: bytes | None, x_api_key: bytes | None) -> KeyIdentity | None:
        """Who the presented key is, or None (missing, malformed or unknown -> 401).

        ``Authorization: Bearer <key>`` wins over ``X-Api-Key`` when both are present. Header values
        are the raw bytes h11 hands over; the key is compared as bytes (no decoding).
        """
        key = _presented_key(authorization, x_api_key)
        if not key:
            return None
        digest = hashlib.sha256(key).digest()
        entry = self._by_digest.get(digest)
        if entry is None:
            return None
        identity, stored = entry
        # The dict matched on the digest; confirm with an explicitly constant-time comparison.
        return identity if hmac.compare_digest(stored, digest) else None

    def authenticate(self, authorization: bytes | None, x_api_key: bytes | None) -> str | None:
        """The tenant of the presented key, or None (``identify``)."""
        identity = self.identify(authorization, x_api_key)
        return None if identity is None else identity.tenant

    def identity_of_digest(self, digest: bytes) -> KeyIdentity | None:
        """Who a presented key is, by its SHA-256 (``presented_digest``), or None. The head gate's entry
        point when managed keys are on: the same digest then probes the host's key table, so a
        presented key is hashed once whichever table knows it (docs/keys.md)."""
        entry = self._by_digest.get(digest)
        if entry is None:
            return None
        identity, stored = entry
        return identity if hmac.compare_digest(stored, digest) else None


def presented_digest(authorization: bytes | None, x_api_key: bytes | None) -> bytes | None:
    """The SHA-256 of the presented key (``Authenticator.identify``'s header rules), or None when no
    key was presented."""
    key = _presented_key(authorization, x_api_key)
    return hashlib.sha256(key).digest() if key else None


def presented_key(authorization: bytes | None, x_api_key: bytes | None) -> bytes | None:
    """The presented credential (``Authorization: Bearer`` wins over ``X-Api-Key``), or None."""
    return _presented_key(authorization, x_api_key)


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
