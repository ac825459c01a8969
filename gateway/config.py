"""The gateway configuration schema (CONTRACT §2) and its loader.

msgspec Structs with ``forbid_unknown_fields`` give us unknown-key rejection and
field paths for free; :mod:`gateway.yaml_config` turns msgspec's messages into one
line per problem that starts with the field path, which is what ``gridgate check``
prints. Every key is documented in docs/configuration.md (a test keeps them in step).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import msgspec

from gateway.auth import is_key_digest
from gateway.net import parse_host_port
from gateway.yaml_config import ConfigError, Seconds, convert_yaml, read_text

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def is_header_name(text: str) -> bool:
    """An HTTP field name (RFC 9110 token)."""
    return _HEADER_NAME.fullmatch(text) is not None


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class ServerTls(_Strict):
    """HTTPS on the data-plane listener; paths are relative to the config file."""

    cert_file: str
    key_file: str

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name}: must name a file")


class Admin(_Strict):
    listen: str = "127.0.0.1:9901"

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

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.max_buffered_body_bytes_per_worker < self.max_body_bytes:
            raise ValueError("max_buffered_body_bytes_per_worker: must be >= max_body_bytes "
                             "(a body of the largest allowed size must fit)")


class Timeouts(_Strict):
    header_read: Seconds = Seconds(10)
    keepalive_idle: Seconds = Seconds(75)
    graceful_shutdown: Seconds = Seconds(30)
    body_read: Seconds = Seconds(60)  # the whole request body, from the end of its head -> 408

    def __post_init__(self) -> None:
        if self.body_read <= 0:
            raise ValueError("body_read: must be > 0")


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


class OutlierDetection(_Strict):
    consecutive_failures: int = 5
    base_ejection: Seconds = Seconds(30)
    max_ejection_percent: int = 50


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

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
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
        if self.max_connections < 1:
            raise ValueError("max_connections: must be >= 1")

    def weighted_endpoints(self) -> list[tuple[str, int]]:
        return [(e, 1) if isinstance(e, str) else (e.address, e.weight) for e in self.endpoints]


class SessionAffinity(_Strict):
    enabled: bool = False
    header: str | None = "X-Session-Id"
    cookie: str | None = None
    ttl: Seconds = Seconds(3600)
    capacity: int = 65536

    def __post_init__(self) -> None:
        if self.capacity < 8:
            raise ValueError("capacity: must be >= 8 bindings")


class OverlayScope(_Strict):
    network: str | None = None
    gateway: str | None = None
    namespace: str | None = None
    local_site: str | None = None

    def is_configured(self) -> bool:
        return any(v is not None for v in (self.network, self.gateway, self.namespace, self.local_site))


class Backoff(_Strict):
    base: Seconds = Seconds(0.01)
    max: Seconds = Seconds(0.5)

    def __post_init__(self) -> None:
        if self.max < self.base:
            raise ValueError("max: must be >= base")


class Retry(_Strict):
    """Provider-level failover (CONTRACT §11): attempts and deadline for all providers together."""

    attempts: int = 3
    deadline: Seconds = Seconds(30)
    backoff: Backoff = Backoff()
    first_byte_timeout: Seconds | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts: must be >= 1 (1 = no failover)")
        if self.deadline <= 0:
            raise ValueError("deadline: must be > 0")
        if self.first_byte_timeout is not None and self.first_byte_timeout <= 0:
            raise ValueError("first_byte_timeout: must be > 0 (or null for none)")


class Cooling(_Strict):
    """How long a provider answering 429/503 is skipped; its Retry-After wins, capped at ``max``."""

    default: Seconds = Seconds(5)
    max: Seconds = Seconds(300)

    def __post_init__(self) -> None:
        if self.default <= 0:
            raise ValueError("default: must be > 0")
        if self.max < self.default:
            raise ValueError("max: must be >= default")


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


class ModelMatch(_Strict):
    capability: str  # glob over the capability (model) name, e.g. "gpt-4o*"
    cluster: str | None = None

    def __post_init__(self) -> None:
        if not self.capability:
            raise ValueError("capability: must not be empty (use \"*\" for every capability)")


class ModelFacts(_Strict):
    """Request-aware eligibility facts of the candidates it matches (CONTRACT §12)."""

    match: ModelMatch
    context_window: int | None = None
    features: list[Literal["tools", "vision", "json_schema", "audio", "embeddings"]] | None = None
    region: str | None = None
    traffic_weight: int | None = None

    def __post_init__(self) -> None:
        if self.context_window is not None and self.context_window < 1:
            raise ValueError("context_window: must be >= 1 token")
        if self.region is not None and not self.region:
            raise ValueError("region: must not be empty")
        if self.traffic_weight is not None and not 1 <= self.traffic_weight <= 1000:
            raise ValueError("traffic_weight: must be 1..1000")


class OverlaySource(_Strict):
    """``routing.overlay_source``: follow an overlay published in Valkey (CONTRACT §13, docs/fleet.md)."""

    kind: Literal["valkey"]
    url: str  # as quota.backend.url: valkey://, valkeys:// (TLS), redis://, rediss://, unix://, user:password@
    key: str
    poll_interval: Seconds = Seconds(5)  # re-read the key this often even without a publish notification
    # The last accepted document, which the workers follow and a restart serves while Valkey is down.
    # Default: $STATE_DIRECTORY/overlay-cache.json under systemd, else a private temporary directory.
    cache_file: str | None = None

    def __post_init__(self) -> None:
        if not self.key.strip() or any(ch.isspace() for ch in self.key):
            raise ValueError("key: must be a key name without spaces")
        if self.poll_interval <= 0:
            raise ValueError("poll_interval: must be > 0")


class Routing(_Strict):
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
    stable_hash_key: list[str] = msgspec.field(default_factory=lambda: ["tenant", "session"])
    models: list[ModelFacts] = []
    pin_header: str = "X-Gridgate-Pin"

    def __post_init__(self) -> None:
        _check_stable_hash_key(self.stable_hash_key)
        for name in ("model_header", "pin_header"):
            if not is_header_name(getattr(self, name)):
                raise ValueError(f"{name}: not a valid header name")


class TenantPolicy(_Strict):
    """Routing policy of one tenant (CONTRACT §12); an omitted list means no restriction."""

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


class AccessLog(_Strict):
    """One JSON line per request (CONTRACT §14)."""

    enabled: bool = True
    path: str = "-"  # "-" = stdout; else a file, reopened on SIGUSR1 (resolve it with Config.file_path)
    sample: float = 1.0  # fraction of successful requests logged; errors always are

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise ValueError("path: must be '-' (stdout) or a file path")
        if not 0.0 <= self.sample <= 1.0:
            raise ValueError("sample: must be between 0.0 and 1.0")


class ApiKey(_Strict):
    tenant: str
    key: str

    def __post_init__(self) -> None:
        if not is_key_digest(self.key):
            raise ValueError("key: must be 'sha256:<64 lowercase hex>' (see `gridgate keys hash`)")


class Auth(_Strict):
    keys: list[ApiKey] = []


# Quota backend URL schemes: one node, or a seed node of a Valkey Cluster (the topology is discovered).
QUOTA_NODE_SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix")
QUOTA_CLUSTER_SCHEMES = ("valkey+cluster", "valkeys+cluster")


def quota_url_problem(url: str) -> str | None:
    """None if ``url`` is a backend URL the quota ledger can use, else why not."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        return "expected a URL such as valkey://host:6379/0"
    if scheme not in QUOTA_NODE_SCHEMES + QUOTA_CLUSTER_SCHEMES:
        allowed = ", ".join(f"{s}://" for s in QUOTA_NODE_SCHEMES + QUOTA_CLUSTER_SCHEMES)
        return f"unsupported scheme {scheme}:// (use one of {allowed})"
    if scheme in QUOTA_CLUSTER_SCHEMES and ":" not in rest.rsplit("@", 1)[-1].split("/", 1)[0]:
        return f"{scheme}:// needs host:port of one cluster node"
    return None


def single_node_url(url: str) -> str:
    """``url`` for its node alone: a ``valkey+cluster://`` / ``valkeys+cluster://`` seed becomes
    ``valkey://`` / ``valkeys://``; other URLs stay as they are."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in QUOTA_CLUSTER_SCHEMES:
        return f"{scheme.lower().removesuffix('+cluster')}{sep}{rest}"
    return url


class QuotaBackend(_Strict):
    kind: Literal["embedded", "valkey"] = "embedded"
    url: str | None = None
    # embedded only: where the bundled Valkey keeps its append-only file, so budgets survive restarts.
    # Default: $STATE_DIRECTORY/valkey under systemd, else a temporary directory (not persistent).
    data_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "valkey":
            if not self.url:
                raise ValueError("url: must be set with kind valkey (e.g. valkey://host:6379/0)")
            problem = quota_url_problem(self.url)
            if problem:
                raise ValueError(f"url: {problem}")


class QuotaBreaker(_Strict):
    """How the quota backend's circuit breaker reacts to a failing Valkey (gateway/quota/gate.py)."""

    # Consecutive failed backend round trips that open the breaker: from then on admissions get the
    # on_backend_error answer at once, without touching the backend.
    failures: int = 3
    # While open, each worker probes the backend this often (one PING); the first answer closes it.
    probe_interval: Seconds = Seconds(0.1)

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError("failures: must be >= 1")
        if not 0.01 <= self.probe_interval <= 10:
            raise ValueError("probe_interval: must be between 10ms and 10s")


class Budget(_Strict):
    window: Seconds
    tokens: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.tokens < 1:
            raise ValueError("window must be >= 1s and tokens >= 1")


class QuotaMatch(_Strict):
    tenant: str | None = None
    model: str | None = None


class Estimate(_Strict):
    default_max_tokens: int = 1024


class QuotaRule(_Strict):
    name: str
    budgets: list[Budget]
    match: QuotaMatch | None = None
    estimate: Estimate = Estimate()
    max_in_flight: int | None = None



class QuotaLease(_Strict):
    """Worker-held token blocks (gateway/quota/lease.py): admit without a Valkey round trip per request."""

    # One block: what a worker reserves at once for one (rule, tenant) and then admits against locally.
    tokens: int
    # A block stops admitting after this long (and at the end of a window); its unused tokens go back.
    ttl: Seconds = Seconds(1)
    # Blocks only while the tightest budget still has room for this many blocks: near the limit every
    # request reserves in Valkey, exactly as without leases.
    headroom: int = 10

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError("tokens: must be >= 1")
        if not 0.01 <= self.ttl <= 60:
            raise ValueError("ttl: must be between 10ms and 60s")
        if self.headroom < 1:
            raise ValueError("headroom: must be >= 1")


class Quota(_Strict):
    rules: list[QuotaRule]
    backend: QuotaBackend = QuotaBackend()
    on_backend_error: Literal["reject", "allow"] = "reject"
    reservation_timeout: Seconds = Seconds(120)
    breaker: QuotaBreaker = QuotaBreaker()
    lease: QuotaLease | None = None


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
    if config.workers != "auto" and int(config.workers) < 1:
        problems.append("workers: must be 'auto' or an integer >= 1")
    for index, cluster in enumerate(config.clusters):
        if cluster.upstream_auth is not None and not is_header_name(cluster.upstream_auth.header):
            problems.append(f"clusters[{index}].upstream_auth.header: not a valid header name")
    return problems + _routing_checks(config, set(names)) + _tenant_checks(config)


def _routing_checks(config: Config, cluster_names: set[str]) -> list[str]:
    routing, problems = config.routing, []
    if routing.overlay_file is None and routing.candidates is None and routing.overlay_source is None:
        problems.append("routing.overlay_file: required key is missing (or give routing.overlay_source, "
                        "or routing.candidates inline)")
    elif routing.candidates is not None and (routing.overlay_file is not None or routing.overlay_source is not None):
        problems.append("routing.candidates: give either inline candidates or routing.overlay_file/overlay_source, "
                        "not both")
    if routing.overlay_max_age is not None and routing.overlay_max_age <= 0:
        problems.append("routing.overlay_max_age: must be > 0")
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
    known = None if config.auth is None else {key.tenant for key in config.auth.keys}
    for index, name in enumerate(names):
        if names.index(name) != index:
            problems.append(f"tenants[{index}].tenant: duplicate tenant {name!r}")
        elif known is not None and name not in known:
            # A misspelt policy would silently leave the real tenant unrestricted.
            problems.append(f"tenants[{index}].tenant: {name!r} has no key in auth.keys")
    return problems


def parse_config(text: str, base_dir: str = ".", source: str | None = None) -> Config:
    """Parse YAML text into a validated Config; raise ConfigError naming each bad field."""
    config = convert_yaml(text, Config, {"base_dir": base_dir}, source)
    problems = _cross_checks(config)
    if problems:
        raise ConfigError(problems)
    return config


def load_config(path: str) -> Config:
    return parse_config(read_text(path), base_dir=os.path.dirname(os.path.abspath(path)), source=path)
