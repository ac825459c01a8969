"""What a host's key table holds per secret, and what a worker's lookup answers.

The follower turns a ``KeyRecord`` into one ``KeyView`` per secret that opens the key (the current
one, and those still in a rotation grace, each with its own ``expires_at``) and writes it to the
table as a small msgpack blob. A worker decodes a blob once per change into a ``KeyEntry``, with its
``models`` globs compiled into one regular expression, and keeps it (``lookup.KeyLookup``).
"""

from __future__ import annotations

import re
from fnmatch import translate

import msgspec

from gateway.identity.auth import KeyIdentity
from gateway.identity.key_limits import KeyLimits
from gateway.keys.record import KeyRecord, Status
from gateway.request.cors import OriginList, parse_key_origins


class KeyView(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """The request path's part of a record, for one secret. No digest, no metadata."""

    kid: str
    tenant: str
    alias: str | None
    status: Status
    models: list[str] | None
    limits: KeyLimits
    expires_at: int | None  # Unix seconds; for a previous secret, the end of its grace
    allowed_origins: list[str] | None
    # The supervisor's metrics index of the tenant (``gridgate_tenant_tokens_total``), -1 for none; last,
    # with a default, so a blob written without it still decodes.
    tenant_index: int = -1
    # A secret in its rotation grace (not the key's current one): the access line says so; last, with a
    # default, for the same reason (trailing defaults are not written: a current secret's blob is as before).
    previous: bool = False


# ``KeyIdentity.via`` of a request made with a previous secret: its access line's ``identity`` (the
# current secret's line has none). A managed key's limits count under its kid whatever ``via`` says.
PREVIOUS_SECRET = "previous_secret"

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(KeyView).decode


def views_of(record: KeyRecord, now: float, tenant_index: int = -1) -> dict[bytes, bytes]:
    """Table blobs by 32-byte digest, for every secret of ``record`` that still opens it; ``tenant_index``:
    the supervisor's metrics index of the record's tenant."""
    blobs: dict[bytes, bytes] = {}
    for at, (digest, expires_at) in enumerate(record.secrets(now)):  # the current secret first
        view = KeyView(record.kid, record.tenant, record.alias, record.status, record.models, record.limits,
                       expires_at, record.allowed_origins, tenant_index, at > 0)
        blobs[bytes.fromhex(digest)] = _encode(view)
    return blobs


class KeyEntry:
    """A decoded table entry, as the request path sees a managed key (one per secret and version)."""

    __slots__ = ("kid", "tenant", "alias", "status", "models", "limits", "expires_at", "allowed_origins",
                 "origins", "slot", "identity", "plain", "_models")

    def __init__(self, view: KeyView, slot: int) -> None:
        self.kid = view.kid
        self.tenant = view.tenant
        self.alias = view.alias
        self.status = view.status
        self.models = view.models
        self.limits = view.limits
        self.expires_at = view.expires_at
        self.allowed_origins = view.allowed_origins
        # The browser origins the key may be used from (docs/cors.md, "A key's own origins"), parsed once;
        # None: any. An entry that does not parse (the admin API refuses those) admits no origin.
        self.origins = None if not view.allowed_origins else _key_origins(view.allowed_origins)
        self.slot = slot  # where the table keeps it (for marking it used)
        # Active and without an expiry (nearly every key): usable whenever the table holds this version, so
        # the request path asks neither its status nor the clock (``KeyLookup.use``).
        self.plain = view.status == "active" and view.expires_at is None
        # Who the request is, for the quota (docs/limits.md): made once per decoded version, so the
        # quota's memo of (tenant, model, key) sees one object per key version, as for a YAML key.
        self.identity = identity_of(view)
        self._models = None if view.models is None else _one_pattern(view.models)

    def allows_model(self, model: str) -> bool:
        """True when ``model`` matches one of the key's ``models`` globs (case-sensitive), or the key
        has none (then the tenant's allowed_capabilities decide)."""
        return self._models is None or self._models.match(model) is not None

    def __repr__(self) -> str:  # the kid is public; nothing else worth showing
        return f"KeyEntry(kid={self.kid!r}, tenant={self.tenant!r}, status={self.status!r})"


def identity_of(view: KeyView) -> KeyIdentity:
    """Who a request on this key is, for the quota and the tenant's metrics; its ``limits`` None when the
    key has none of its own."""
    limits = view.limits.counted()
    return KeyIdentity(view.tenant, view.alias, view.kid, None if limits.empty else limits, view.tenant_index,
                       via=PREVIOUS_SECRET if view.previous else None)


def _one_pattern(globs: list[str]) -> re.Pattern[str]:
    """The globs as one regular expression; no glob at all allows no model."""
    return re.compile("|".join(map(translate, globs)) if globs else "(?!)")


def decode_entry(blob: bytes, slot: int) -> KeyEntry:
    return KeyEntry(_decode(blob), slot)


def decode_identity(blob: bytes) -> tuple[KeyIdentity, Status]:
    """A table blob as the quota sees its key, with the key's status: for reading every key of a table
    (the supervisor's budget gauge) without compiling each key's ``models`` globs as ``KeyEntry`` does."""
    view = _decode(blob)
    return identity_of(view), view.status


def _key_origins(entries: list[str]) -> OriginList:
    try:
        return parse_key_origins(entries)
    except ValueError:
        return _NO_ORIGIN


_NO_ORIGIN = OriginList(())  # admits no origin: every page is refused
