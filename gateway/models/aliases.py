"""The request path's model table (docs/models.md): what a requested model name resolves to, and the
fallback chain that request walks. Built once per worker from the ``models`` config block.

A name that is neither an alias nor the head of a chain has no entry: the request path pays one dict
lookup for it and nothing else. An alias resolves before tenant policy, quota rules and prices: the
rest of the path sees its target; the access log keeps the requested name too.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from gateway.config.models import Models
from gateway.metrics.catalogue import fallback_edge_name
from gateway.models.fallbacks import refusals_to_hold


class ModelRoute(NamedTuple):
    """What one requested name becomes: its ``target`` (the model the path routes), whether the name was
    an ``alias``, and its fallback ``chain`` (resolved targets, in order), the reasons that move a request
    along it (``on``) and the most moves (``hops``; 0: no chain)."""

    requested: str
    target: str
    alias: bool
    chain: tuple[str, ...] = ()
    on: frozenset[str] = frozenset()
    hops: int = 0
    refusals: frozenset[str] | None = None  # provider 400 codes that move it on (``refusals_to_hold``)


def model_routes(models: Models) -> dict[str, ModelRoute]:
    """Requested name -> its ``ModelRoute``, for every alias and every model with a chain. An alias's
    chain is its own when it has one, else its target's."""
    routes: dict[str, ModelRoute] = {}
    names = [*models.aliases, *(name for name in models.fallbacks if name not in models.aliases)]
    for name in names:
        target = models.target(name)
        fallback = models.fallbacks.get(name) or models.fallbacks.get(target)
        if fallback is None:
            routes[name] = ModelRoute(name, target, name != target)
            continue
        chain = tuple(models.target(entry) for entry in fallback.chain)
        on = frozenset(fallback.on)
        routes[name] = ModelRoute(name, target, name != target, chain, on, fallback.hops, refusals_to_hold(on))
    return routes


def visible_aliases(models: Models) -> tuple[tuple[str, str], ...]:
    """(alias, target) of every alias ``GET /v1/models`` lists (hidden ones are left out)."""
    return tuple((name, models.target(name)) for name in models.aliases if not models.hidden(name))


class _Model(msgspec.Struct):
    model: msgspec.Raw = msgspec.Raw()


_model_field = msgspec.json.Decoder(_Model)


def retarget_body(body: bytes, model: str) -> bytes | None:
    """``body`` with its top-level ``"model"`` set to ``model``; None when no rewrite is needed (no such
    string member, it already names ``model``, or the body is not a JSON object: the provider judges it).
    Only requests whose model is an alias or moved along a chain pay this."""
    if not body:
        return None
    try:
        current = bytes(_model_field.decode(body).model)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if current[:1] != b'"':
        return None
    wanted = msgspec.json.encode(model)
    if current == wanted:
        return None
    try:
        document = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    document["model"] = model
    return msgspec.json.encode(document)


def fallback_edges(models: Models) -> list[str]:
    """The (from, to) edges a request may move along (``gateway.metrics.catalogue.fallback_edge_name``), for
    the metrics' bounded label set: every model of a chain to each later one (a forbidden model between
    them is skipped), in config order."""
    edges: dict[str, None] = {}
    for route in model_routes(models).values():
        walk = (route.target, *route.chain)
        for index, source in enumerate(walk):
            for target in walk[index + 1:]:
                edges[fallback_edge_name(source, target)] = None
    return list(edges)
