"""The CORS policy at the head gate (workers/cors_gate.py): preflights answered before the key is
checked, the CORS headers of an admitted request's answers, refusals left to the head gate. Real
HeadGate, Authenticator, HeaderPlan, RouteTable and CorsPolicy; a bare slot holder stands in for the
server's connection."""

from __future__ import annotations

from gateway.identity.auth import Authenticator, hash_api_key
from gateway.request.cors import CorsPolicy
from gateway.request.headers import HeaderPlan
from gateway.request.routes import RouteTable
from workers.cors_gate import CorsGate, request_origin
from workers.head_gate import Admitted, HeadGate, HeadRefusal

APP = b"https://app.example.com"


class Connection:
    __slots__ = ("auth_memo",)

    def __init__(self) -> None:
        self.auth_memo = None


def cors_gate() -> CorsGate:
    head = HeadGate(RouteTable("/mcp"), Authenticator([("team-a", hash_api_key("sk-a"))]), HeaderPlan("X-Model"))
    return CorsGate(CorsPolicy([APP.decode()], max_age=120), head, head.ids.next)


def preflight(origin: bytes, method: bytes = b"POST") -> list[tuple[bytes, bytes]]:
    return [(b"host", b"g"), (b"origin", origin), (b"access-control-request-method", method),
            (b"access-control-request-headers", b"Authorization, Content-Type")]


def test_a_preflight_from_a_listed_origin_is_204_without_a_key_on_any_path() -> None:
    for path in (b"/v1/chat/completions", b"/v1/messages", b"/not/a/route"):
        answer = cors_gate()(Connection(), b"OPTIONS", path, preflight(APP))
        assert type(answer) is HeadRefusal and answer.status == 204 and answer.tenant is None
        headers = dict(answer.headers)
        assert headers[b"access-control-allow-origin"] == APP
        assert headers[b"access-control-allow-methods"] == b"POST"
        assert headers[b"access-control-allow-headers"] == b"authorization,content-type"
        assert headers[b"access-control-max-age"] == b"120"
        assert b"x-request-id" in headers and b"access-control-allow-credentials" not in headers


def test_a_preflight_from_another_origin_is_403_without_cors_headers() -> None:
    answer = cors_gate()(Connection(), b"OPTIONS", b"/v1/chat/completions", preflight(b"https://evil.example"))
    assert type(answer) is HeadRefusal and (answer.status, answer.code) == (403, "origin_not_allowed")
    assert not [name for name, _ in answer.headers if name.startswith(b"access-control-")]
    malformed = cors_gate()(Connection(), b"OPTIONS", b"/v1/chat/completions", preflight(APP, b"P O S T"))
    assert (malformed.status, malformed.code) == (400, "invalid_preflight")


def test_options_that_is_not_a_preflight_goes_to_the_head_gate() -> None:
    # A preflight is OPTIONS with both Origin and Access-Control-Request-Method; anything short of it is an
    # ordinary request, which needs a key.
    no_request_method = [(b"host", b"g"), (b"origin", APP)]
    no_origin = [(b"host", b"g"), (b"access-control-request-method", b"POST")]
    for method, headers in ((b"OPTIONS", no_request_method), (b"OPTIONS", no_origin), (b"POST", preflight(APP))):
        answer = cors_gate()(Connection(), method, b"/v1/chat/completions", headers)
        assert type(answer) is HeadRefusal and answer.status == 401, (method, headers)


def test_an_admitted_request_carries_the_cors_headers_of_its_origin() -> None:
    key = (b"authorization", b"Bearer sk-a")
    gate = cors_gate()
    listed = gate(Connection(), b"POST", b"/v1/messages", [(b"host", b"g"), key, (b"origin", APP)])
    assert type(listed) is Admitted
    assert dict(listed.cors)[b"access-control-allow-origin"] == APP and (b"vary", b"Origin") in listed.cors
    other = gate(Connection(), b"POST", b"/v1/messages", [(b"host", b"g"), key, (b"origin", b"https://x.example")])
    none = gate(Connection(), b"POST", b"/v1/messages", [(b"host", b"g"), key])
    assert other.cors == () and none.cors == ()  # CORS on: nothing to add, the provider's still dropped
    refused = gate(Connection(), b"POST", b"/v1/messages", [(b"host", b"g"), (b"origin", APP)])
    assert type(refused) is HeadRefusal and refused.status == 401  # its CORS headers come from the server


def test_request_origin() -> None:
    assert request_origin([(b"host", b"g"), (b"origin", APP)]) == APP
    assert request_origin([(b"host", b"g")]) is None
