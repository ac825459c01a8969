"""Everything a worker's proxy consults per request, built once from the config.

The runtime is the seam between the request path (workers/proxy.py) and the pure rooms:
routing snapshot and pickers, endpoint balancers, auth and quota. Per request it offers cheap
methods; on reload it swaps the snapshot.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec

from gateway.config import Cluster, Config, parse_host_port
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from workers.context import WorkerContext
from workers.errors import GatewayError
from workers.upstream import UpstreamPool

log = logging.getLogger("gridgate.runtime")


class EndpointRuntime:
    __slots__ = ("index", "address", "weight", "pool", "host_header")

    def __init__(self, index: int, address: str, weight: int, pool: UpstreamPool) -> None:
        self.index = index
        self.address = address
        self.weight = weight
        self.pool = pool
        self.host_header = address.encode()


class ClusterRuntime:
    """One provider cluster in one worker: its endpoints' pools and the endpoint picker."""

    def __init__(self, cluster: Cluster, provider_hop: bool) -> None:
        self.name = cluster.name
        self.provider_hop = provider_hop
        self.auth_headers: list[tuple[bytes, bytes]] = []
        if cluster.upstream_auth is not None:
            secret = os.environ.get(cluster.upstream_auth.value_env, "")
            self.auth_headers.append(
                (cluster.upstream_auth.header.lower().encode(), b"Bearer " + secret.encode())
            )
        self.endpoints: list[EndpointRuntime] = []
        for index, (address, weight) in enumerate(cluster.weighted_endpoints()):
            host, port = parse_host_port(address)
            pool = UpstreamPool(
                host, port, max_connections=cluster.max_connections,
                connect_timeout=float(cluster.connect_timeout), read_timeout=float(cluster.read_timeout),
            )
            self.endpoints.append(EndpointRuntime(index, address, weight, pool))
        self._next = 0

    def balance_key(self, found: dict[bytes, bytes], target: bytes) -> bytes | None:
        return None

    def pick(self, key: bytes | None, excluded: set[int]) -> EndpointRuntime | None:
        endpoints = self.endpoints
        for _ in range(len(endpoints)):
            endpoint = endpoints[self._next % len(endpoints)]
            self._next += 1
            if endpoint.index not in excluded:
                return endpoint
        return None

    def begin(self, endpoint: EndpointRuntime) -> None:
        pass

    def end(self, endpoint: EndpointRuntime) -> None:
        pass

    def record(self, endpoint: EndpointRuntime, failure: str | None) -> None:
        pass

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.pool.close()


class _BodyFields(msgspec.Struct):
    model: str | None = None


_decode_fields = msgspec.json.Decoder(_BodyFields).decode


class RequestInfo:
    __slots__ = ("kind", "name", "fields")

    def __init__(self, kind: str, name: str, fields: Any) -> None:
        self.kind = kind
        self.name = name
        self.fields = fields


class RouteDecision:
    __slots__ = ("cluster", "stable_id", "group", "mode", "affinity", "revision", "is_envelope")

    def __init__(self, cluster: str, stable_id: str, group: int | None, mode: str, affinity: str,
                 revision: str, is_envelope: bool) -> None:
        self.cluster = cluster
        self.stable_id = stable_id
        self.group = group
        self.mode = mode
        self.affinity = affinity
        self.revision = revision
        self.is_envelope = is_envelope


class Runtime:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.config: Config = ctx.config
        routing = self.config.routing
        self.model_header = routing.model_header.lower().encode()
        self.header_lookups = {self.model_header: 0}
        self.route_headers_enabled = routing.route_headers
        self.snapshot: Snapshot = self._load_snapshot()
        self.clusters: dict[str, ClusterRuntime] = {}
        self._models_body = b""

    async def start(self) -> None:
        hop = set(self.config.routing.provider_hop_clusters)
        for cluster in self.config.clusters:
            self.clusters[cluster.name] = ClusterRuntime(cluster, cluster.name in hop)
        self._models_body = self._render_models()

    async def stop(self) -> None:
        for cluster in self.clusters.values():
            cluster.close()

    def heartbeat(self) -> None:
        pass

    def _load_snapshot(self) -> Snapshot:
        path = self.config.overlay_path()
        with open(path, "rb") as handle:
            return snapshot_from_bytes(handle.read())

    def poll_overlay(self, now: float, force: bool = False) -> tuple[bool, str | None]:
        return False, None

    def _render_models(self) -> bytes:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "gridgate"}
                for name in self.snapshot.model_names]
        return msgspec.json.encode({"object": "list", "data": data})

    # -- per request -------------------------------------------------------------------------
    def authenticate(self, authorization: bytes | None, api_key: bytes | None) -> str | None:
        return None

    def models_body(self) -> bytes:
        return self._models_body

    def capability(self, exchange: Any, found: dict[bytes, bytes]) -> RequestInfo:
        header = found.get(self.model_header)
        fields = None
        if exchange.body:
            try:
                fields = _decode_fields(exchange.body)
            except msgspec.DecodeError:
                raise GatewayError(400, "invalid_json", "request body is not valid JSON") from None
        if header is not None:
            return RequestInfo("inference_model", header.decode("ascii").strip(), fields)
        if fields is not None and fields.model:
            return RequestInfo("inference_model", fields.model, fields)
        raise GatewayError(400, "missing_model", "no model: set the model header or the JSON body \"model\"")

    async def admit(self, tenant: str | None, request: RequestInfo) -> Any:
        return None

    def settle(self, admission: Any, status: int, call: Any) -> None:
        pass

    def route(self, request: RequestInfo, found: dict[bytes, bytes], cookie: bytes | None) -> RouteDecision:
        snapshot = self.snapshot
        capability = snapshot.capability(request.kind, request.name)
        if capability is None:
            raise GatewayError(404, "model_not_found", f"model {request.name!r} is not served")
        if not capability.serving:
            raise GatewayError(503, "no_provider_available", f"no provider admits {request.name!r} now")
        candidate = capability.serving[0]
        return RouteDecision(candidate.cluster, candidate.stable_id, capability.serving_group, snapshot.mode,
                             "none", snapshot.revision, snapshot.is_envelope)

    def route_headers(self, route: RouteDecision, admission: Any) -> list[tuple[bytes, bytes]]:
        if not self.route_headers_enabled:
            return []
        return [
            (b"x-gridgate-provider", route.cluster.encode()),
            (b"x-gridgate-stable-id", route.stable_id.encode()),
            (b"x-gridgate-selection-group", b"" if route.group is None else b"%d" % route.group),
            (b"x-gridgate-selection-mode", route.mode.encode()),
            (b"x-gridgate-overlay-revision", route.revision.encode()),
            (b"x-gridgate-affinity", route.affinity.encode()),
        ]

    def provider_hop_headers(self, route: RouteDecision, request_id: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-ai-routing-candidate", route.stable_id.encode()), (b"x-ai-routing-request-id", request_id)]
        if route.is_envelope:
            headers.append((b"x-ai-routing-revision", route.revision.encode()))
        return headers

    def upstream_body(self, request: RequestInfo, body: bytes) -> bytes:
        return body

    def response_filter(self, request: RequestInfo, admission: Any) -> Any:
        return None
