"""The CORS policy (gateway/request/cors.py) and the ``cors`` block (docs/cors.md): preflights as
browsers send them, the headers of actual answers, a key's own origins, and config errors that name
the field."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.http.errors import ErrorReply
from gateway.request import cors
from gateway.request.cors import CorsPolicy, PreflightReply, key_origin_reply, parse_key_origins

APP = b"https://app.example.com"
BASE = """
clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]
routing: {overlay_file: overlay.json}
"""


def policy(*origins: str, **options: object) -> CorsPolicy:
    return CorsPolicy(origins, **options)  # type: ignore[arg-type]


def headers_of(answer: PreflightReply | ErrorReply) -> dict[bytes, bytes]:
    return {name: value for name, value in answer.headers}


# What browsers send (Chrome 13x): the SDKs' own headers, lowercase and sorted.
OPENAI_SDK_HEADERS = (b"authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
                      b"x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
                      b"x-stainless-runtime-version,x-stainless-timeout")
ANTHROPIC_SDK_HEADERS = (b"anthropic-dangerous-direct-browser-access,anthropic-version,content-type,x-api-key,"
                         b"x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-retry-count")


@pytest.mark.parametrize("requested", [OPENAI_SDK_HEADERS, ANTHROPIC_SDK_HEADERS])
def test_a_preflight_from_a_listed_origin_is_answered_204(requested: bytes) -> None:
    answer = policy("https://app.example.com", max_age=600).preflight(APP, b"POST", requested)
    assert type(answer) is PreflightReply and answer.status == 204
    assert headers_of(answer) == {
        b"access-control-allow-origin": APP,
        b"access-control-allow-methods": b"POST",
        b"access-control-allow-headers": requested,
        b"access-control-max-age": b"600",
        b"vary": b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
    }


def test_a_preflight_from_another_origin_is_403_without_cors_headers() -> None:
    answer = policy("https://app.example.com").preflight(b"https://evil.example", b"POST", b"authorization")
    assert type(answer) is ErrorReply and (answer.status, answer.code) == (403, "origin_not_allowed")
    assert [name for name, _ in answer.headers] == [b"vary"]


def test_requested_headers_are_normalised_and_methods_echoed() -> None:
    answer = policy("*").preflight(APP, b"DELETE", b"X-Api-Key , Content-Type")
    assert headers_of(answer)[b"access-control-allow-headers"] == b"x-api-key,content-type"
    assert headers_of(answer)[b"access-control-allow-methods"] == b"DELETE"
    assert b"access-control-allow-headers" not in headers_of(policy("*").preflight(APP, b"POST", None))


@pytest.mark.parametrize(("method", "requested"), [
    (b"PO ST", None),
    (b"", None),
    (b"POST", b"authorization, bad header"),
    (b"POST", b"a" * 5000),
    (b"POST", b"x-a\r\nx-b"),
])
def test_a_malformed_preflight_is_400(method: bytes, requested: bytes | None) -> None:
    answer = policy("*").preflight(APP, method, requested)
    assert type(answer) is ErrorReply and (answer.status, answer.code) == (400, "invalid_preflight")


def test_credentials_are_never_allowed_and_star_is_literal() -> None:
    any_origin = policy("*")
    preflight = any_origin.preflight(b"https://anyone.test", b"POST", b"authorization")
    assert headers_of(preflight)[b"access-control-allow-origin"] == b"*"
    actual = dict(any_origin.response_headers(b"https://anyone.test"))
    assert actual[b"access-control-allow-origin"] == b"*"
    for answer in (preflight.headers, actual, policy("https://app.example.com").response_headers(APP)):
        assert b"access-control-allow-credentials" not in dict(answer)


def test_regex_origins_match_the_whole_origin() -> None:
    tenants = policy(r"regex:https://[a-z0-9-]+\.example\.com", "http://localhost:3000")
    assert tenants.allows(b"https://team-1.example.com")
    assert tenants.allows(b"http://localhost:3000")
    assert not tenants.allows(b"https://team-1.example.com.attacker.net")
    assert not tenants.allows(b"http://localhost:30001")
    assert not tenants.allows(b"https://example.com")


def test_actual_answers_expose_the_gateway_headers_to_listed_origins_only() -> None:
    listed = policy("https://app.example.com")
    headers = dict(listed.response_headers(APP))
    assert headers[b"access-control-allow-origin"] == APP and headers[b"vary"] == b"Origin"
    exposed = headers[b"access-control-expose-headers"].split(b", ")
    for name in (b"x-request-id", b"retry-after", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-requests",
                 b"x-gridgate-provider", b"x-gridgate-attempts", b"x-gridgate-model"):
        assert name in exposed
    assert listed.response_headers(b"https://evil.example") == ()


def test_expose_headers_can_add_to_or_replace_the_default() -> None:
    extra = dict(policy("*", expose_headers=["default", "OpenAI-Processing-Ms"]).response_headers(APP))
    assert extra[b"access-control-expose-headers"].endswith(b", x-gridgate-fallback-hops, openai-processing-ms")
    only = dict(policy("*", expose_headers=["x-request-id"]).response_headers(APP))
    assert only[b"access-control-expose-headers"] == b"x-request-id"


def test_the_answer_per_origin_is_remembered_and_bounded() -> None:
    listed = policy(r"regex:https://[0-9]+\.example\.com")
    assert listed.response_headers(b"https://1.example.com") is listed.response_headers(b"https://1.example.com")
    for n in range(3000):
        listed.response_headers(b"https://%d.example.com" % n)
    assert len(listed._seen) <= cors._MAX_SEEN




# --- a key's own origins --------------------------------------------------------------------------


def test_a_key_s_origins_narrow_who_may_use_it() -> None:
    allowed = parse_key_origins(["https://App.example.com", "http://localhost:5173"])
    assert key_origin_reply(APP, allowed) is None
    assert key_origin_reply(b"http://localhost:5173", allowed) is None
    refused = key_origin_reply(b"https://other.example.com", allowed)
    assert refused is not None and (refused.status, refused.code) == (403, "origin_not_allowed")
    assert key_origin_reply(b"https://other.example.com", None) is None  # no list: anywhere
    assert key_origin_reply(None, allowed) is None  # not a browser page


def test_a_key_s_origins_take_patterns_but_not_any() -> None:
    allowed = parse_key_origins(["https://a.example.com", r"regex:https://[a-z]+\.example\.org"])
    assert key_origin_reply(b"https://pages.example.org", allowed) is None
    assert key_origin_reply(b"https://pages.example.org.evil.com", allowed) is not None  # whole origin
    with pytest.raises(ValueError, match=r"^\[1\]: '\*' admits every origin"):
        parse_key_origins(["https://a.example.com", "*"])
    with pytest.raises(ValueError, match=r"^\[0\]: 'https://a.example.com/x' is not an origin"):
        parse_key_origins(["https://a.example.com/x"])


# --- the config block -----------------------------------------------------------------------------


def test_cors_is_off_by_default_and_built_from_the_block() -> None:
    assert parse_config(BASE).cors is None
    assert CorsPolicy.from_config(parse_config(BASE).cors) is None
    config = parse_config(BASE + "cors: {allowed_origins: ['https://App.example.com'], max_age: 10m}\n")
    built = CorsPolicy.from_config(config.cors)
    assert built is not None and built.max_age == b"600" and built.allows(APP)


@pytest.mark.parametrize(("block", "message"), [
    ("{allowed_origins: []}", "cors.allowed_origins: list at least one origin"),
    ("{}", "cors.allowed_origins"),
    ("{allowed_origins: ['https://a.example', 'regex:(']}", "cors.allowed_origins[1]: 'regex:(': bad regular"),
    ("{allowed_origins: ['*', 'https://a.example']}", "cors.allowed_origins[0]: '*' admits every origin"),
    ("{allowed_origins: ['https://a.example/']}", "cors.allowed_origins[0]: 'https://a.example/' is not an origin"),
    ("{allowed_origins: ['https://*.a.example']}", "cors.allowed_origins[0]: 'https://*.a.example': globs"),
    ("{allowed_origins: ['https://a.example:443']}", "cors.allowed_origins[0]: 'https://a.example:443': browsers"),
    ("{allowed_origins: ['null']}", "cors.allowed_origins[0]: 'null'"),
    ("{allowed_origins: ['*'], max_age: 2d}", "cors.max_age: must be <= 1d"),
    ("{allowed_origins: ['*'], expose_headers: 'x y'}", "cors.expose_headers: 'x y' is not a header name"),
    ("{allowed_origins: ['*'], expose_headers: [default, '*']}", "cors.expose_headers[1]: '*' exposes every"),
    ("{allowed_origins: ['*'], credentials: true}", "cors"),
])
def test_config_errors_name_the_field(block: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(BASE + f"cors: {block}\n")
    assert message in str(raised.value)
