"""Building the quota ledger's Valkey client from the configured backend.

Accepted URLs (the config validates them: ``gateway.valkey.urls.url_problem``): ``valkey://``,
``valkeys://``, ``redis://``, ``rediss://``, ``unix://`` (a single node) and ``valkey+cluster://host:port``
/ ``valkeys+cluster://host:port`` (Valkey Cluster; the node is a seed, the topology is discovered).
``{kind: embedded}`` resolves to the URL the supervisor's ``EmbeddedValkey.start()`` returned.

The client is also the ledger's transport (``transport.py``): the URL decides, once, here, which of the
two implementations serves it, and nothing downstream asks again.

Clients are created inside each worker (after fork, on the worker's event loop), never shared
across processes. Timeouts are short on purpose: a slow quota backend must turn into the configured
``on_backend_error`` policy quickly, not into request latency.
"""

from __future__ import annotations

from valkey.exceptions import ValkeyError

from gateway.valkey.cluster_transport import ClusterTransport
from gateway.valkey.resp_transport import RespTransport
from gateway.valkey.urls import is_cluster_url, single_node_url

DEFAULT_TIMEOUT_S = 0.25

# What a failing backend raises (both clients use valkey-py's exception classes).
BACKEND_ERRORS = (ValkeyError, OSError, TimeoutError)


def describe_error(exc: BaseException) -> str:
    # Exception text from valkey-py never includes the password; keep it to the class + message.
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def create_client(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> RespTransport | ClusterTransport:
    """A ``RespTransport`` (``RespClient``) for a single node, a ``ClusterTransport`` (valkey-py's
    ``ValkeyCluster``) for a cluster URL: the ledger's transport and a command client both. Both
    return bytes replies and make no client-side retries (the gate's breaker and policy decide what
    a failure means). ``timeout_s`` bounds connecting and waiting for replies.

    Single node: the lean pipelined client (one connection per worker; about a third of the worker
    CPU per admit and per settle of valkey-py's pooled client, whose per-command machinery dominated
    the quota's cost per request). Cluster: valkey-py, which knows slots, redirections and topology;
    it initialises lazily on first use."""
    if not is_cluster_url(url):
        return RespTransport.from_url(url, timeout_s=timeout_s)
    # The pool is not capped: the transport bounds its batches in flight, and that bounds the connections.
    return ClusterTransport.from_url(
        single_node_url(url),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        decode_responses=False,
        # Skip CLIENT SETINFO on every new connection: one round trip less when a pool grows.
        lib_name=None,
        lib_version=None,
        # Slot moves are retried inside the client; connection failures are ours to judge.
        connection_error_retry_attempts=1,
        # One attempt of a pipeline (the quota's batches), one retry of a single command, on a connection
        # error, a timeout or CLUSTERDOWN: valkey-py's default (3) re-reads the topology and sleeps 0.25 s
        # before each, so an admit batch to a dead node took 0.85 s to fail (now about 0.3 s) until the
        # quota's breaker opened. Not 0: valkey-py's ClusterPipeline then never runs (``range(attempts)``).
        cluster_error_retry_attempts=1,
    )
