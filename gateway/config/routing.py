"""The routing part of the gateway configuration: ``routing`` and ``tenants`` (docs/configuration.md).

Split from :mod:`gateway.config` (which re-exports every name here) so each schema module stays
small; the rules are the same: strict Structs, every numeric key with a range (``check_ranges``).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

import msgspec

from gateway.request.routes import mcp_path_problem
from gateway.yaml_config import DAY, HOUR, MINUTE, Range, Seconds, StrictStruct, check_ranges

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def is_header_name(text: str) -> bool:
    """An HTTP field name (RFC 9110 token)."""
    return _HEADER_NAME.fullmatch(text) is not None


class SessionAffinity(StrictStruct):
    enabled: bool = False
    header: str | None = "X-Session-Id"
    cookie: str | None = None
    ttl: Seconds = Seconds(3600)
    capacity: int = 65536

    _RANGES: ClassVar[dict[str, Range]] = {"ttl": (1, 30 * DAY), "capacity": (8, 16 * 1024 * 1024)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class OverlayScope(StrictStruct):
    network: str | None = None
    gateway: str | None = None
    namespace: str | None = None
    local_site: str | None = None


class Backoff(StrictStruct):
    base: Seconds = Seconds(0.01)
    max: Seconds = Seconds(0.5)

    _RANGES: ClassVar[dict[str, Range]] = {"base": (0, MINUTE), "max": (0, 10 * MINUTE)}  # 0: no pause

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if self.max < self.base:
            raise ValueError("max: must be >= base")


class Retry(StrictStruct):
    """Provider-level failover (docs/routing.md#failover): attempts and deadline for all providers
    together."""

    attempts: int = 3
    deadline: Seconds = Seconds(30)
    backoff: Backoff = Backoff()
    first_byte_timeout: Seconds | None = None

    _RANGES: ClassVar[dict[str, Range]] = {
        "attempts": (1, 100),  # 1 = no failover
        "deadline": (0.01, HOUR),
        "first_byte_timeout": (0.01, HOUR),  # or null for none
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class Cooling(StrictStruct):
    """How long a provider answering 429/503 is skipped; its Retry-After wins, capped at ``max``."""

    default: Seconds = Seconds(5)
    max: Seconds = Seconds(300)

    _RANGES: ClassVar[dict[str, Range]] = {"default": (0.01, HOUR), "max": (0.01, DAY)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if self.max < self.default:
            raise ValueError("max: must be >= default")


class LeastLoaded(StrictStruct):
    """The ``least_loaded`` picker's expectation of a provider it has no recent measurement of
    (gateway.routing.providers, docs/routing.md)."""

    latency_prior: Seconds | None = None  # an unmeasured provider's first-byte latency; None: the group's median
    latency_half_life: Seconds = Seconds(30)  # a measurement counts half after this long without a new one

    _RANGES: ClassVar[dict[str, Range]] = {"latency_prior": (0.001, HOUR), "latency_half_life": (0.1, DAY)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class PrefixAffinity(StrictStruct):
    """``routing.prefix_affinity`` (docs/routing.md, "Prefix affinity"): requests whose prompts start
    alike go to the same provider of their group, so its prompt cache serves them."""

    enabled: bool = False
    prefix_tokens: int = 1024  # the leading prompt content hashed, in tokens (about 4 bytes each)
    spill_at: float = 0.5  # a prefix spills to the next provider past this share of a provider's capacity
    capacity: int = 64  # requests in flight one provider takes well (per host): spill_at's whole
    misses: int = 4  # consecutive cache misses on its provider that move a prefix to the next one
    slow_first_token: Seconds | None = None  # a first token slower than this moves the prefix on; None: never
    table_size: int = 4096  # slots of the prefix table the host's workers share (fixed at start)

    _RANGES: ClassVar[dict[str, Range]] = {
        "prefix_tokens": (16, 1_000_000), "spill_at": (0.01, 1.0), "capacity": (1, 1_000_000),
        "misses": (1, 1000), "slow_first_token": (0.001, HOUR), "table_size": (16, 1_000_000),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


_STABLE_HASH_FACTS = ("tenant", "session", "request_id")


def _check_stable_hash_key(parts: list[str]) -> None:
    if not parts:
        raise ValueError("stable_hash_key: must name at least one request fact")
    for index, part in enumerate(parts):
        name = part[len("header:"):] if part.startswith("header:") else None
        if part not in _STABLE_HASH_FACTS and not (name and is_header_name(name)):
            raise ValueError(f"stable_hash_key[{index}]: {part!r} is not tenant, session, request_id "
                             "or header:<Name>")
        if parts.index(part) != index:
            raise ValueError(f"stable_hash_key[{index}]: {part!r} is listed twice")


class ModelMatch(StrictStruct):
    capability: str  # glob over the capability (model) name, e.g. "gpt-4o*"
    cluster: str | None = None

    def __post_init__(self) -> None:
        if not self.capability:
            raise ValueError("capability: must not be empty (use \"*\" for every capability)")


class ModelFacts(StrictStruct):
    """Request-aware eligibility facts of the candidates it matches
    (docs/routing.md#request-aware-selection)."""

    match: ModelMatch
    context_window: int | None = None
    features: list[Literal["tools", "vision", "json_schema", "audio", "embeddings"]] | None = None
    region: str | None = None
    traffic_weight: int | None = None

    _RANGES: ClassVar[dict[str, Range]] = {"context_window": (1, 1_000_000_000)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if self.region is not None and not self.region:
            raise ValueError("region: must not be empty")
        if self.traffic_weight is not None and not 1 <= self.traffic_weight <= 1000:
            raise ValueError("traffic_weight: must be 1..1000")


class OverlaySource(StrictStruct):
    """``routing.overlay_source``: follow an overlay published in Valkey (docs/fleet.md)."""

    kind: Literal["valkey"]
    url: str  # as quota.backend.url: valkey://, valkeys:// (TLS), redis://, rediss://, unix://, user:password@
    key: str
    poll_interval: Seconds = Seconds(5)  # re-read the key this often even without a publish notification
    # The last accepted document, which the workers follow and a restart serves while Valkey is down.
    # Default: $STATE_DIRECTORY/overlay-cache.json under systemd, else a private temporary directory.
    cache_file: str | None = None

    _RANGES: ClassVar[dict[str, Range]] = {"poll_interval": (0.1, HOUR)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if not self.key.strip() or any(ch.isspace() for ch in self.key):
            raise ValueError("key: must be a key name without spaces")


class Conformance(StrictStruct):
    """``routing.conformance``: the supervisor rechecks every provider with the checks of
    ``gridgate providers verify`` (docs/provider-conformance.md#in-the-pool); absent: never."""

    required: bool = True  # a provider that failed a required check is left out of selection
    recheck: Seconds = Seconds(3600)  # how often every provider is checked again
    surfaces: list[Literal["chat", "completions", "embeddings", "responses", "messages"]] = msgspec.field(
        default_factory=lambda: ["chat"])  # the APIs the pool serves
    max_tokens: int = 16  # output tokens each check request asks for at most
    timeout: Seconds = Seconds(30)  # deadline of one check, all its requests together

    _RANGES: ClassVar[dict[str, Range]] = {"recheck": (10, 30 * DAY), "max_tokens": (1, 4096),
                                           "timeout": (0.1, 10 * MINUTE)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if not self.surfaces:
            raise ValueError("surfaces: must name at least one API")


class Routing(StrictStruct):
    overlay_file: str | None = None
    # Instead of (or, as the fallback at a start without Valkey, beside) the file: a Valkey key.
    overlay_source: OverlaySource | None = None
    # Warn when the serving overlay was rendered longer ago than this (a dead control plane); None: never.
    overlay_max_age: Seconds | None = None
    # Instead of a file: the overlay's candidate objects inline (a legacy overlay, local_site "inline",
    # deterministic selection); changed by a config reload.
    candidates: list[dict[str, Any]] | None = None
    model_header: str = "X-Model"
    session_affinity: SessionAffinity = SessionAffinity()
    expected_overlay_scope: OverlayScope = OverlayScope()
    route_headers: bool = True
    provider_hop_clusters: list[str] = []
    reload_debounce: Seconds = Seconds(0.5)
    retry: Retry = Retry()
    cooling: Cooling = Cooling()
    picker: Literal["overlay", "weighted", "stable_hash", "least_loaded"] = "overlay"
    least_loaded: LeastLoaded = LeastLoaded()
    stable_hash_key: list[str] = msgspec.field(default_factory=lambda: ["tenant", "session"])
    prefix_affinity: PrefixAffinity = PrefixAffinity()
    models: list[ModelFacts] = []
    pin_header: str = "X-Gridgate-Pin"
    # The MCP endpoint (streamable HTTP: POST, GET, DELETE); null: none (docs/security.md).
    mcp_path: str | None = "/mcp"
    conformance: Conformance | None = None  # provider conformance rechecks (docs/provider-conformance.md)

    _RANGES: ClassVar[dict[str, Range]] = {"overlay_max_age": (1, 365 * DAY), "reload_debounce": (0, MINUTE)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        _check_stable_hash_key(self.stable_hash_key)
        problem = None if self.mcp_path is None else mcp_path_problem(self.mcp_path)
        if problem:
            raise ValueError(f"mcp_path: {self.mcp_path!r} {problem}")
        for name in ("model_header", "pin_header"):
            if not is_header_name(getattr(self, name)):
                raise ValueError(f"{name}: not a valid header name")


class TenantPolicy(StrictStruct):
    """Routing policy of one tenant (docs/routing.md#request-aware-selection); an omitted list means no
    restriction."""

    tenant: str
    allowed_capabilities: list[str] | None = None  # globs over capability names
    allowed_regions: list[str] | None = None
    may_pin: bool = False
    priority: Literal["interactive", "batch"] = "interactive"

    def __post_init__(self) -> None:
        if not self.tenant:
            raise ValueError("tenant: must not be empty")
        for name in ("allowed_capabilities", "allowed_regions"):
            values = getattr(self, name)
            if values is not None and not values:
                raise ValueError(f"{name}: must not be empty (omit the key for no restriction)")
            if values is not None and not all(values):
                raise ValueError(f"{name}: entries must not be empty")
