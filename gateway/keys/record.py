"""The managed-key record (docs/keys.md): its schema, the admin API's request bodies and their checks.

Pure data. The admin API decodes a body into ``CreateKey`` / ``PatchKey`` with ``decode_body``, which
answers a ``BodyProblem`` naming the field (``limits.requests[0].count: expected an integer, got 'x'``)
and never echoes a value that could be a secret. The store (``store.py``) keeps a ``KeyRecord`` as JSON:
it holds the digests of the key's secrets, so only ``public_record`` of it ever leaves the store.

A key's ``limits`` are ``gateway.identity.key_limits.KeyLimits``, the type a YAML key's are: the same
fields, checks and messages; durations in them are written as in the YAML config (``1m``, ``24h``) and
kept in that form, normalised (``60s`` becomes ``1m``). Times are RFC 3339 in the API and Unix seconds
in the store.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

import msgspec

from gateway.identity.key_limits import KeyLimits
from gateway.request.cors import parse_key_origins
from gateway.yaml_config import DAY, StrictStruct, decode_hook, parse_duration, validation_problem

Status = Literal["active", "blocked", "revoked"]
ACTIVE: Status = "active"
BLOCKED: Status = "blocked"
REVOKED: Status = "revoked"

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")  # tenants and aliases
MAX_MODELS = 32
MAX_PATTERN_CHARS = 128
MAX_ORIGINS = 16
MAX_ORIGIN_CHARS = 256
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 256
MAX_PREVIOUS_SECRETS = 4  # secrets still in their rotation grace, per key
MAX_ENDED_SECRETS = 8  # ended ones a record still names (so every host drops them), per key
ENDED_SECRET_RETENTION_S = 86_400


class BodyProblem(Exception):
    """A request body the admin API refuses (400); the message starts with the field it names."""


# ------------------------------------------------------------------------------------------- fields


def check_name(value: str, field: str) -> None:
    if NAME_PATTERN.fullmatch(value) is None:
        raise ValueError(f"{field}: must be 1..64 characters of A-Z a-z 0-9 . _ -")


def check_models(models: list[str] | None) -> None:
    if models is None:
        return
    if len(models) > MAX_MODELS:
        raise ValueError(f"models: at most {MAX_MODELS} patterns")
    for index, pattern in enumerate(models):
        if not 1 <= len(pattern) <= MAX_PATTERN_CHARS or not pattern.isprintable() or pattern != pattern.strip():
            raise ValueError(f"models[{index}]: must be a model name or glob of 1..{MAX_PATTERN_CHARS} "
                             "printable characters")


def check_origins(origins: list[str] | None) -> None:
    if origins is None:
        return
    if len(origins) > MAX_ORIGINS:
        raise ValueError(f"allowed_origins: at most {MAX_ORIGINS} origins")
    for index, origin in enumerate(origins):
        if len(origin) > MAX_ORIGIN_CHARS:
            raise ValueError(f"allowed_origins[{index}]: longer than {MAX_ORIGIN_CHARS} characters")
    try:  # the data plane's own parser (gateway/request/cors.py): what it cannot use is refused here
        parse_key_origins(origins)
    except ValueError as exc:
        raise ValueError(f"allowed_origins{exc}") from None


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY_CHARS or not key.isprintable():
            raise ValueError(f"metadata: keys must be 1..{MAX_METADATA_KEY_CHARS} printable characters")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata[{key!r}]: longer than {MAX_METADATA_VALUE_CHARS} characters")


def parse_time(text: str, field: str) -> int:
    """RFC 3339 (``2026-01-31T00:00:00Z``) -> Unix seconds."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{field}: must be an RFC 3339 time such as 2026-01-31T00:00:00Z") from None
    if moment.tzinfo is None:
        raise ValueError(f"{field}: needs a time zone (Z or +hh:mm)")
    return int(moment.timestamp())


def format_time(seconds: int | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------- bodies


class CreateKey(StrictStruct):
    """``POST /admin/keys``."""

    tenant: str
    alias: str | None = None
    models: list[str] | None = None  # None: the tenant's allowed_capabilities
    limits: KeyLimits = KeyLimits()
    expires_at: str | None = None
    allowed_origins: list[str] | None = None  # None: any origin CORS allows
    metadata: dict[str, str] = {}

    def __post_init__(self) -> None:
        check_name(self.tenant, "tenant")
        if self.alias is not None:
            check_name(self.alias, "alias")
        check_models(self.models)
        check_origins(self.allowed_origins)
        check_metadata(self.metadata)
        if self.expires_at is not None:
            parse_time(self.expires_at, "expires_at")


class PatchKey(StrictStruct):
    """``PATCH /admin/keys/{kid}``: the fields it names replace the record's (metadata whole)."""

    alias: str | None | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | None | msgspec.UnsetType = msgspec.UNSET
    limits: KeyLimits | msgspec.UnsetType = msgspec.UNSET
    expires_at: str | None | msgspec.UnsetType = msgspec.UNSET
    allowed_origins: list[str] | None | msgspec.UnsetType = msgspec.UNSET
    metadata: dict[str, str] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if isinstance(self.alias, str):
            check_name(self.alias, "alias")
        if not isinstance(self.models, msgspec.UnsetType):
            check_models(self.models)
        if not isinstance(self.allowed_origins, msgspec.UnsetType):
            check_origins(self.allowed_origins)
        if isinstance(self.metadata, dict):
            check_metadata(self.metadata)
        if isinstance(self.expires_at, str):
            parse_time(self.expires_at, "expires_at")

    def changes(self) -> dict[str, Any]:
        """The fields the body set, in the store's form (times as Unix seconds)."""
        found: dict[str, Any] = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, msgspec.UnsetType):
                continue
            if name == "expires_at" and value is not None:
                value = parse_time(value, name)
            found[name] = value
        return found


class Rotate(StrictStruct):
    """``POST /admin/keys/{kid}/rotate``: how long the previous secret keeps working."""

    grace: str = "0s"

    _MAX_GRACE: ClassVar[float] = 30 * DAY

    def __post_init__(self) -> None:
        try:
            seconds = parse_duration(self.grace)
        except ValueError as exc:
            raise ValueError(f"grace: {exc}") from None
        if seconds > self._MAX_GRACE:
            raise ValueError("grace: must be <= 30d")

    def seconds(self) -> int:
        return int(parse_duration(self.grace))


def decode_body(body: bytes, kind: type[Any]) -> Any:
    """The JSON ``body`` as ``kind``; ``BodyProblem`` naming the field otherwise."""
    if not body.strip():
        body = b"{}"
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise BodyProblem("body: malformed JSON (send a JSON object)") from None
    if not isinstance(raw, dict):
        raise BodyProblem("body: must be a JSON object")
    try:
        return msgspec.convert(raw, kind, dec_hook=decode_hook)
    except msgspec.ValidationError as exc:
        raise BodyProblem(validation_problem(exc, kind, raw)) from None


# ------------------------------------------------------------------------------------------- stored


class PreviousSecret(msgspec.Struct, frozen=True):
    """A secret replaced by a rotation, valid until ``until`` (Unix seconds)."""

    digest: str  # hex
    until: int


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the store keeps for one key (JSON). ``digest`` and ``previous`` never leave the store."""

    kid: str
    tenant: str
    status: Status
    digest: str  # SHA-256 of the whole key, hex
    created_at: int
    created_by: str
    updated_at: int
    version: int  # bumped by every change: the store's compare-and-set
    alias: str | None = None
    models: list[str] | None = None
    limits: KeyLimits = KeyLimits()
    expires_at: int | None = None
    allowed_origins: list[str] | None = None
    metadata: dict[str, str] = {}
    previous: list[PreviousSecret] = []

    def ended(self, now: float) -> list[str]:
        """Digests (hex) of previous secrets whose grace is over: a host still holding one drops it."""
        return [previous.digest for previous in self.previous if previous.until <= now]

    def secrets(self, now: float) -> list[tuple[str, int | None]]:
        """(digest hex, expires_at) of every secret that opens this key: the current one, then those
        still in their rotation grace (each ends at its grace or the key's own expiry, whichever first)."""
        found: list[tuple[str, int | None]] = [(self.digest, self.expires_at)]
        for previous in self.previous:
            if previous.until > now:
                ends = previous.until if self.expires_at is None else min(previous.until, self.expires_at)
                found.append((previous.digest, ends))
        return found


_record_decoder = msgspec.json.Decoder(KeyRecord, dec_hook=decode_hook)
_encoder = msgspec.json.Encoder()


def encode_record(record: KeyRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes) -> KeyRecord:
    return _record_decoder.decode(data)


def public_record(record: KeyRecord, last_used_at: int | None, now: float) -> dict[str, Any]:
    """The record as the admin API answers it at ``now``: no digest, times in RFC 3339."""
    return {
        "kid": record.kid,
        "tenant": record.tenant,
        "alias": record.alias,
        "status": record.status,
        "models": record.models,
        "limits": record.limits.body(),
        "expires_at": format_time(record.expires_at),
        "allowed_origins": record.allowed_origins,
        "metadata": record.metadata,
        "created_at": format_time(record.created_at),
        "created_by": record.created_by,
        "updated_at": format_time(record.updated_at),
        "last_used_at": format_time(last_used_at),
        "previous_secrets_valid_until": [format_time(p.until) for p in record.previous if p.until > now],
    }
