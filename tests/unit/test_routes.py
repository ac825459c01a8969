"""Allowed routes (gateway/request/routes.py, docs/security.md): the defaults, the normalisation rules,
cluster extras, and the config errors that name the field."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.request.routes import API, API_ROUTES, EXTRA, MCP, MODELS, RouteTable, is_clean_path
from gateway.yaml_config import ConfigError

INDEX = {"a": 0, "b": 1, "c": 2}


def table(**extras: list[str]) -> RouteTable:
    return RouteTable("/mcp", list(extras.items()), INDEX)


@pytest.mark.parametrize("path", API_ROUTES)
def test_every_api_route_is_allowed_for_post_on_every_cluster(path: str) -> None:
    route = table().match(b"POST", path.encode())
    assert route is not None and route.kind == API and route.barred == frozenset() and route.clusters is None


@pytest.mark.parametrize(("method", "target", "kind"), [
    (b"GET", b"/v1/models", MODELS),
    (b"GET", b"/v1/models?limit=3", MODELS),
    (b"GET", b"/v1/models/gpt-4o", MODELS),
    (b"GET", b"/v1/models/org%2Fmodel", MODELS),  # answered by the gateway: the id may take any form
    (b"POST", b"/v1/chat/completions?api-version=2024", API),
    (b"POST", b"/v1/messages/count_tokens", API),
    (b"POST", b"/mcp", MCP),
    (b"GET", b"/mcp", MCP),
    (b"DELETE", b"/mcp?session=1", MCP),
])
def test_default_routes(method: bytes, target: bytes, kind: int) -> None:
    route = table().match(method, target)
    assert route is not None and route.kind == kind


@pytest.mark.parametrize(("method", "target"), [
    (b"GET", b"/v1/chat/completions"),
    (b"HEAD", b"/v1/chat/completions"),
    (b"post", b"/v1/chat/completions"),
    (b"POST", b"/v1/chat/completions/"),
    (b"POST", b"//v1/chat/completions"),
    (b"POST", b"/V1/chat/completions"),
    (b"POST", b"/v1/chat//completions"),
    (b"POST", b"/v1/%63hat/completions"),
    (b"POST", b"/v1/chat/completions/../../admin"),
    (b"POST", b"/v1/chat/completions/./"),
    (b"POST", b"/v1/./chat/completions"),
    (b"POST", b"/v1/chat/completions#frag"),
    (b"POST", b"/v1/chat/completions;v=1"),
    (b"POST", b"/admin/health"),
    (b"GET", b"/metrics"),
    (b"GET", b"/health"),
    (b"GET", b"/v1/files"),
    (b"DELETE", b"/v1/files/x"),
    (b"POST", b"/v1/models"),
    (b"GET", b"/v1/modelsX"),
    (b"PUT", b"/mcp"),
    (b"POST", b"/mcp/"),
    (b"GET", b"/"),
])
def test_everything_else_is_not_allowed(method: bytes, target: bytes) -> None:
    assert table().match(method, target) is None


def test_the_mcp_endpoint_follows_its_key() -> None:
    assert RouteTable(None).match(b"POST", b"/mcp") is None
    custom = RouteTable("/tools/mcp")
    assert custom.match(b"POST", b"/mcp") is None
    assert custom.match(b"GET", b"/tools/mcp").kind == MCP  # type: ignore[union-attr]


def test_an_extra_route_is_sent_only_to_the_clusters_that_list_it() -> None:
    routes = table(a=["GET /v1/files/*", "DELETE /v1/files/*"], b=["GET /v1/files/*"])
    listing = routes.match(b"GET", b"/v1/files/file-1?purpose=x")
    assert listing is not None and listing.kind == EXTRA
    assert listing.clusters == {"a", "b"} and listing.barred == {INDEX["c"]}
    deleting = routes.match(b"DELETE", b"/v1/files/file-1")
    assert deleting is not None and deleting.clusters == {"a"} and deleting.barred == {INDEX["b"], INDEX["c"]}
    assert routes.match(b"GET", b"/v1/files/file-1") is listing  # one object per set of clusters
    assert routes.match(b"POST", b"/v1/files/file-1") is None
    assert routes.match(b"GET", b"/v1/files/file-1/content") is None  # * stays inside one segment
    assert routes.match(b"GET", b"/v1/files") is None


@pytest.mark.parametrize("target", [
    b"/v1/files/../admin", b"/v1/files/x/../../admin", b"/v1/files/%2e%2e", b"/v1/files/%2E%2E/admin",
    b"/v1/files/x%2f..%2fadmin", b"/v1/files//admin", b"/v1/files/./x", b"/v1/files/x/", b"/v1/files/x\\..",
    b"/v1/files/..", b"/v1/files/.",
])
def test_dot_segments_and_encodings_never_widen_an_extra_route(target: bytes) -> None:
    routes = table(a=["* /v1/files/**", "GET /v1/files/*"])
    assert routes.match(b"GET", target) is None


def test_globs_and_method_lists() -> None:
    routes = table(a=["GET,DELETE /v1/batches/*/results", "* /v1/fine_tuning/**", "POST /v1/*/cancel"])
    assert routes.match(b"DELETE", b"/v1/batches/b1/results") is not None
    assert routes.match(b"PUT", b"/v1/batches/b1/results") is None
    assert routes.match(b"GET", b"/v1/batches/b1/other") is None
    assert routes.match(b"PATCH", b"/v1/fine_tuning/jobs/j1/events") is not None
    assert routes.match(b"GET", b"/v1/fine_tuning") is None  # ** is one or more segments
    assert routes.match(b"POST", b"/v1/x/cancel") is not None
    assert routes.match(b"POST", b"/v1/x/y/cancel") is None


def test_clean_paths() -> None:
    assert is_clean_path(b"/v1/files/file-abc_1.txt")
    assert is_clean_path(b"/a/b:c@d")
    for path in (b"", b"v1", b"/", b"/a//b", b"/a/", b"/a/./b", b"/a/../b", b"/a%20b", b"/a?b", b"/a\\b", b"/a b"):
        assert not is_clean_path(path), path


CONFIG = """
clusters:
  - name: a
    endpoints: ["127.0.0.1:1"]
    allowed_routes: {routes}
routing: {{overlay_file: o.json, mcp_path: {mcp}}}
"""


def problems(routes: str = "[]", mcp: str = "/mcp") -> str:
    try:
        parse_config(CONFIG.format(routes=routes, mcp=mcp))
    except ConfigError as error:
        return str(error)
    return ""


def test_valid_entries_load() -> None:
    assert problems('["GET /v1/files/*", "GET,DELETE /v1/batches/**", "* /x"]', "null") == ""


@pytest.mark.parametrize(("routes", "expected"), [
    ('["GET"]', 'clusters[0].allowed_routes[0]: \'GET\' is not "METHOD /path"'),
    ('["GET /v1/files/*", "get /x"]', "clusters[0].allowed_routes[1]: 'get' is not a method"),
    ('["CONNECT /x"]', "clusters[0].allowed_routes[0]: CONNECT cannot be proxied"),
    ('["GET v1/files"]', "clusters[0].allowed_routes[0]: path 'v1/files': must start with /"),
    ('["GET /v1/files/../admin"]', "has a dot segment"),
    ('["GET /v1//files"]', "has an empty segment"),
    ('["GET /v1/files/"]', "has an empty segment"),
    ('["GET /v1/%66iles"]', "no %, ? or #"),
    ('["GET /v1/files?x=1"]', "no %, ? or #"),
    ('["GET /v1/a**"]', "** must be a whole segment"),
    ('["POST /v1/chat/completions"]', "allowed for every cluster already"),
    ('["GET /v1/models"]', "answered by the gateway itself"),
])
def test_bad_entries_are_config_errors_naming_the_field(routes: str, expected: str) -> None:
    assert expected in problems(routes)


@pytest.mark.parametrize(("mcp", "expected"), [
    ("/v1/chat/completions", "routing.mcp_path: '/v1/chat/completions' is an API route already"),
    ("/mcp/*", "routing.mcp_path: '/mcp/*' must be a path, not a glob"),
    ("mcp", "routing.mcp_path: 'mcp' must start with /"),
])
def test_bad_mcp_paths_are_config_errors(mcp: str, expected: str) -> None:
    assert expected in problems(mcp=mcp)
