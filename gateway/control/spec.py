"""The control-plane spec file (YAML), documented in ``docs/control-plane.md``.

Same rules as the gateway config (docs/configuration.md#rules-that-apply-everywhere): msgspec
Structs reject unknown keys, durations are ``500ms``/``5s``/``2m``, and every problem is one
``field.path: message`` line. The three ``*Policy`` blocks use Grid's camelCase names so they read
like a Grid network spec; everything else is gridgate's snake_case.

Cross-checks go further than types: a spec that loads here renders overlays the data
plane accepts (stable ids are visible ASCII, no two providers claim one candidate
identity, at most 1024 candidates), so a bad catalogue fails at start, not at publish.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import ClassVar, Literal
from urllib.parse import urlsplit

import msgspec

# One error builder and one strict base for every YAML file gridgate reads: the config's.
from gateway.config import ConfigError, Seconds, convert_yaml, read_text
from gateway.control import signals as sig
from gateway.control.metrics_spec import MetricsSource, resolve_signals
from gateway.control.signals import SignalPlan
from gateway.net import parse_host_port
from gateway.overlay.contract import MAX_CANDIDATES, MAX_TEXT_BYTES
from gateway.valkey.urls import url_problem
from gateway.yaml_config import DAY, HOUR, MINUTE, Range, check_ranges
from gateway.yaml_config import StrictStruct as _Strict

NO_METRICS = "noMetrics"
QUEUE_DEPTH = "queueDepth"
KV_CACHE_PRESSURE = "kvCachePressure"
GEOGRAPHY_FIRST = "geographyFirst"
SCORE_FIRST = "scoreFirst"
INSTANTANEOUS = "instantaneous"
STABILIZED = "stabilized"

# Used for the strategy's own metric when the spec leaves its threshold out.
DEFAULT_QUEUE_DEPTH_THRESHOLD = 32.0
DEFAULT_KV_CACHE_THRESHOLD = 0.9


def _package_version() -> str:
    try:
        return metadata.version("gridgate")
    except metadata.PackageNotFoundError:
        return "0.0.0"


class Scope(_Strict):
    """The envelope scope; a gateway's ``expected_overlay_scope`` must match it."""

    network: str
    gateway: str
    namespace: str
    local_site: str

    def as_dict(self) -> dict[str, str]:
        return {"network": self.network, "gateway": self.gateway, "namespace": self.namespace,
                "local_site": self.local_site}


class Producer(_Strict):
    """Provenance of the published envelopes."""

    name: str = "gridgate-control"
    version: str = msgspec.field(default_factory=_package_version)
    source_uid: str | None = None  # default: "gridgate-control/<network>"


class ScoringPolicy(_Strict):
    strategy: Literal["noMetrics", "queueDepth", "kvCachePressure"] = NO_METRICS
    # Above a threshold a provider is under pressure: existing_only. None = not checked, except
    # for the strategy's own metric, which always has one (the defaults above).
    queue_depth_threshold: float | None = msgspec.field(name="queueDepthThreshold", default=None)
    kv_cache_threshold: float | None = msgspec.field(name="kvCacheThreshold", default=None)
    # Scores are quantized into this many bands below the threshold, so metric jitter inside a band
    # changes neither the groups nor the semantic revision.
    score_bands: int = msgspec.field(name="scoreBands", default=4)
    metrics: MetricsSource = msgspec.field(default_factory=MetricsSource)

    # Thresholds above 0 (a queue depth, a utilisation up to 1).
    _RANGES: ClassVar[dict[str, Range]] = {"queue_depth_threshold": (1e-9, 1e6), "kv_cache_threshold": (1e-9, 1.0),
                                           "score_bands": (1, 100)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)

    def uses_metrics(self) -> bool:
        return self.strategy != NO_METRICS

    def effective_queue_depth_threshold(self) -> float | None:
        if self.queue_depth_threshold is None and self.strategy == QUEUE_DEPTH:
            return DEFAULT_QUEUE_DEPTH_THRESHOLD
        return self.queue_depth_threshold

    def effective_kv_cache_threshold(self) -> float | None:
        if self.kv_cache_threshold is None and self.strategy == KV_CACHE_PRESSURE:
            return DEFAULT_KV_CACHE_THRESHOLD
        return self.kv_cache_threshold


class SelectionPolicy(_Strict):
    mode: Literal["deterministic", "roundRobin", "random"] = "deterministic"


class Admission(_Strict):
    mode: Literal["instantaneous", "stabilized"] = INSTANTANEOUS
    # stabilized: a provider's published state changes only after this many consecutive
    # observations agree on the new state (a hold-down against flapping).
    observations: int = 3

    def __post_init__(self) -> None:
        check_ranges(self, {"observations": (1, 100)})

    def required_observations(self) -> int:
        return self.observations if self.mode == STABILIZED else 1


class SecretRef(_Strict):
    name: str
    namespace: str
    key: str


class CredentialRef(_Strict):
    """Copied into the candidate as-is: the gateway resolves the secret, never the control plane."""

    strategy: Literal["apikey", "bearer_token"]
    secret_ref: SecretRef = msgspec.field(name="secretRef")
    header: str | None = None

    def as_dict(self) -> dict[str, object]:
        ref = {"name": self.secret_ref.name, "namespace": self.secret_ref.namespace, "key": self.secret_ref.key}
        out: dict[str, object] = {"strategy": self.strategy, "secretRef": ref}
        if self.header is not None:
            out["header"] = self.header
        return out


class Provider(_Strict):
    name: str
    site: str
    models: list[str]
    health_url: str
    metrics_url: str | None = None
    cluster: str | None = None  # the gateway cluster name; default: name
    kind: Literal["inference_model", "mcp_tool"] = "inference_model"
    credential: CredentialRef | None = None
    metrics: MetricsSource | None = None  # overrides scoringPolicy.metrics for this provider

    @property
    def cluster_name(self) -> str:
        return self.cluster or self.name

    def stable_id(self, model: str) -> str:
        return f"{self.kind}/{model}/{self.site}/{self.cluster_name}"


class ValkeyTarget(_Strict):
    """Publish to one Valkey key (docs/fleet.md); gateways follow it with ``routing.overlay_source``."""

    url: str  # as quota.backend.url: valkey://, valkeys:// (TLS), redis://, rediss://, unix://, user:password@
    key: str
    # The lease that lets one control-plane instance of several publish; default 3 x interval.
    lease_ttl: Seconds | None = None

    def __post_init__(self) -> None:
        check_ranges(self, {"lease_ttl": (0.1, DAY)})


class Publish(_Strict):
    valkey: ValkeyTarget | None = None


class ControlConformance(_Strict):
    """``conformance``: run ``gridgate providers verify``'s checks against every provider's endpoints (as
    the gateway config ``gateway_config`` describes them: endpoints, TLS, SNI, upstream credentials) and
    publish a provider that failed a required one as excluded (docs/provider-conformance.md)."""

    gateway_config: str  # a gateway config file (resolved against the spec's directory)
    recheck: Seconds = Seconds(HOUR)
    surfaces: list[Literal["chat", "completions", "embeddings", "responses", "messages"]] = msgspec.field(
        default_factory=lambda: ["chat"])
    max_tokens: int = 16
    timeout: Seconds = Seconds(30)

    def __post_init__(self) -> None:
        check_ranges(self, {"recheck": (1, 30 * DAY), "max_tokens": (1, 4096), "timeout": (0.1, HOUR)})


class ControlSpec(_Strict):
    scope: Scope
    providers: list[Provider]
    output: str | None = None  # the overlay file; optional when publish.valkey is given
    publish: Publish = msgspec.field(default_factory=Publish)
    # Republish an unchanged revision (new rendered_at) once the published one is this old, so gateways
    # can tell a live control plane from a dead one (routing.overlay_max_age). None: only on change.
    refresh: Seconds | None = None
    producer: Producer = msgspec.field(default_factory=Producer)
    interval: Seconds = Seconds(5)
    probe_timeout: Seconds = Seconds(2)
    routing_policy: Literal["geographyFirst", "scoreFirst"] = msgspec.field(
        name="routingPolicy", default=GEOGRAPHY_FIRST
    )
    scoring_policy: ScoringPolicy = msgspec.field(name="scoringPolicy", default_factory=ScoringPolicy)
    # None: the published document has no selection_policy (gateways then select deterministically).
    selection_policy: SelectionPolicy | None = msgspec.field(name="selectionPolicy", default=None)
    admission: Admission = msgspec.field(default_factory=Admission)
    # Serve the control plane's own Prometheus metrics (GET /metrics) on host:port; None: not served.
    metrics_listen: str | None = None
    conformance: ControlConformance | None = None  # None: no conformance checks

    _RANGES: ClassVar[dict[str, Range]] = {"refresh": (0.1, 30 * DAY), "interval": (0.1, HOUR),
                                           "probe_timeout": (0.01, MINUTE)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)

    @property
    def source_uid(self) -> str:
        return self.producer.source_uid or f"gridgate-control/{self.scope.network}"

    def signal_plan(self, provider: Provider) -> SignalPlan:
        """What to read on ``provider``'s metrics page (the spec was validated: no problems left)."""
        plan, _ = resolve_signals(self.scoring_policy.metrics, provider.metrics,
                                  _needed_signals(self.scoring_policy))
        return plan

    @property
    def lease_ttl(self) -> float:
        target = self.publish.valkey
        return float(target.lease_ttl) if target is not None and target.lease_ttl is not None else 3 * self.interval


# --------------------------------------------------------------------------- metric signals


def _needed_signals(scoring: ScoringPolicy) -> list[str]:
    """The signals an assessment uses: each metric with a threshold, and ready endpoints (a guard)."""
    needed = []
    if scoring.effective_queue_depth_threshold() is not None:
        needed.append(sig.QUEUE_DEPTH)
    if scoring.effective_kv_cache_threshold() is not None:
        needed.append(sig.KV_CACHE)
    return [*needed, sig.READY_ENDPOINTS]


def _signal_problems(spec: ControlSpec) -> list[str]:
    """Every provider's plan must resolve; each problem once, under the block that caused it."""
    scoring = spec.scoring_policy
    if not scoring.uses_metrics():
        return []
    problems: dict[str, None] = {}
    for index, provider in enumerate(spec.providers):
        _, found = resolve_signals(scoring.metrics, provider.metrics, _needed_signals(scoring),
                                   f"providers[{index}].metrics")
        problems.update(dict.fromkeys(found))
    return list(problems)


# --------------------------------------------------------------------------- cross-checks


def _text_problem(value: str, path: str) -> str | None:
    """The data plane's rule for overlay text fields: 1..256 UTF-8 bytes, not blank."""
    if not value.strip() or len(value.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        return f"{path}: must be 1..{MAX_TEXT_BYTES} bytes, not blank"
    return None


def _url_problem(url: str, path: str) -> str | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{path}: invalid URL {url!r} ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{path}: must be an http:// or https:// URL with a host, got {url!r}"
    if port == 0:
        return f"{path}: port must be 1..65535"
    return None


def _provider_problems(spec: ControlSpec) -> list[str]:
    problems: list[str] = []
    seen_names: dict[str, int] = {}
    seen_ids: dict[str, str] = {}
    for index, provider in enumerate(spec.providers):
        path = f"providers[{index}]"
        for field in ("name", "site"):
            problem = _text_problem(getattr(provider, field), f"{path}.{field}")
            if problem:
                problems.append(problem)
        if provider.cluster is not None and (problem := _text_problem(provider.cluster, f"{path}.cluster")):
            problems.append(problem)
        if provider.name in seen_names:
            problems.append(f"{path}.name: duplicate provider name {provider.name!r} "
                            f"(first at providers[{seen_names[provider.name]}])")
        seen_names.setdefault(provider.name, index)
        if (problem := _url_problem(provider.health_url, f"{path}.health_url")):
            problems.append(problem)
        if provider.metrics_url is not None and (problem := _url_problem(provider.metrics_url, f"{path}.metrics_url")):
            problems.append(problem)
        if provider.metrics_url is None and spec.scoring_policy.uses_metrics():
            problems.append(f"{path}.metrics_url: required by scoringPolicy.strategy "
                            f"{spec.scoring_policy.strategy}")
        if not provider.models:
            problems.append(f"{path}.models: must list at least one model")
        for m_index, model in enumerate(provider.models):
            m_path = f"{path}.models[{m_index}]"
            if (problem := _text_problem(model, m_path)):
                problems.append(problem)
                continue
            stable_id = provider.stable_id(model)
            # The data plane requires visible ASCII stable ids; ours are kind/model/site/cluster.
            if not (len(stable_id) <= MAX_TEXT_BYTES and all(33 <= ord(c) <= 126 for c in stable_id)):
                problems.append(f"{m_path}: stable id {stable_id!r} must be 1..{MAX_TEXT_BYTES} visible "
                                "ASCII characters (model, site and cluster without spaces)")
                continue
            owner = seen_ids.setdefault(stable_id, m_path)
            if owner != m_path:
                problems.append(f"{m_path}: {stable_id} is already offered by {owner} "
                                "(same kind, model, site and cluster)")
    count = sum(len(p.models) for p in spec.providers)
    if count > MAX_CANDIDATES:
        problems.append(f"providers: {count} candidates (provider x model) exceed the overlay limit {MAX_CANDIDATES}")
    if not spec.providers:
        problems.append("providers: must list at least one provider")
    return problems


def _cross_checks(spec: ControlSpec) -> list[str]:
    problems: list[str] = []
    for field in ("network", "gateway", "namespace", "local_site"):
        if (problem := _text_problem(getattr(spec.scope, field), f"scope.{field}")):
            problems.append(problem)
    for field, value in (("name", spec.producer.name), ("version", spec.producer.version),
                         ("source_uid", spec.source_uid)):
        if (problem := _text_problem(value, f"producer.{field}")):
            problems.append(problem)
    if spec.probe_timeout > spec.interval:
        problems.append("probe_timeout: must not exceed interval (a cycle would overrun the next)")
    if spec.output is None and spec.publish.valkey is None:
        problems.append("output: required key is missing (or give publish.valkey)")
    elif spec.output is None:
        pass
    elif not os.path.basename(spec.output).strip():
        problems.append("output: must name a file")
    elif not os.path.isdir(os.path.dirname(spec.output) or "."):
        problems.append(f"output: directory {os.path.dirname(spec.output)} does not exist")
    if spec.refresh is not None and spec.refresh < spec.interval:
        problems.append("refresh: must be at least interval")
    if spec.metrics_listen is not None:
        try:
            parse_host_port(spec.metrics_listen)
        except ValueError as exc:
            problems.append(f"metrics_listen: {exc}")
    return (problems + _publish_problems(spec) + _provider_problems(spec) + _signal_problems(spec)
            + _conformance_problems(spec))


def _conformance_problems(spec: ControlSpec) -> list[str]:
    """``conformance.gateway_config`` must be a valid gateway config with every checked provider's cluster."""
    settings = spec.conformance
    if settings is None:
        return []
    from gateway.config import load_config  # only a spec with conformance reads a gateway config

    try:
        config = load_config(settings.gateway_config)
    except ConfigError as exc:
        return [f"conformance.gateway_config: {settings.gateway_config}: {problem}" for problem in exc.problems]
    return [f"conformance.gateway_config: {settings.gateway_config} has no cluster {p.cluster_name!r} "
            f"(providers[{index}])" for index, p in enumerate(spec.providers)
            if p.kind == "inference_model" and config.cluster(p.cluster_name) is None]


def _publish_problems(spec: ControlSpec) -> list[str]:
    target = spec.publish.valkey
    if target is None:
        return []
    problems = []
    if (problem := url_problem(target.url)) is not None:
        problems.append(f"publish.valkey.url: {problem}")
    if not target.key.strip() or any(c.isspace() for c in target.key):
        problems.append("publish.valkey.key: must be a key name without spaces")
    if spec.lease_ttl <= spec.interval:
        problems.append("publish.valkey.lease_ttl: must exceed interval (the lease is renewed once per round)")
    return problems


# --------------------------------------------------------------------------- loading


def parse_spec(text: str, base_dir: str = ".") -> ControlSpec:
    """Parse YAML text into a validated spec; ``output`` is resolved against ``base_dir``.

    Raises :class:`ConfigError` with one ``field: message`` line per problem.
    """
    spec = convert_yaml(text, ControlSpec)
    if spec.output is not None:
        spec = msgspec.structs.replace(spec, output=os.path.join(base_dir, spec.output))
    if spec.conformance is not None:
        checks = msgspec.structs.replace(spec.conformance,
                                         gateway_config=os.path.join(base_dir, spec.conformance.gateway_config))
        spec = msgspec.structs.replace(spec, conformance=checks)
    problems = _cross_checks(spec)
    if problems:
        raise ConfigError(problems)
    return spec


def load_spec(path: str) -> ControlSpec:
    return parse_spec(read_text(path), base_dir=os.path.dirname(os.path.abspath(path)))


def check_spec(path: str) -> list[str]:
    """Every problem of the spec file at ``path``, one ``field: message`` line each; [] when valid."""
    try:
        load_spec(path)
    except ConfigError as exc:
        return list(exc.problems)
    return []
