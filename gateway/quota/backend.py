"""Building the quota ledger's Valkey client from the configured backend.

Accepted URLs: ``valkey://``, ``valkeys://``, ``redis://``, ``rediss://``, ``unix://`` (a single node)
and ``valkey+cluster://host:port`` / ``valkeys+cluster://host:port`` (Valkey Cluster; the node is a
seed, the topology is discovered). ``{kind: embedded}`` resolves to the URL the supervisor's
``EmbeddedValkey.start()`` returned.

Clients are created inside each worker (after fork, on the worker's event loop), never shared
across processes. Timeouts are short on purpose: a slow quota backend must turn into the configured
``on_backend_error`` policy quickly, not into request latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from valkey.asyncio.cluster import ValkeyCluster

from gateway.quota.resp import RespClient

SINGLE_NODE_SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix")
CLUSTER_SCHEMES = {"valkey+cluster": "valkey", "valkeys+cluster": "valkeys"}

DEFAULT_TIMEOUT_S = 0.25


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """``quota.backend`` as plain values: kind ``embedded`` (url None) or ``valkey`` (url required)."""

    kind: Literal["embedded", "valkey"]
    url: str | None = None


def url_problem(url: str) -> str | None:
    """None if ``url`` is an acceptable backend URL, else why not (for ``gridgate check``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "expected a URL such as valkey://host:6379/0"
    scheme = scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        host_port = rest.rsplit("@", 1)[-1].split("/", 1)[0]
        if ":" not in host_port:
            return f"{scheme}:// needs host:port of one cluster node"
        return None
    if scheme not in SINGLE_NODE_SCHEMES:
        allowed = ", ".join(f"{s}://" for s in (*SINGLE_NODE_SCHEMES, *CLUSTER_SCHEMES))
        return f"unsupported scheme {scheme}:// (use one of {allowed})"
    return None


def backend_url(spec: BackendSpec, embedded_url: str | None) -> str:
    if spec.kind == "embedded":
        if not embedded_url:
            raise ValueError("quota.backend: kind embedded but the embedded server is not running")
        return embedded_url
    if not spec.url:
        raise ValueError("quota.backend.url: required for kind valkey")
    problem = url_problem(spec.url)
    if problem:
        raise ValueError(f"quota.backend.url: {problem}")
    return spec.url


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def create_client(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A ``RespClient`` for a single node, a valkey-py ``ValkeyCluster`` for a cluster URL; both
    return bytes replies and make no client-side retries (the gate's breaker and policy decide what
    a failure means). ``timeout_s`` bounds connecting and waiting for replies.

    Single node: the lean pipelined client (one connection per worker; about a third of the worker
    CPU per admit and per settle of valkey-py's pooled client, whose per-command machinery dominated
    the quota's cost per request). Cluster: valkey-py, which knows slots, redirections and topology;
    it initialises lazily on first use."""
    scheme, _, rest = url.partition("://")
    cluster_scheme = CLUSTER_SCHEMES.get(scheme.lower())
    if cluster_scheme is None:
        return RespClient.from_url(url, timeout_s=timeout_s)
    # The pool is not capped: QuotaLedger bounds concurrent calls (cheaper than valkey-py's blocking
    # pool, which takes a lock per command), and that bounds the connections.
    return ValkeyCluster.from_url(
        f"{cluster_scheme}://{rest}",
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        decode_responses=False,
        # Skip CLIENT SETINFO on every new connection: one round trip less when a pool grows.
        lib_name=None,
        lib_version=None,
        # Slot moves are retried inside the client; connection failures are ours to judge.
        connection_error_retry_attempts=1,
    )
