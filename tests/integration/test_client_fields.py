"""What a client controls and must not abuse, through a real gateway and a real mock provider: a header
named like the provider credential, and request bodies the decoder cannot take (issue 27, findings 14
and 15)."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness import Client, candidate, chat, envelope, metric_value, wait_until

SECRET_ENV = "GG_TEST_CLIENT_FIELDS_SECRET"


def test_a_client_header_named_like_the_upstream_credential_never_reaches_the_provider(providers, gateway_factory):
    handle = providers["provider-a"]
    gateway = gateway_factory(
        {"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]),
        cluster_options={"upstream_auth": {"header": "api-key", "value_env": SECRET_ENV}},
        env={SECRET_ENV: "gateway-secret"},
    )
    response = chat(gateway.port, "m", headers=[("Api-Key", "client-guess"), ("api-key", "another"),
                                                 ("X-Mock-Echo", "1")])
    assert response.status == 200, response.body
    seen = [value for name, value in response.json()["mock_echo"]["headers"] if name.lower() == "api-key"]
    assert seen == ["Bearer gateway-secret"]  # on main the client's came first, then the gateway's


DEEP = b"[" * 1000 + b"]" * 1000
UNDECODABLE = {
    "nested_1000_deep": b'{"model": "m", "metadata": ' + DEEP + b"}",
    "deep_in_a_message": b'{"model": "m", "messages": [{"role": "user", "content": ' + DEEP + b"}]}",
    # In a field the gateway decodes (one it skips is the provider's to judge: no full UTF-8 pass here).
    "invalid_utf8": b'{"model": "m\xff\xfe", "messages": []}',
}


@pytest.mark.parametrize("name", sorted(UNDECODABLE))
def test_a_body_the_decoder_cannot_take_is_400_invalid_json_with_an_access_line(name, providers, gateway_factory):
    gateway = gateway_factory({"provider-a": [providers["provider-a"].address]},
                              envelope([candidate("m", "provider-a")]), extra={"access_log": {"path": "access.log"}})
    client = Client(gateway.port)
    try:
        response = client.request("POST", "/v1/chat/completions", UNDECODABLE[name],
                                  [("content-type", "application/json"), ("x-request-id", f"bad-{name}")])
        assert response.status == 400, response.body
        assert response.json()["error"]["code"] == "invalid_json"
        # Nothing was lost: the same connection serves the next request.
        assert client.request("POST", "/v1/chat/completions", {"model": "m"}).status == 200
    finally:
        client.close()
    path = os.path.join(gateway.directory, "access.log")

    def logged() -> list[dict]:
        try:
            with open(path, "rb") as handle:
                return [json.loads(line) for line in handle if line.startswith(b"{")]
        except FileNotFoundError:
            return []

    lines = wait_until(lambda: [line for line in logged() if line["request_id"] == f"bad-{name}"], "its access line")
    assert (lines[0]["status"], lines[0]["error"]) == (400, "invalid_json")
    wait_until(lambda: metric_value(gateway.admin_port, 'gridgate_gateway_errors_total{status="400"}') >= 1,
               "the 400 counted")
    assert "Traceback" not in gateway.log() and "request handler failed" not in gateway.log()


def test_numbers_out_of_range_are_a_400_not_a_500(providers, loopback_gateway_factory):
    gateway = loopback_gateway_factory({"provider-a": [providers["provider-a"].address]},
                              envelope([candidate("m", "provider-a")]))
    client = Client(gateway.port)
    try:
        for body in (b'{"model": "m", "max_tokens": 1e400}', b'{"model": "m", "max_tokens": -1e999}'):
            response = client.request("POST", "/v1/chat/completions", body, [("content-type", "application/json")])
            assert response.status == 400 and response.json()["error"]["code"] == "invalid_request", response.body
    finally:
        client.close()
