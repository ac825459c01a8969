"""The gateway configuration schema (docs/configuration.md) and its loader.

msgspec Structs with ``forbid_unknown_fields`` give us unknown-key rejection and
field paths for free; :mod:`gateway.yaml_config` turns msgspec's messages into one
line per problem that starts with the field path, which is what ``gridgate check``
prints. Every key is documented in docs/configuration.md (a test keeps them in step).
"""

from __future__ import annotations

import os
from typing import ClassVar, Literal

from gateway.config.cache import Cache, CacheBackend, Coalesce, cache_checks  # noqa: F401 - re-exported: importers use gateway.config
from gateway.config.client_auth import ClientAuth
from gateway.config.cors import Cors  # noqa: F401 - re-exported: importers use gateway.config
from gateway.config.jwt import JwksRefresh, JwtIssuer  # noqa: F401 - re-exported: importers use gateway.config
from gateway.config.keys import (  # noqa: F401 - re-exported: importers use gateway.config
    AdminToken,
    KeyStoreBackend,
    keys_checks,
)
from gateway.config.models import Alias, Fallback, Models, restore_on_keys  # noqa: F401 - re-exported: importers use gateway.config
from gateway.config.pricing import PriceOverride, Pricing  # noqa: F401 - re-exported: importers use gateway.config
from gateway.config.quota import (  # noqa: F401 - the auth and quota schema, re-exported like routing's
    MAX_COUNT,
    MAX_TOKENS,
    ApiKey,
    Auth,
    Estimate,
    Quota,
    QuotaBackend,
    QuotaBreaker,
    QuotaLease,
    QuotaMatch,
    QuotaRule,
    quota_checks,
)
from gateway.config.routing import (  # noqa: F401 - the routing schema, re-exported: importers use gateway.config
    Backoff,
    Conformance,
    Cooling,
    ModelFacts,
    ModelMatch,
    OverlayScope,
    OverlaySource,
    PrefixAffinity,
    Retry,
    Routing,
    SessionAffinity,
    TenantPolicy,
    is_header_name,
)
from gateway.config.tracing import Tracing  # noqa: F401 - re-exported: importers use gateway.config
from gateway.net import parse_host_port
from gateway.request.routes import parse_route_rule
from gateway.yaml_config import (  # noqa: F401 - Seconds, read_text and convert_yaml are re-exported
    DAY,
    HOUR,
    MINUTE,
    ConfigError,
    Range,
    Seconds,
    StrictStruct,
    check_ranges,
    convert_yaml,
    read_text,
)

# Every numeric key has a range, checked in its Struct's __post_init__ with check_ranges (a test feeds
# each one 0, -1 and a huge value). Durations are in seconds; the bounds keep values sane and keep
# timers and counters far from overflow.
MAX_WORKERS = 1024

_Strict = StrictStruct  # the one base of every YAML schema (the control plane's spec too)


class ServerTls(_Strict):
    """HTTPS on the data-plane listener; paths are relative to the config file."""

    cert_file: str
    key_file: str
    client_auth: ClientAuth | None = None  # client certificates (mTLS, docs/identity.md); off when absent

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name}: must name a file")


class Admin(_Strict):
    listen: str = "127.0.0.1:9901"
    tokens: list[AdminToken] = []  # bearer tokens of the admin API (docs/keys.md)

    def __post_init__(self) -> None:
        parse_host_port(self.listen)


class Limits(_Strict):
    max_header_bytes: int = 65536
    max_body_bytes: int = 10485760
    max_connections_per_worker: int = 10000
    # The response that reaches it carries `Connection: close`, so replaced or added workers get load.
    max_requests_per_connection: int = 1000
    max_url_bytes: int = 8192
    max_header_count: int = 100  # header lines per request head -> 431
    # Request bodies buffered by one worker, all connections together -> 503 + Retry-After.
    max_buffered_body_bytes_per_worker: int = 268435456

    _RANGES: ClassVar[dict[str, Range]] = {
        "max_header_bytes": (1024, 16 * 1024 * 1024),
        "max_body_bytes": (1, 1024 * 1024 * 1024),  # bodies are held in memory
        "max_connections_per_worker": (1, 1_000_000),
        "max_requests_per_connection": (1, MAX_COUNT),
        "max_url_bytes": (64, 1024 * 1024),
        "max_header_count": (1, 10_000),
        "max_buffered_body_bytes_per_worker": (1, 64 * 1024 * 1024 * 1024),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if self.max_buffered_body_bytes_per_worker < self.max_body_bytes:
            raise ValueError("max_buffered_body_bytes_per_worker: must be >= max_body_bytes "
                             "(a body of the largest allowed size must fit)")


class Timeouts(_Strict):
    header_read: Seconds = Seconds(10)
    keepalive_idle: Seconds = Seconds(75)
    graceful_shutdown: Seconds = Seconds(30)
    # A response whose client reads nothing this long is cut and its upstream connection freed.
    client_stall: Seconds = Seconds(60)
    body_read: Seconds = Seconds(60)  # the whole request body, from the end of its head -> 408

    _RANGES: ClassVar[dict[str, Range]] = {
        "header_read": (0.1, HOUR),
        "keepalive_idle": (0.1, DAY),
        "graceful_shutdown": (0, HOUR),  # 0: cut what is in flight at once
        "client_stall": (1, DAY),
        "body_read": (0.1, DAY),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class WeightedEndpoint(_Strict):
    address: str
    weight: int = 1

    def __post_init__(self) -> None:
        parse_host_port(self.address)
        if not 1 <= self.weight <= 1000:
            raise ValueError("weight: must be 1..1000")


class HashStrategy(_Strict):
    header: str | None = None


class Tls(_Strict):
    sni: str | None = None
    ca_file: str | None = None
    verify: bool = True


class UpstreamAuth(_Strict):
    value_env: str
    header: str = "Authorization"


class HealthCheck(_Strict):
    type: Literal["http", "tcp"] = "http"
    path: str = "/health"
    interval: Seconds = Seconds(5)
    timeout: Seconds = Seconds(2)
    healthy_threshold: int = 2
    unhealthy_threshold: int = 3

    _RANGES: ClassVar[dict[str, Range]] = {
        "interval": (0.1, HOUR),
        "timeout": (0.01, MINUTE),
        "healthy_threshold": (1, 100),
        "unhealthy_threshold": (1, 100),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class OutlierDetection(_Strict):
    consecutive_failures: int = 5
    base_ejection: Seconds = Seconds(30)
    max_ejection_percent: int = 50

    _RANGES: ClassVar[dict[str, Range]] = {
        "consecutive_failures": (0, 1000),  # 0: never eject
        "base_ejection": (0.1, HOUR),
        "max_ejection_percent": (1, 100),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


_SIMPLE_STRATEGIES = ("round_robin", "least_connections", "p2c", "random")


class Cluster(_Strict):
    name: str
    endpoints: list[str | WeightedEndpoint]
    load_balancer_strategy: str | dict[str, HashStrategy] = "round_robin"
    tls: bool | Tls = False
    connect_timeout: Seconds = Seconds(3)
    read_timeout: Seconds = Seconds(300)
    max_connections: int = 256
    upstream_auth: UpstreamAuth | None = None
    health_check: HealthCheck | None = None
    outlier_detection: OutlierDetection | None = None
    # "METHOD /path/glob" routes beyond the defaults, sent only to this cluster (docs/security.md).
    allowed_routes: list[str] = []

    _RANGES: ClassVar[dict[str, Range]] = {
        "connect_timeout": (0.01, 5 * MINUTE),
        "read_timeout": (0.1, DAY),
        "max_connections": (1, 100_000),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if not self.name:
            raise ValueError("name: must not be empty")
        for index, rule in enumerate(self.allowed_routes):
            try:
                parse_route_rule(rule)
            except ValueError as exc:
                raise ValueError(f"allowed_routes[{index}]: {exc}") from None
        if not self.endpoints:
            raise ValueError("endpoints: must not be empty")
        for entry in self.endpoints:
            if isinstance(entry, str):
                parse_host_port(entry)
        strategy = self.load_balancer_strategy
        if isinstance(strategy, str):
            if strategy not in _SIMPLE_STRATEGIES:
                raise ValueError(f"load_balancer_strategy: {strategy!r} is not one of {', '.join(_SIMPLE_STRATEGIES)}")
        elif len(strategy) != 1 or next(iter(strategy)) not in ("consistent_hash", "maglev"):
            raise ValueError("load_balancer_strategy: must be a name or {consistent_hash: {...}} / {maglev: {...}}")

    def weighted_endpoints(self) -> list[tuple[str, int]]:
        return [(e, 1) if isinstance(e, str) else (e.address, e.weight) for e in self.endpoints]


class AccessLog(_Strict):
    """One JSON line per request (docs/operations.md#access-log)."""

    enabled: bool = True
    path: str = "-"  # "-" = stdout; else a file, reopened on SIGUSR1 (resolve it with Config.file_path)
    sample: float = 1.0  # fraction of successful requests logged; errors always are
    evidence_sample: float = 0.01  # fraction of routed requests whose line carries the route evidence

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise ValueError("path: must be '-' (stdout) or a file path")
        for name in ("sample", "evidence_sample"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be between 0.0 and 1.0")


class Config(_Strict):
    clusters: list[Cluster]
    routing: Routing
    listen: str = "127.0.0.1:8080"
    server_tls: ServerTls | None = None
    workers: int | Literal["auto"] = "auto"
    admin: Admin = Admin()
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    tenants: list[TenantPolicy] = []
    access_log: AccessLog = AccessLog()
    auth: Auth | None = None
    quota: Quota | None = None
    pricing: Pricing = Pricing()  # prices of models, for spend (docs/pricing.md)
    cors: Cors | None = None  # browser clients (docs/cors.md); off when absent
    models: Models = Models()  # aliases and fallback chains across models (docs/models.md)
    tracing: Tracing | None = None  # OpenTelemetry traces (docs/tracing.md); off when absent
    cache: Cache | None = None  # the exact response cache (docs/cache.md); off when absent
    # Where the config file lives; relative paths (overlay_file) resolve against it.
    base_dir: str = "."

    def worker_count(self) -> int:
        return os.cpu_count() or 1 if self.workers == "auto" else int(self.workers)

    def file_path(self, path: str) -> str:
        """A path from the file, resolved against the config file's directory."""
        return os.path.join(self.base_dir, path)

    def overlay_path(self) -> str | None:
        path = self.routing.overlay_file
        return None if path is None else self.file_path(path)

    def cluster(self, name: str) -> Cluster | None:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        return None


def _cross_checks(config: Config) -> list[str]:
    """Checks that span fields; each problem names its field. Secrets are checked in gateway.check."""
    problems = []
    names = [c.name for c in config.clusters]
    for index, name in enumerate(names):
        if names.index(name) != index:
            problems.append(f"clusters[{index}].name: duplicate cluster name {name!r}")
    for field in ("listen",):
        try:
            parse_host_port(getattr(config, field))
        except ValueError as exc:
            problems.append(f"{field}: {exc}")
    if config.workers != "auto" and not 1 <= int(config.workers) <= MAX_WORKERS:
        problems.append(f"workers: must be 'auto' or an integer 1..{MAX_WORKERS}")
    for index, cluster in enumerate(config.clusters):
        if cluster.upstream_auth is not None and not is_header_name(cluster.upstream_auth.header):
            problems.append(f"clusters[{index}].upstream_auth.header: not a valid header name")
    return (problems + _routing_checks(config, set(names)) + _tenant_checks(config) + quota_checks(config.auth, config.quota)
            + keys_checks(config.admin.tokens, config.admin.listen) + cache_checks(config.cache, config.quota is not None))


def managed_keys_enabled(config: Config) -> bool:
    """Managed keys need authentication and a store: the quota backend's Valkey, or ``auth.store``."""
    return config.auth is not None and (config.quota is not None or config.auth.store is not None)


def _routing_checks(config: Config, cluster_names: set[str]) -> list[str]:
    routing, problems = config.routing, []
    if routing.overlay_file is None and routing.candidates is None and routing.overlay_source is None:
        problems.append("routing.overlay_file: required key is missing (or give routing.overlay_source, "
                        "or routing.candidates inline)")
    elif routing.candidates is not None and (routing.overlay_file is not None or routing.overlay_source is not None):
        problems.append("routing.candidates: give either inline candidates or routing.overlay_file/overlay_source, "
                        "not both")
    for index, name in enumerate(routing.provider_hop_clusters):
        if name not in cluster_names:
            problems.append(f"routing.provider_hop_clusters[{index}]: unknown cluster {name!r}")
    for index, entry in enumerate(routing.models):
        if entry.match.cluster is not None and entry.match.cluster not in cluster_names:
            problems.append(f"routing.models[{index}].match.cluster: unknown cluster {entry.match.cluster!r}")
    affinity = routing.session_affinity
    if affinity.enabled and not (affinity.header or affinity.cookie):
        problems.append("routing.session_affinity: enabled needs a header or a cookie")
    return problems


def _tenant_checks(config: Config) -> list[str]:
    problems = []
    names = [policy.tenant for policy in config.tenants]
    # With managed keys, tenants also come from the key store: they cannot be checked here.
    known = None if config.auth is None or managed_keys_enabled(config) else {key.tenant for key in config.auth.keys}
    for index, name in enumerate(names):
        if names.index(name) != index:
            problems.append(f"tenants[{index}].tenant: duplicate tenant {name!r}")
        elif known is not None and name not in known:
            # A misspelt policy would silently leave the real tenant unrestricted.
            problems.append(f"tenants[{index}].tenant: {name!r} has no key in auth.keys")
    return problems


def parse_config(text: str, base_dir: str = ".", source: str | None = None) -> Config:
    """Parse YAML text into a validated Config; raise ConfigError naming each bad field."""
    config = convert_yaml(text, Config, {"base_dir": base_dir}, source, restore_on_keys)
    problems = _cross_checks(config)
    if problems:
        raise ConfigError(problems)
    return config


def load_config(path: str) -> Config:
    return parse_config(read_text(path), base_dir=os.path.dirname(os.path.abspath(path)), source=path)
