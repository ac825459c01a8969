"""The API surface table (gateway/request/surfaces.py) as the route table hands it out, and the error
shapes it selects (gateway/http/errors.py): docs/api-surfaces.md."""

from __future__ import annotations

import json

import pytest

from gateway.http.errors import (
    ANTHROPIC_SHAPE,
    OPENAI_SHAPE,
    ErrorReply,
    anthropic_error_type,
    sse_error_event,
    sse_error_event_in,
)
from gateway.request import surfaces
from gateway.request.routes import API_ROUTES, RouteTable

TABLE = RouteTable("/mcp", [("a", ["GET /v1/files/*", "POST /v1/batches"])], {"a": 0, "b": 1})

# (method, target) -> (surface, rewrites_stream, usage, errors, metered): the table as a client meets it.
EXPECTED = [
    (b"POST", b"/v1/chat/completions", "chat_completions", True, surfaces.OPENAI_USAGE, OPENAI_SHAPE, True),
    (b"POST", b"/v1/chat/completions?api-version=1", "chat_completions", True, surfaces.OPENAI_USAGE, OPENAI_SHAPE,
     True),
    (b"POST", b"/v1/completions", "completions", True, surfaces.OPENAI_USAGE, OPENAI_SHAPE, True),
    (b"POST", b"/v1/embeddings", "embeddings", False, surfaces.OPENAI_USAGE, OPENAI_SHAPE, True),
    (b"POST", b"/v1/responses", "responses", False, surfaces.RESPONSES_USAGE, OPENAI_SHAPE, True),
    (b"POST", b"/v1/messages", "messages", False, surfaces.MESSAGES_USAGE, ANTHROPIC_SHAPE, True),
    (b"POST", b"/v1/messages?beta=true", "messages", False, surfaces.MESSAGES_USAGE, ANTHROPIC_SHAPE, True),
    (b"POST", b"/v1/messages/count_tokens", "count_tokens", False, surfaces.NO_USAGE, ANTHROPIC_SHAPE, False),
    (b"POST", b"/mcp", "mcp", False, surfaces.OPENAI_USAGE, OPENAI_SHAPE, True),
    (b"GET", b"/mcp", "mcp", False, surfaces.OPENAI_USAGE, OPENAI_SHAPE, True),
    (b"GET", b"/v1/models", "models", False, surfaces.NO_USAGE, OPENAI_SHAPE, False),
    (b"GET", b"/v1/models/gpt-4o", "models", False, surfaces.NO_USAGE, OPENAI_SHAPE, False),
    (b"GET", b"/v1/files/file-1", "other", False, surfaces.OPENAI_USAGE, OPENAI_SHAPE, True),
    (b"POST", b"/v1/batches", "other", False, surfaces.OPENAI_USAGE, OPENAI_SHAPE, True),
]


@pytest.mark.parametrize(("method", "target", "name", "rewrites", "usage", "errors", "metered"), EXPECTED)
def test_each_route_carries_its_surface(method: bytes, target: bytes, name: str, rewrites: bool, usage: int,
                                        errors: int, metered: bool) -> None:
    route = TABLE.match(method, target)
    assert route is not None
    surface = route.surface
    assert (surface.name, surface.rewrites_stream, surface.usage, surface.errors, surface.metered) == \
        (name, rewrites, usage, errors, metered)


def test_only_apis_that_define_stream_options_may_be_rewritten() -> None:
    assert [s.path for s in surfaces.API_SURFACES if s.rewrites_stream] == ["/v1/chat/completions",
                                                                           "/v1/completions"]


def test_the_api_routes_are_the_surface_rows() -> None:
    assert API_ROUTES == tuple(s.path for s in surfaces.API_SURFACES)
    assert set(surfaces.SURFACE_BY_PATH) == set(API_ROUTES)


def test_a_route_lookup_returns_the_same_object_every_time() -> None:
    """The surface comes with the route lookup the head gate makes anyway: no allocation per request."""
    assert TABLE.match(b"POST", b"/v1/messages") is TABLE.match(b"POST", b"/v1/messages?x=1")


@pytest.mark.parametrize(("target", "shape"), [
    (b"/v1/messages", ANTHROPIC_SHAPE),
    (b"/v1/messages?beta=true", ANTHROPIC_SHAPE),
    (b"/v1/messages/batches", ANTHROPIC_SHAPE),
    (b"/v1/messages/count_tokens", ANTHROPIC_SHAPE),
    (b"/v1/messagesx", OPENAI_SHAPE),
    (b"/v1/chat/completions", OPENAI_SHAPE),
    (b"/v1/responses", OPENAI_SHAPE),
    (b"/", OPENAI_SHAPE),
])
def test_error_shape_of_a_target_no_route_admitted(target: bytes, shape: int) -> None:
    assert surfaces.error_shape_of_target(target) == shape


# --- the error shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "anthropic_type"), [
    (400, "invalid_request_error"),
    (401, "authentication_error"),
    (403, "permission_error"),
    (404, "not_found_error"),
    (405, "invalid_request_error"),
    (408, "timeout_error"),
    (413, "request_too_large"),
    (429, "rate_limit_error"),
    (431, "invalid_request_error"),
    (500, "api_error"),
    (501, "invalid_request_error"),
    (502, "api_error"),
    (503, "overloaded_error"),
    (504, "timeout_error"),
    (505, "invalid_request_error"),
    (507, "api_error"),
])
def test_anthropic_shape_by_status(status: int, anthropic_type: str) -> None:
    reply = ErrorReply(status, "some_code", "What went wrong.")
    assert json.loads(reply.body(ANTHROPIC_SHAPE)) == {
        "type": "error", "error": {"type": anthropic_type, "message": "What went wrong.", "code": "some_code"}}


def test_openai_shape_is_the_default_and_unchanged() -> None:
    reply = ErrorReply(429, "quota_exceeded", "Slow down.")
    assert reply.body() == reply.body(OPENAI_SHAPE)
    assert json.loads(reply.body()) == {"error": {"message": "Slow down.", "type": "rate_limit_error",
                                                  "code": "quota_exceeded"}}


def test_an_explicit_type_is_kept_when_anthropic_has_it_else_mapped() -> None:
    assert anthropic_error_type(400, "invalid_request_error") == "invalid_request_error"
    assert anthropic_error_type(502, "upstream_error") == "api_error"
    assert anthropic_error_type(503, "service_unavailable") == "overloaded_error"
    assert anthropic_error_type(418, "teapot_error") == "invalid_request_error"


def test_anthropic_sdk_parses_the_shape() -> None:
    """The official SDK turns our body into its typed error with our message."""
    anthropic = pytest.importorskip("anthropic")
    try:  # the HTTP library the installed SDK builds on
        import httpx2 as httpx
    except ImportError:
        import httpx  # type: ignore[no-redef]

    body = ErrorReply(429, "quota_exceeded", "Token quota exceeded.").body(ANTHROPIC_SHAPE)
    request = httpx.Request("POST", "http://gateway.test/v1/messages")
    response = httpx.Response(429, content=body, headers={"content-type": "application/json"}, request=request)
    client = anthropic.Anthropic(api_key="k", base_url="http://gateway.test")
    error = client._make_status_error_from_response(response)
    assert isinstance(error, anthropic.RateLimitError)
    assert error.body["error"]["type"] == "rate_limit_error"
    assert "Token quota exceeded." in str(error)


def test_sse_error_event_per_shape() -> None:
    assert sse_error_event_in(OPENAI_SHAPE, "upstream_cut", "The provider went away.") == \
        sse_error_event("upstream_cut", "The provider went away.")
    event = sse_error_event_in(ANTHROPIC_SHAPE, "upstream_cut", "The provider went away.")
    name, data = event.rstrip(b"\n").split(b"\n")
    assert name == b"event: error" and event.endswith(b"\n\n")
    assert json.loads(data[len(b"data: "):]) == {
        "type": "error", "error": {"type": "api_error", "message": "The provider went away.", "code": "upstream_cut"}}
