"""Which requests the data plane serves, decided on the request head (docs/security.md). Pure.

A request is admitted to one of five route kinds, or to none (then it is 404 ``route_not_allowed``
and never reaches a provider, which would receive it with the provider's credential):

- ``MODELS``: ``GET /v1/models`` and ``GET /v1/models/{id}``, answered by the gateway itself;
- ``KEY``: ``GET /v1/gridgate/key``, the caller's own key (docs/keys.md), answered by the gateway;
- ``API``: the API routes the gateway knows (``API_ROUTES``: one per row of
  ``gateway.request.surfaces.API_SURFACES``), sent to any cluster;
- ``MCP``: the MCP endpoint (``routing.mcp_path``, streamable HTTP: POST, GET and DELETE), any cluster;
- ``EXTRA``: what clusters list in ``clusters[].allowed_routes``, sent only to those clusters.

Matching rules (the whole normalisation, so nothing can widen the set):

- the query string (from the first ``?``) never changes the route;
- the fixed routes (API, MCP, ``/v1/models``) match byte for byte: no trailing slash, no
  percent-encoding, no dot or empty segments, case-sensitive; one dict lookup per request;
- an extra route's path must be *clean*: ``/`` and segments that are non-empty, are not ``.`` or
  ``..``, and hold only RFC 3986 path characters without ``%`` (no percent-encoded byte at all, so
  ``%2e%2e`` or ``%2f`` cannot hide a dot segment or a slash). A clean path is then matched against
  the globs: ``*`` matches within one segment, a ``**`` segment matches one or more whole segments.
  What passes is forwarded exactly as the client sent it, so the provider sees the path we matched.

Each admitted route carries its API surface (``AllowedRoute.surface``: which body fields the gateway
reads, whether a stream may be rewritten for usage, where the usage lives, which error shape), so
the request path learns it from the lookup it makes anyway (docs/api-surfaces.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from gateway.request import surfaces
from gateway.request.surfaces import Surface

MODELS, API, MCP, EXTRA = range(4)
KEY = -1  # below MODELS: one compare (kind <= MODELS) finds the routes the gateway answers itself

API_ROUTES: tuple[str, ...] = tuple(surface.path for surface in surfaces.API_SURFACES)  # type: ignore[misc]
MODELS_PATH = "/v1/models"
KEY_PATH = "/v1/gridgate/key"
MCP_METHODS = ("POST", "GET", "DELETE")  # streamable HTTP: messages, the server's event stream, session end

_MODELS = b"/v1/models"
_MODEL_PREFIX = b"/v1/models/"
_GET = b"GET"
# RFC 3986 pchar without pct-encoded, plus the segment separator.
_PATH_BYTES = b"/" + bytes(range(ord("a"), ord("z") + 1)) + bytes(range(ord("A"), ord("Z") + 1)) + \
    b"0123456789-._~!$&'()*+,;=:@"
_METHOD = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")


class AllowedRoute:
    """The route a request was admitted to.

    ``barred``: provider indexes that may not serve it (empty for routes every cluster serves);
    ``clusters``: the names of the clusters that may (None: every cluster); ``surface``: its API.
    """

    __slots__ = ("kind", "barred", "clusters", "surface")

    def __init__(self, kind: int, barred: frozenset[int] = frozenset(),
                 clusters: frozenset[str] | None = None, surface: Surface = surfaces.OTHER) -> None:
        self.kind = kind
        self.barred = barred
        self.clusters = clusters
        self.surface = surface

    def __repr__(self) -> str:
        clusters = sorted(self.clusters) if self.clusters else None
        return f"AllowedRoute({self.kind}, {self.surface.name}, clusters={clusters})"


class RouteRule:
    """One ``allowed_routes`` entry: ``"METHOD /path/glob"``, METHOD being a method, a comma-separated
    list of methods, or ``*`` for any."""

    __slots__ = ("text", "methods", "path", "pattern")

    def __init__(self, text: str, methods: frozenset[bytes] | None, path: str, pattern: re.Pattern[bytes]) -> None:
        self.text = text
        self.methods = methods
        self.path = path
        self.pattern = pattern

    def matches(self, method: bytes, path: bytes) -> bool:
        """``path`` must be clean (``is_clean_path``)."""
        return (self.methods is None or method in self.methods) and self.pattern.fullmatch(path) is not None


def parse_route_rule(text: str) -> RouteRule:
    """Parse and validate one ``allowed_routes`` entry; ValueError says what is wrong with it."""
    parts = text.split()
    if len(parts) != 2:
        raise ValueError(f"{text!r} is not \"METHOD /path\" (e.g. \"GET /v1/files/*\")")
    method_part, path = parts
    methods: frozenset[bytes] | None = None
    if method_part != "*":
        names = method_part.split(",")
        for name in names:
            if not _METHOD.fullmatch(name):
                raise ValueError(f"{name!r} is not a method: use an upper-case method such as GET, a "
                                 "comma-separated list (GET,DELETE) or * for any")
            if name == "CONNECT":
                raise ValueError("CONNECT cannot be proxied")
        methods = frozenset(name.encode() for name in names)
    problem = _glob_problem(path)
    if problem:
        raise ValueError(f"path {path!r}: {problem}")
    if "*" not in path:
        fixed = _fixed_owner(path, methods)
        if fixed:
            raise ValueError(f"{text!r} is {fixed}: list only routes beyond the defaults")
    return RouteRule(text, methods, path, _compile(path))


def _glob_problem(path: str) -> str | None:
    if not path.startswith("/"):
        return "must start with /"
    raw = path.encode("ascii", "replace")
    if raw.translate(None, _PATH_BYTES):
        return "may hold only letters, digits and -._~!$&'()*+,;=:@ (and * in globs); no %, ? or #"
    for segment in path[1:].split("/"):
        if not segment:
            return "has an empty segment (// or a trailing /)"
        if segment in (".", ".."):
            return "has a dot segment"
        if "**" in segment and segment != "**":
            return "** must be a whole segment"
    return None


def _fixed_owner(path: str, methods: frozenset[bytes] | None) -> str | None:
    """Why a literal rule is redundant: it names a route every cluster already serves."""
    if path in API_ROUTES and (methods is None or b"POST" in methods):
        return "allowed for every cluster already"
    if (path == MODELS_PATH or path.startswith(MODELS_PATH + "/") or path == KEY_PATH) and (
            methods is None or _GET in methods):
        return "answered by the gateway itself"
    return None


def _compile(glob: str) -> re.Pattern[bytes]:
    parts = []
    for segment in glob[1:].split("/"):
        if segment == "**":
            parts.append(rb"(?:/[^/]+)+")
        else:
            parts.append(b"/" + rb"[^/]*".join(re.escape(piece.encode()) for piece in segment.split("*")))
    return re.compile(b"".join(parts))


def is_clean_path(path: bytes) -> bool:
    """``/`` and non-empty segments that are not ``.``/``..``, of path characters without ``%``."""
    if path[:1] != b"/" or path.translate(None, _PATH_BYTES):
        return False
    for segment in path[1:].split(b"/"):
        if not segment or segment == b"." or segment == b"..":
            return False
    return True


def mcp_path_problem(path: str) -> str | None:
    """Why ``routing.mcp_path`` is unusable (None: it is fine)."""
    if "*" in path:
        return "must be a path, not a glob"
    problem = _glob_problem(path)
    if problem:
        return problem
    if path in API_ROUTES or path == MODELS_PATH or path.startswith(MODELS_PATH + "/") or path == KEY_PATH:
        return "is an API route already"
    return None


class RouteTable:
    """Every route a configuration allows, built once per worker; ``match`` runs once per request.

    ``cluster_rules``: (cluster name, its ``allowed_routes`` entries); ``provider_index``: cluster name
    -> provider index, to bar the providers of the other clusters from extra routes.
    """

    __slots__ = ("_fixed", "_models", "_rules", "_every", "_unions", "_provider_index")

    def __init__(self, mcp_path: str | None = "/mcp",
                 cluster_rules: Iterable[tuple[str, Iterable[str]]] = (),
                 provider_index: Mapping[str, int] | None = None) -> None:
        self._models = AllowedRoute(MODELS, surface=surfaces.MODELS)
        fixed: dict[bytes, dict[bytes, AllowedRoute]] = {
            surface.path.encode(): {b"POST": AllowedRoute(API, surface=surface)}  # type: ignore[union-attr]
            for surface in surfaces.API_SURFACES
        }
        fixed[_MODELS] = {_GET: self._models}
        fixed[KEY_PATH.encode()] = {_GET: AllowedRoute(KEY, surface=surfaces.MODELS)}
        if mcp_path is not None:
            mcp = AllowedRoute(MCP, surface=surfaces.MCP)
            fixed[mcp_path.encode()] = {method.encode(): mcp for method in MCP_METHODS}
        self._fixed = fixed
        self._provider_index = dict(provider_index or {})
        rules: list[tuple[RouteRule, str]] = []
        for cluster, entries in cluster_rules:
            rules.extend((parse_route_rule(entry), cluster) for entry in entries)
        self._rules = tuple(rules)
        self._every = frozenset(self._provider_index)
        self._unions: dict[frozenset[str], AllowedRoute] = {}

    def match(self, method: bytes, target: bytes) -> AllowedRoute | None:
        """The route of a request head (method, origin-form target), or None: not allowed."""
        query = target.find(b"?")
        path = target if query < 0 else target[:query]
        by_method = self._fixed.get(path)
        if by_method is not None:
            route = by_method.get(method)
            if route is not None:
                return route
        elif method == _GET and path.startswith(_MODEL_PREFIX):
            return self._models  # /v1/models/{id}: answered by the gateway, the id may take any form
        if not self._rules or not is_clean_path(path):
            return None
        return self._extra(method, path)

    def _extra(self, method: bytes, path: bytes) -> AllowedRoute | None:
        clusters = frozenset(cluster for rule, cluster in self._rules if rule.matches(method, path))
        if not clusters:
            return None
        route = self._unions.get(clusters)
        if route is None:  # one object per set of clusters: a handful per configuration
            index = self._provider_index
            barred = frozenset(index[name] for name in self._every - clusters)
            route = self._unions[clusters] = AllowedRoute(EXTRA, barred, clusters)
        return route
