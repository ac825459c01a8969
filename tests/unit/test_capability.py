"""Capability lookup from the model header / JSON body / MCP JSON-RPC, and session keys."""

from __future__ import annotations

import json

import pytest

from gateway.http.errors import ErrorReply
from gateway.http.media import is_json_content_type
from gateway.overlay.snapshot import MCP_SESSION_CAPABILITY
from gateway.request.capability import (
    CapabilityRequest,
    header_token,
    lookup_capability,
    session_key,
)

JSON = b"application/json"


def ok(header: bytes | str | None, body: bytes, content_type: bytes | str | None = JSON) -> CapabilityRequest:
    result = lookup_capability(header, body, content_type)
    assert isinstance(result, CapabilityRequest), result
    return result


def error(
    header: bytes | str | None, body: bytes, content_type: bytes | str | None = JSON
) -> ErrorReply:
    result = lookup_capability(header, body, content_type)
    assert isinstance(result, ErrorReply), result
    return result


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"gpt-4o", b"gpt-4o"),
        (b" \tgpt-4o \t", b"gpt-4o"),
        ("gpt-4o", b"gpt-4o"),
        (b"x" * 256, b"x" * 256),
        (b"x" * 257, None),
        (b"", None),
        (b"   ", None),
        (b"gpt 4o", None),
        (b"gpt\x00", None),
        ("modèle", None),
        (b"mod\xc3\xa8le", None),
        (None, None),
    ],
)
def test_header_token_rules(raw: bytes | str | None, expected: bytes | None) -> None:
    assert header_token(raw) == expected


def test_model_header_names_an_inference_model() -> None:
    result = ok(b" gpt-4o ", b"")
    assert (result.kind, result.name, result.body) == ("inference_model", "gpt-4o", None)


def test_model_header_wins_over_body_model() -> None:
    result = ok(b"from-header", b'{"model": "from-body", "max_tokens": 5}')
    assert result.name == "from-header"
    assert result.body is not None and result.body.max_tokens == 5


def test_body_model_is_used_without_header() -> None:
    result = ok(None, b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}')
    assert (result.kind, result.name) == ("inference_model", "gpt-4o")


def test_body_fields_are_decoded() -> None:
    body = json.dumps(
        {
            "model": "m",
            "max_tokens": 100,
            "max_completion_tokens": 200,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        }
    ).encode()
    fields = ok(None, body).body
    assert fields is not None
    assert (fields.max_tokens, fields.max_completion_tokens, fields.stream, fields.include_usage) == (
        100,
        200,
        True,
        True,
    )
    assert fields.completion_allowance == 200


def test_the_responses_api_s_max_output_tokens_is_an_allowance() -> None:
    body = b'{"model": "m", "input": "hi", "max_output_tokens": 3000, "max_tokens": 2}'
    for facts in (False, True):
        result = lookup_capability(None, body, JSON, facts)
        assert isinstance(result, CapabilityRequest) and result.body is not None
        assert (result.body.max_output_tokens, result.body.completion_allowance) == (3000, 3000)
    none = ok(None, b'{"model": "m"}').body
    assert none is not None and none.completion_allowance is None


def test_absent_optional_fields_default() -> None:
    fields = ok(None, b'{"model": "m"}').body
    assert fields is not None
    assert (fields.max_tokens, fields.stream, fields.include_usage) == (None, None, False)


def test_invalid_model_header_is_400() -> None:
    result = error(b"bad model", b'{"model": "m"}')
    assert (result.status, result.code) == (400, "invalid_model_header")


def test_no_capability_is_400() -> None:
    assert (error(None, b"").status, error(None, b"").code) == (400, "missing_capability")
    assert error(None, b'{"messages": []}').code == "missing_capability"


@pytest.mark.parametrize("model", ["", "   ", "x" * 257])
def test_invalid_body_model_is_400(model: str) -> None:
    result = error(None, json.dumps({"model": model}).encode())
    assert (result.status, result.code) == (400, "invalid_model")


@pytest.mark.parametrize("body", [b"{", b"not json", b'{"model": "m",}', b'{"model": "m"} trailing'])
def test_bad_json_is_invalid_json(body: bytes) -> None:
    result = error(b"m", body)
    assert (result.status, result.code) == (400, "invalid_json")


_DEEP = b"[" * 1000 + b"]" * 1000


@pytest.mark.parametrize("body", [
    b'{"model": "m", "metadata": ' + _DEEP + b"}",  # a field the gateway skips
    b'{"model": "m", "messages": [{"role": "user", "content": ' + _DEEP + b"}]}",  # one it keeps raw
    b'{"model": "m", "x": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1001,  # objects, not arrays
    b'{"model": "m\xff"}',  # invalid UTF-8
])
@pytest.mark.parametrize("facts", [False, True])
def test_undecodable_bodies_are_invalid_json_never_an_exception(body: bytes, facts: bool) -> None:
    # Issue 27, finding 14: JSON nested 1,000 deep raised RecursionError (a 500 and a traceback).
    result = lookup_capability(None, body, b"application/json", facts)
    assert type(result) is ErrorReply and (result.status, result.code) == (400, "invalid_json"), result


def test_numbers_out_of_range_and_deep_arrays_instead_of_an_object_are_a_400() -> None:
    assert error(None, b'{"model": "m", "max_tokens": 1e400}').status == 400
    assert error(None, _DEEP).status == 400


@pytest.mark.parametrize(
    "body",
    [b'{"model": 5}', b'{"model": "m", "stream": "yes"}', b'{"model": "m", "max_tokens": "10"}', b"[1, 2]"],
)
def test_known_field_of_wrong_type_is_invalid_request(body: bytes) -> None:
    result = error(None, body)
    assert (result.status, result.code) == (400, "invalid_request")


def test_non_json_body_is_not_decoded() -> None:
    result = ok(b"whisper-1", b"--boundary\r\n...", b"multipart/form-data; boundary=boundary")
    assert result.body is None
    assert (
        error(None, b"--boundary\r\n...", b"multipart/form-data; boundary=boundary").code
        == "missing_capability"
    )


@pytest.mark.parametrize(
    ("content_type", "is_json"),
    [
        (None, True),
        (b"application/json", True),
        (b"Application/JSON; charset=utf-8", True),
        ("application/vnd.api+json", True),
        (b"text/plain", False),
        (b"application/x-ndjson", False),
    ],
)
def test_json_content_types(content_type: bytes | str | None, is_json: bool) -> None:
    assert is_json_content_type(content_type) is is_json


def test_body_without_content_type_is_decoded() -> None:
    assert ok(None, b'{"model": "m"}', None).name == "m"


# --------------------------------------------------------------------------- MCP


def test_mcp_tools_call_routes_by_tool_name_over_the_header() -> None:
    body = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search", "arguments": {"q": 1}}}'
    result = ok(b"some-model", body)
    assert (result.kind, result.name) == ("mcp_tool", "search")


def test_mcp_tools_call_without_name_is_400() -> None:
    result = error(None, b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {}}')
    assert (result.status, result.code) == (400, "invalid_request")


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}}}',
        b'{"jsonrpc": "2.0", "id": 2, "method": "tools/list"}',
        b'{"jsonrpc": "2.0", "method": "notifications/initialized"}',
        b'{"jsonrpc": "2.0", "id": 7, "result": {}}',
    ],
)
def test_other_mcp_messages_use_the_mcp_session_route(body: bytes) -> None:
    result = ok(b"some-model", body)
    assert (result.kind, result.name) == MCP_SESSION_CAPABILITY


def test_jsonrpc_batch_is_invalid_request() -> None:
    assert error(None, b'[{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}]').code == "invalid_request"


# --------------------------------------------------------------------------- session keys


def test_session_key_prefers_the_header() -> None:
    assert session_key(b" abc ", b"sid=cookie", b"sid") == b"abc"


def test_session_key_falls_back_to_the_cookie() -> None:
    assert session_key(None, b"theme=dark; sid=xyz; other=1", b"sid") == b"xyz"
    assert session_key(None, 'a=1;sid="quoted-value"', "sid") == b"quoted-value"
    assert session_key(None, b"sidx=1; xsid=2; sid = spaced ", b"sid") == b"spaced"


def test_invalid_or_oversized_header_falls_back_to_the_cookie() -> None:
    assert session_key(b"x" * 257, b"sid=fallback", b"sid") == b"fallback"
    assert session_key(b"has space", b"sid=fallback", b"sid") == b"fallback"


@pytest.mark.parametrize(
    ("header", "cookie", "name"),
    [
        (None, None, b"sid"),
        (None, b"other=1", b"sid"),
        (None, b"sid=", b"sid"),
        (None, b"sid=" + b"y" * 257, b"sid"),
        (None, b"sid=xyz", None),
        (b"", b"", b"sid"),
    ],
)
def test_no_usable_session_key(header: bytes | None, cookie: bytes | None, name: bytes | None) -> None:
    assert session_key(header, cookie, name) is None
