"""The configuration schema (CONTRACT §2) and its one loader.

msgspec Structs with ``forbid_unknown_fields`` give us unknown-key rejection and
field paths for free; ``ConfigError`` turns msgspec's messages into one line per
problem that starts with the field path, which is what ``gridgate check`` prints.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal, TypeVar

import msgspec
import yaml

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration problem; ``problems`` holds one ``field: message`` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class Seconds(float):
    """A duration in seconds, written in the file as ``500ms``, ``30s``, ``2m``, ``1h`` or ``1d``."""


_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> Seconds:
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r} (integer with unit ms, s, m, h or d)")
    return Seconds(int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def decode_hook(kind: type, value: Any) -> Any:
    if kind is Seconds:
        if isinstance(value, str):
            return parse_duration(value)
        raise ValueError(f"invalid duration {value!r} (integer with unit ms, s, m, h or d)")
    raise NotImplementedError


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid address {text!r}, expected host:port")
    return host.strip("[]"), int(port)


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class Admin(_Strict):
    listen: str = "127.0.0.1:9901"

    def __post_init__(self) -> None:
        parse_host_port(self.listen)


class Limits(_Strict):
    max_header_bytes: int = 65536
    max_body_bytes: int = 10485760
    max_connections_per_worker: int = 10000
    max_url_bytes: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_body_bytes", "max_connections_per_worker", "max_url_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")


class Timeouts(_Strict):
    header_read: Seconds = Seconds(10)
    keepalive_idle: Seconds = Seconds(75)
    graceful_shutdown: Seconds = Seconds(30)


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


class Routing(_Strict):
    overlay_file: str | None = None
    # Instead of a file: the overlay's candidate objects inline (a legacy overlay, local_site "inline",
    # deterministic selection); changed by a config reload.
    candidates: list[dict[str, Any]] | None = None
    model_header: str = "X-Model"
    session_affinity: SessionAffinity = SessionAffinity()
    expected_overlay_scope: OverlayScope = OverlayScope()
    route_headers: bool = True
    provider_hop_clusters: list[str] = []
    reload_debounce: Seconds = Seconds(0.5)


class ApiKey(_Strict):
    tenant: str
    key: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", self.key):
            raise ValueError("key: must be 'sha256:<64 lowercase hex>' (see `gridgate keys hash`)")


class Auth(_Strict):
    keys: list[ApiKey] = []


class QuotaBackend(_Strict):
    kind: Literal["embedded", "valkey"] = "embedded"
    url: str | None = None
    # embedded only: where the bundled Valkey keeps its append-only file, so budgets survive restarts.
    # Default: $STATE_DIRECTORY/valkey under systemd, else a temporary directory (not persistent).
    data_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "valkey":
            schemes = ("valkey://", "redis://", "rediss://", "valkeys://", "valkey+cluster://", "unix://")
            if not self.url or not self.url.startswith(schemes):
                raise ValueError("url: must be a valkey://, redis://, rediss:// or valkey+cluster:// URL")


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



class Quota(_Strict):
    rules: list[QuotaRule]
    backend: QuotaBackend = QuotaBackend()
    on_backend_error: Literal["reject", "allow"] = "reject"
    reservation_timeout: Seconds = Seconds(120)



class Config(_Strict):
    clusters: list[Cluster]
    routing: Routing
    listen: str = "127.0.0.1:8080"
    workers: int | Literal["auto"] = "auto"
    admin: Admin = Admin()
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    auth: Auth | None = None
    quota: Quota | None = None
    # Where the config file lives; relative paths (overlay_file) resolve against it.
    base_dir: str = "."

    def worker_count(self) -> int:
        return os.cpu_count() or 1 if self.workers == "auto" else int(self.workers)

    def overlay_path(self) -> str | None:
        path = self.routing.overlay_file
        return None if path is None else os.path.join(self.base_dir, path)

    def cluster(self, name: str) -> Cluster | None:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        return None


_AT_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_NAMED_FIELD = re.compile(r"^([A-Za-z_][\w\[\]\.]*): (.*)$", re.S)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def validation_problem(error: msgspec.ValidationError) -> str:
    match = _AT_PATH.match(str(error))
    assert match is not None
    message, path = match.group("msg"), (match.group("path") or "").lstrip(".")
    named = _NAMED_FIELD.match(message)
    if named:  # a __post_init__ check: "field: message"
        path = f"{path}.{named.group(1)}" if path else named.group(1)
        message = named.group(2)
    for pattern, text in ((_UNKNOWN, "unknown key"), (_MISSING, "required key is missing")):
        field = pattern.search(message)
        if field:
            path = f"{path}.{field.group('field')}" if path else field.group("field")
            message = text
    return f"{path or '(top level)'}: {message}"


def _cross_checks(config: Config) -> list[str]:
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
    if config.routing.overlay_file is None and config.routing.candidates is None:
        problems.append("routing.overlay_file: required key is missing (or give routing.candidates inline)")
    elif config.routing.overlay_file is not None and config.routing.candidates is not None:
        problems.append("routing.candidates: give either routing.overlay_file or inline candidates, not both")
    for index, name in enumerate(config.routing.provider_hop_clusters):
        if name not in names:
            problems.append(f"routing.provider_hop_clusters[{index}]: unknown cluster {name!r}")
    for index, cluster in enumerate(config.clusters):
        auth = cluster.upstream_auth
        if auth is None:
            continue
        secret = os.environ.get(auth.value_env)
        if secret is None:
            problems.append(f"clusters[{index}].upstream_auth.value_env: environment variable {auth.value_env} is not set")
        elif not all(32 <= ord(ch) < 127 for ch in secret):
            problems.append(f"clusters[{index}].upstream_auth.value_env: {auth.value_env} holds characters not allowed "
                            "in a header value")
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", auth.header):
            problems.append(f"clusters[{index}].upstream_auth.header: not a valid header name")
    affinity = config.routing.session_affinity
    if affinity.enabled and not (affinity.header or affinity.cookie):
        problems.append("routing.session_affinity: enabled needs a header or a cookie")
    return problems


def convert_yaml(text: str, kind: type[T], extra: dict[str, Any] | None = None) -> T:
    """YAML text -> a validated msgspec Struct of ``kind``; ConfigError naming the field otherwise.

    The one loader behind the gateway config and the control-plane spec.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "file"
        raise ConfigError([f"({where}): invalid YAML: {getattr(exc, 'problem', exc)}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError(["(top level): the file must be a mapping"])
    for key in extra or {}:
        if key in raw:
            raise ConfigError([f"{key}: unknown key"])  # set by the loader, never by the file
    try:
        return msgspec.convert({**raw, **(extra or {})}, kind, dec_hook=decode_hook)
    except msgspec.ValidationError as exc:
        raise ConfigError([validation_problem(exc)]) from None


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError([f"(file): cannot read {path}: {exc.strerror}"]) from None


def parse_config(text: str, base_dir: str = ".") -> Config:
    """Parse YAML text into a validated Config; raise ConfigError naming each bad field."""
    config = convert_yaml(text, Config, {"base_dir": base_dir})
    problems = _cross_checks(config)
    if problems:
        raise ConfigError(problems)
    return config


def load_config(path: str) -> Config:
    return parse_config(read_text(path), base_dir=os.path.dirname(os.path.abspath(path)))
