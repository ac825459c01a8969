"""Endpoint load balancing inside one cluster (pure: no sockets, no clocks), one module per family.

base      the endpoint and state-view protocols; health, panic and slow start shared by every strategy
weighted  smooth weighted round robin, weighted random
load      least connections, power of two choices (in-flight counts over every worker)
hashing   consistent-hash ring, Maglev (a header or the path as key)
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.cluster.balancers.base import Balancer, E, StateView
from gateway.cluster.balancers.hashing import ConsistentHash, HashBalancer, Maglev
from gateway.cluster.balancers.load import LeastConnections, PowerOfTwoChoices
from gateway.cluster.balancers.weighted import RoundRobin, WeightedRandom

_SIMPLE: dict[str, type[Balancer]] = {
    "round_robin": RoundRobin, "least_connections": LeastConnections, "p2c": PowerOfTwoChoices,
    "random": WeightedRandom,
}
_HASHING: dict[str, type[HashBalancer]] = {"consistent_hash": ConsistentHash, "maglev": Maglev}


def build_balancer(strategy: str, endpoints: Sequence[E], view: StateView, *, hash_header: str | None = None,
                   cluster: str = "") -> Balancer[E]:
    """The balancer of ``strategy`` (a ``gateway.cluster.spec.Strategy`` name) over ``endpoints``.

    ``hash_header`` is the key header of the hashing strategies (None: the request path is the key).
    """
    simple = _SIMPLE.get(strategy)
    if simple is not None:
        return simple(endpoints, view, cluster=cluster)
    hashing = _HASHING.get(strategy)
    if hashing is None:
        raise ValueError(f"unknown load balancer strategy {strategy!r}")
    return hashing(endpoints, view, header=hash_header, cluster=cluster)
