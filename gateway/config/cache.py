"""The ``cache`` block of the gateway configuration (docs/configuration.md, docs/cache.md).

Split from :mod:`gateway.config` (which re-exports it). The exact response cache is off when the block
is absent or ``enabled`` is false; with it, answers to repeated deterministic requests are kept in
Valkey (the quota's by default) and served again without reaching a provider.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from gateway.config.keys import check_backend_url
from gateway.yaml_config import DAY, Range, Seconds, StrictStruct, check_ranges

_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB)?\s*$")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024 * 1024}
MAX_ENTRY_LIMIT = 64 * 1024 * 1024  # an entry is one Valkey string: keep it far below its 512 MiB


def parse_size(value: int | str) -> int:
    """``1MiB``, ``512KiB``, ``4096`` (bytes): ValueError otherwise."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(f"invalid size {value!r} (an integer of bytes, or with unit B, KiB or MiB)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


class CacheBackend(StrictStruct):
    """Where entries live when they are not in the quota's Valkey."""

    kind: Literal["valkey"] = "valkey"
    url: str | None = None

    def __post_init__(self) -> None:
        check_backend_url(self.kind, self.url)


class Coalesce(StrictStruct):
    """Identical cacheable requests in flight share one upstream call (docs/cache.md, "Coalescing")."""

    enabled: bool = True
    max_waiters: int = 64  # requests waiting on one leader, at most; more go upstream on their own
    wait: Seconds = Seconds(30)  # a waiter's patience; then it goes upstream on its own

    _RANGES: ClassVar[dict[str, Range]] = {"max_waiters": (1, 10_000), "wait": (0.001, 600)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class LocalCopies(StrictStruct):
    """Each worker's own copies of recent entries: a hit from them takes no Valkey round trip."""

    max_bytes: int | str = "32MiB"
    ttl: Seconds = Seconds(60)  # a copy lives this long at most (and never past its entry's own expiry)

    _RANGES: ClassVar[dict[str, Range]] = {"ttl": (0.001, DAY)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        try:
            size = parse_size(self.max_bytes)
        except ValueError as error:
            raise ValueError(f"max_bytes: {error}") from None
        if not 1 <= size <= 1024 * 1024 * 1024:
            raise ValueError("max_bytes: must be between 1 B and 1024 MiB")

    @property
    def max_bytes_int(self) -> int:
        return parse_size(self.max_bytes)


class HostIndex(StrictStruct):
    """The host's index of the keys known in the fleet: a miss of a key nobody has awaits no Valkey call."""

    capacity: int = 1_048_576  # keys the index tells apart (32 B of shared memory each, touched as used)

    _RANGES: ClassVar[dict[str, Range]] = {"capacity": (1024, 64 * 1024 * 1024)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class Cache(StrictStruct):
    """The exact response cache (off unless ``enabled``)."""

    enabled: bool = False
    backend: CacheBackend | None = None  # None: the quota's Valkey
    ttl: Seconds = Seconds(3600)
    max_entry: int | str = "1MiB"  # answers larger than this are never stored
    # The body members that make the key (besides the model after aliases); None: every member but the
    # API's ignored ones (docs/cache.md, "The key").
    key_fields: list[str] | None = None
    only_deterministic: bool = True  # only temperature 0 or a seed (embeddings always)
    tenants: Literal["isolated", "shared"] = "isolated"
    coalesce: Coalesce = Coalesce()
    local: LocalCopies | None = LocalCopies()  # null: every hit reads Valkey
    # Off (None) by default: every miss awaits its lookup, which measured cheaper per request than following
    # the fleet's announcements (docs/cache.md, "The host index"); {} turns it on (a miss of a key nobody
    # has then awaits nothing: lower latency at low load).
    index: HostIndex | None = None

    _RANGES: ClassVar[dict[str, Range]] = {"ttl": (1, 30 * DAY)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        try:
            size = parse_size(self.max_entry)
        except ValueError as error:
            raise ValueError(f"max_entry: {error}") from None
        if not 1 <= size <= MAX_ENTRY_LIMIT:
            raise ValueError(f"max_entry: must be between 1 B and {MAX_ENTRY_LIMIT // (1024 * 1024)} MiB")
        if self.key_fields is not None:
            if not self.key_fields:
                raise ValueError("key_fields: must name at least one body member (or be left out)")
            for name in self.key_fields:
                if not name or name == "model":
                    raise ValueError(f"key_fields: {name!r}: the model is always in the key; name body members")

    @property
    def max_entry_bytes(self) -> int:
        return parse_size(self.max_entry)


def cache_checks(cache: Cache | None, has_quota: bool) -> list[str]:
    """The cache needs a Valkey: the quota's, or its own backend."""
    if cache is None or not cache.enabled:
        return []
    if cache.backend is None and not has_quota:
        return ["cache.backend: the cache needs a Valkey: give cache.backend.url, or a quota block (its "
                "Valkey is the cache's by default)"]
    return []
