"""The one header scan: what the gateway consumes, what it forwards."""

from __future__ import annotations

from gateway.request.headers import ACCEPT_ENCODING, IDENTITY_ENCODING, HeaderPlan, ask_identity_encoding


def scan(headers, **plan):
    return HeaderPlan(plan.pop("model_header", "X-Model"), **plan).scan(headers)


def test_credentials_framing_and_hop_by_hop_are_consumed_not_forwarded():
    found = scan([
        (b"host", b"gw"), (b"authorization", b"Bearer k"), (b"x-api-key", b"k2"), (b"content-length", b"3"),
        (b"transfer-encoding", b"chunked"), (b"te", b"trailers"), (b"upgrade", b"h2c"), (b"expect", b"100-continue"),
        (b"proxy-authorization", b"p"), (b"keep-alive", b"5"), (b"x-ai-routing-candidate", b"spoof"),
        (b"x-gridgate-provider", b"spoof"), (b"accept", b"*/*"),
    ])
    assert found.forward == [(b"accept", b"*/*")]
    assert (found.authorization, found.api_key) == (b"Bearer k", b"k2")


def test_names_listed_in_connection_are_dropped_from_every_connection_header():
    found = scan([(b"connection", b"x-a"), (b"connection", b"X-B, close"), (b"x-a", b"1"), (b"x-b", b"2"),
                  (b"x-c", b"3")])
    assert found.forward == [(b"x-c", b"3")]


def test_configured_headers_are_read_and_still_forwarded():
    found = scan([(b"x-model", b"m"), (b"x-session-id", b"s"), (b"x-user", b"u"), (b"content-type", b"a/j"),
                  (b"cookie", b"c=1")], session_header="X-Session-Id", balance_key_headers=["X-User"])
    assert (found.model, found.session, found.content_type, found.cookie) == (b"m", b"s", b"a/j", b"c=1")
    assert found.balance_keys == {b"x-user": b"u"}
    assert [name for name, _ in found.forward] == [b"x-model", b"x-session-id", b"x-user", b"content-type", b"cookie"]


def test_pin_header_is_consumed():
    found = scan([(b"x-gridgate-pin", b"provider-a")], pin_header="X-Gridgate-Pin")
    assert found.pin == b"provider-a" and found.forward == []


def test_forwarded_for_lines_are_joined_and_request_id_validated():
    found = scan([(b"x-forwarded-for", b"1.1.1.1"), (b"x-forwarded-for", b"2.2.2.2"), (b"x-request-id", b"ok-1")])
    assert found.xff == b"1.1.1.1, 2.2.2.2" and found.request_id == b"ok-1"
    assert scan([(b"x-request-id", b"has space")]).request_id is None
    assert scan([(b"x-request-id", b"x" * 129)]).request_id is None
    assert scan([(b"x-request-id", b"x" * 128)]).request_id == b"x" * 128
    for bad in (b"caf\xc3\xa9", b"tab\there", b"del\x7f", b""):  # visible ASCII only, 1..128 bytes
        assert scan([(b"x-request-id", bad)]).request_id is None
    assert scan([(b"x-request-id", b"!~{}\"")]).request_id == b"!~{}\""


def test_a_header_named_like_an_upstream_credential_is_never_forwarded():
    # Issue 27, finding 15: a client's `api-key` was sent upstream ahead of the gateway's own.
    found = scan([(b"api-key", b"client-guess"), (b"x-provider-token", b"t"), (b"authorization", b"Bearer k"),
                  (b"accept", b"*/*")], credential_headers=["Api-Key", "X-Provider-Token", "Authorization"])
    assert found.forward == [(b"accept", b"*/*")]
    assert found.authorization == b"Bearer k"  # still the client's key to the gateway


def test_a_credential_header_wins_over_any_other_use_of_its_name():
    found = scan([(b"x-user", b"u")], balance_key_headers=["X-User"], credential_headers=["x-user"])
    assert found.forward == []


def test_accept_encoding_is_kept_aside_and_a_metered_request_asks_for_identity():
    found = scan([(b"accept-encoding", b"gzip"), (b"accept-encoding", b"br"), (b"accept", b"*/*")])
    assert found.forward == [(b"accept", b"*/*")] and found.accept_encoding == b"gzip, br"
    forward = [*found.forward, (ACCEPT_ENCODING, found.accept_encoding)]  # as forwarded_headers leaves it
    ask_identity_encoding(forward)
    assert forward == [(b"accept", b"*/*"), IDENTITY_ENCODING]
    without = [(b"accept", b"*/*")]  # the client sent none: any coding would do, so ask for identity
    ask_identity_encoding(without)
    assert without == [(b"accept", b"*/*"), IDENTITY_ENCODING]
    assert scan([(b"connection", b"accept-encoding"), (b"accept-encoding", b"gzip")]).accept_encoding is None
