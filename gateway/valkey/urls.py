"""What a Valkey URL may be (the quota backend's, the key store's, an overlay source's, the control plane's
publish target): one node, or a seed node of a Valkey Cluster whose topology is discovered. Pure."""

from __future__ import annotations

NODE_SCHEMES = ("valkey", "valkeys", "redis", "rediss", "unix")
CLUSTER_SCHEMES = ("valkey+cluster", "valkeys+cluster")


def url_problem(url: str) -> str | None:
    """None if ``url`` is a Valkey URL the gateway can use, else why not."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        return "expected a URL such as valkey://host:6379/0"
    if scheme not in NODE_SCHEMES + CLUSTER_SCHEMES:
        allowed = ", ".join(f"{s}://" for s in NODE_SCHEMES + CLUSTER_SCHEMES)
        return f"unsupported scheme {scheme}:// (use one of {allowed})"
    if scheme in CLUSTER_SCHEMES and ":" not in rest.rsplit("@", 1)[-1].split("/", 1)[0]:
        return f"{scheme}:// needs host:port of one cluster node"
    return None


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def single_node_url(url: str) -> str:
    """``url`` for its node alone: a ``valkey+cluster://`` / ``valkeys+cluster://`` seed becomes
    ``valkey://`` / ``valkeys://``; other URLs stay as they are."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() in CLUSTER_SCHEMES:
        return f"{scheme.lower().removesuffix('+cluster')}{sep}{rest}"
    return url
