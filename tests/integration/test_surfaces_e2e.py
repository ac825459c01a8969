"""The Responses and Messages APIs through real gateways (docs/api-surfaces.md): the official ``openai``
and ``anthropic`` SDKs pointed at the gateway, the mock provider behind it, the bundled Valkey for the
quota. What the quota charged is read back from ``/admin/quota`` and compared with the usage the mock
reported to the SDK; gateway-made errors on ``/v1/messages*`` arrive in Anthropic's shape."""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import anthropic
import openai
import pytest

from gateway.identity.auth import hash_api_key
from tests.harness import (
    Client,
    admin_get,
    candidate,
    envelope,
    mock_served,
    raw_exchange,
    refused_port,
    request,
    status_of,
)

KEY = "sk-surfaces"
VERSION = ("anthropic-version", "2023-06-01")
SURFACE_ENDPOINTS = ("responses", "messages", "count_tokens", "chat")


def _quota(url: str, tokens: int) -> dict[str, Any]:
    return {"backend": {"kind": "valkey", "url": url}, "reservation_timeout": "2s",
            "rules": [{"name": f"r-{uuid.uuid4().hex[:8]}", "budgets": [{"window": "1h", "tokens": tokens}],
                       "estimate": {"default_max_tokens": 10}}]}


def _gateway(loopback_gateway_factory, provider_address: str, tenant: str, extra: dict[str, Any] | None = None):
    options = {"auth": {"keys": [{"tenant": tenant, "key": hash_api_key(KEY)}]},
               "access_log": {"path": "access.log"}, **(extra or {})}
    return loopback_gateway_factory({"p": [provider_address]}, envelope([candidate("m", "p")]), extra=options)


def _used(gateway, tenant: str, timeout: float = 5.0) -> int:
    """Tokens charged to the tenant, once nothing is reserved any more (settlement is off the response path)."""
    deadline = time.monotonic() + timeout
    while True:
        report = json.loads(admin_get(gateway.admin_port, f"/admin/quota?tenant={tenant}")[2])
        windows = [window for rule in report["rules"] for window in rule["windows"]]
        if not any(window["reserved"] for window in windows) or time.monotonic() > deadline:
            return sum(window["used"] for window in windows)
        time.sleep(0.02)


def _access_lines(gateway, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    path = os.path.join(gateway.directory, "access.log")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as handle:
                lines = [json.loads(line) for line in handle if line.startswith(b"{")]
        except FileNotFoundError:
            lines = []
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def _openai(gateway) -> openai.OpenAI:
    return openai.OpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{gateway.port}/v1", max_retries=0)


def _anthropic(gateway, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=f"http://127.0.0.1:{gateway.port}", max_retries=0)


# --- usage: what the quota charges is what the provider reported --------------------------------------


def test_responses_through_the_gateway_are_charged_their_usage(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=7)
    gateway = _gateway(gateway_factory, handle.address, "t-resp", {"quota": _quota(valkey_url, 100000)})
    client = _openai(gateway)
    answer = client.responses.create(model="m", input="Say hello", max_output_tokens=50,
                                     extra_headers={"x-mock-cached-tokens": "1", "x-mock-reasoning-tokens": "2"})
    assert answer.status == "completed" and answer.usage is not None
    charged = answer.usage.total_tokens
    assert _used(gateway, "t-resp") == charged
    # Streamed: sent as the client wrote it (a stream_options member would be refused with a 400), and
    # the usage of the final event (response.completed) is charged.
    events = list(client.responses.create(model="m", input="Say hello again", stream=True, max_output_tokens=50))
    assert [event.type for event in events][-1] == "response.completed"
    final = events[-1].response.usage
    assert final is not None and final.output_tokens == 7
    assert _used(gateway, "t-resp") == charged + final.total_tokens


def test_messages_through_the_gateway_are_charged_their_usage(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=6)
    gateway = _gateway(gateway_factory, handle.address, "t-msg", {"quota": _quota(valkey_url, 100000)})
    client = _anthropic(gateway)
    cache = {"x-mock-cached-tokens": "2", "x-mock-cache-write-tokens": "1"}
    message = client.messages.create(model="m", max_tokens=64, extra_headers=cache,
                                     messages=[{"role": "user", "content": "Say hello, in a few more words"}])
    usage = message.usage
    assert (usage.output_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (6, 2, 1)
    # Anthropic's input_tokens leaves the cache out: the prompt charged is input + cache read + cache write.
    first = usage.input_tokens + 2 + 1 + usage.output_tokens
    assert _used(gateway, "t-msg") == first
    with client.messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "Stream it"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.output_tokens == 6
    assert _used(gateway, "t-msg") == first + final.usage.input_tokens + final.usage.output_tokens
    lines = [line for line in _access_lines(gateway, 2) if line.get("tenant") == "t-msg"]
    assert [(line["tokens_prompt"], line["tokens_completion"]) for line in lines] == [
        (usage.input_tokens + 3, 6), (final.usage.input_tokens, 6)]


def test_count_tokens_is_forwarded_and_costs_nothing(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=6)
    gateway = _gateway(gateway_factory, handle.address, "t-count", {"quota": _quota(valkey_url, 100)})
    client = _anthropic(gateway)
    counted = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "How long is this?"}])
    assert counted.input_tokens > 0
    assert _used(gateway, "t-count") == 0
    # The budget spent: inference is refused, counting is still answered (no admission at all).
    client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "spend it"}],
                           extra_headers={"x-mock-tokens": "90"})
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "more"}])
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert int(limited.value.response.headers["retry-after"]) >= 1  # admissible once the window moves
    spent = _used(gateway, "t-count")
    assert client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "still?"}]).input_tokens > 0
    assert _used(gateway, "t-count") == spent
    # Still authenticated: a wrong key is refused before anything is forwarded.
    before = mock_served(handle, SURFACE_ENDPOINTS)
    with pytest.raises(anthropic.AuthenticationError):
        _anthropic(gateway, "sk-wrong").messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])
    assert mock_served(handle, SURFACE_ENDPOINTS) == before


# --- errors in Anthropic's shape -----------------------------------------------------------------------


def test_gateway_errors_on_messages_use_anthropics_shape(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p")
    gateway = _gateway(gateway_factory, handle.address, "t-shape", {"quota": _quota(valkey_url, 40)})
    client = _anthropic(gateway)
    # The quota's 429: the SDK raises its RateLimitError, with Retry-After and the budget headers.
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(model="m", max_tokens=30, messages=[{"role": "user", "content": "x" * 200}])
    body = limited.value.body
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    assert limited.value.response.headers["x-ratelimit-limit-tokens"] == "40"
    # A key refused on the head: 401 authentication_error.
    with pytest.raises(anthropic.AuthenticationError) as refused:
        _anthropic(gateway, "sk-wrong").messages.create(model="m", max_tokens=5,
                                                         messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
    # A route the gateway does not serve under /v1/messages: 404 not_found_error.
    key = ("x-api-key", KEY)
    status, _, raw = _post(gateway.port, "/v1/messages/batches", {"requests": []}, [VERSION, key])
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    # A body the gateway cannot read: 400 invalid_request_error.
    status, _, raw = _post(gateway.port, "/v1/messages", b'{"model": ', [VERSION, key])
    error = json.loads(raw)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    # A body over limits.max_body_bytes, refused on its head (never read): 413 request_too_large.
    raw = raw_exchange(gateway.port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + KEY.encode() +
                       b"\r\nContent-Length: 999999999999\r\n\r\n")
    assert status_of(raw) == 413
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["type"] == "request_too_large"
    # The same failures on chat keep the OpenAI shape.
    status, _, raw = _post(gateway.port, "/v1/chat/completions", b'{"model": ', [key])
    assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json"


def test_upstream_failure_on_messages_uses_anthropics_shape(mock_provider, loopback_gateway_factory):
    gateway = _gateway(loopback_gateway_factory, f"127.0.0.1:{refused_port()}", "t-down")
    with pytest.raises(anthropic.InternalServerError) as failed:
        _anthropic(gateway).messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 502
    assert failed.value.body["type"] == "error" and failed.value.body["error"]["type"] == "api_error"


def test_a_messages_stream_cut_by_the_provider_ends_with_an_anthropic_error_event(mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=8)
    gateway = _gateway(gateway_factory, handle.address, "t-cut")
    with pytest.raises(anthropic.APIStatusError) as failed:
        with _anthropic(gateway).messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "go"}],
                                                 extra_headers={"x-mock-reset": "mid"}) as stream:
            for _ in stream.text_stream:
                pass
    error = failed.value.body
    assert error["type"] == "error" and error["error"]["type"] == "api_error", error
    assert error["error"]["code"] == "upstream_reset"
    assert [line["error"] for line in _access_lines(gateway, 1)] == ["upstream_reset"]
    # Without a quota too, the provider's own error event is seen, and the access line shows the tokens.
    with pytest.raises(anthropic.APIStatusError):
        with _anthropic(gateway).messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "go"}],
                                                 extra_headers={"x-mock-stream-error": "1"}) as stream:
            for _ in stream.text_stream:
                pass
    message = _anthropic(gateway).messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "ok"}])
    lines = _access_lines(gateway, 3)
    assert [line["error"] for line in lines] == ["upstream_reset", "upstream_error_event", None]
    assert lines[2]["tokens_prompt"] == message.usage.input_tokens and lines[2]["tokens_completion"] == 8


def test_an_error_event_mid_stream_is_relayed_and_logged(valkey_url, mock_provider, gateway_factory):
    handle = mock_provider("p", tokens=8)
    gateway = _gateway(gateway_factory, handle.address, "t-err", {"quota": _quota(valkey_url, 100000)})
    with pytest.raises(anthropic.APIStatusError) as failed:
        with _anthropic(gateway).messages.stream(model="m", max_tokens=64, messages=[{"role": "user", "content": "go"}],
                                                 extra_headers={"x-mock-stream-error": "1"}) as stream:
            for _ in stream.text_stream:
                pass
    assert failed.value.body["error"]["type"] == "overloaded_error"  # the provider's event, relayed as sent
    events = list(_openai(gateway).responses.create(model="m", input="go", stream=True,
                                                    extra_headers={"x-mock-stream-error": "1"}))
    assert events[-1].type == "error"
    lines = _access_lines(gateway, 2)
    assert [(line["status"], line["error"]) for line in lines] == [(200, "upstream_error_event")] * 2
    # No final usage came: charged like a cut stream (the prompt and what was relayed), never nothing.
    assert _used(gateway, "t-err") > 0


# --- CORS ------------------------------------------------------------------------------------------------

APP = "https://app.example.com"
CORS = {"cors": {"allowed_origins": [APP, r"regex:https://[a-z0-9-]+\.preview\.example\.com"], "max_age": "5m"}}


def _post(port: int, path: str, body: bytes | dict, headers: list[tuple[str, str]]) -> tuple[int, dict, bytes]:
    client = Client(port)
    try:
        response = client.request("POST", path, body, [("content-type", "application/json"), *headers])
        return response.status, response.headers, response.body
    finally:
        client.close()


def _preflight(port: int, origin: str, path: str = "/v1/chat/completions") -> tuple[int, dict, bytes]:
    client = Client(port)
    try:
        response = client.request("OPTIONS", path, None, [
            ("origin", origin), ("access-control-request-method", "POST"),
            ("access-control-request-headers", "authorization,content-type,x-stainless-os")])
        return response.status, response.headers, response.body
    finally:
        client.close()


def _cors_names(headers: dict[str, str]) -> set[str]:
    return {name for name in headers if name.startswith("access-control-")}


def test_cors_preflights_are_answered_before_the_key(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p")
    gateway = _gateway(loopback_gateway_factory, handle.address, "t-cors", CORS)
    before = mock_served(handle, SURFACE_ENDPOINTS)
    status, headers, body = _preflight(gateway.port, APP)
    assert (status, body) == (204, b"")
    assert headers["access-control-allow-origin"] == APP
    assert headers["access-control-allow-methods"] == "POST"
    assert headers["access-control-allow-headers"] == "authorization,content-type,x-stainless-os"
    assert headers["access-control-max-age"] == "300"
    assert "Origin" in headers["vary"] and "access-control-allow-credentials" not in headers
    preview = "https://pr-12.preview.example.com"
    status, headers, _ = _preflight(gateway.port, preview, "/v1/messages")
    assert status == 204 and headers["access-control-allow-origin"] == preview
    # Another origin: 403, and no CORS header, so the browser stops there.
    status, headers, body = _preflight(gateway.port, "https://evil.example.net")
    assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
    assert not _cors_names(headers)
    assert mock_served(handle, SURFACE_ENDPOINTS) == before  # never forwarded


def test_cors_headers_on_actual_answers(mock_provider, gateway_factory):
    handle = mock_provider("p", cors_origin="*")  # a provider that sends its own CORS header
    gateway = _gateway(gateway_factory, handle.address, "t-cors2", CORS)
    auth = [("authorization", f"Bearer {KEY}")]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    status, headers, _ = _post(gateway.port, "/v1/chat/completions", body, [*auth, ("origin", APP)])
    assert status == 200
    assert headers["access-control-allow-origin"] == APP  # the gateway's, never the provider's `*`
    assert "x-request-id" in headers["access-control-expose-headers"]
    assert "x-ratelimit-remaining-tokens" in headers["access-control-expose-headers"]
    assert headers["vary"].endswith("Origin")
    assert _cors_names(headers) == {"access-control-allow-origin", "access-control-expose-headers"}
    # A gateway-made refusal is readable by the page too: why it was refused.
    status, headers, _ = _post(gateway.port, "/v1/chat/completions", body, [("origin", APP)])
    assert status == 401 and headers["access-control-allow-origin"] == APP
    # Another origin, or none: no CORS header at all, the provider's dropped as well.
    for extra in ([("origin", "https://evil.example.net")], []):
        status, headers, _ = _post(gateway.port, "/v1/chat/completions", body, [*auth, *extra])
        assert status == 200 and not _cors_names(headers), headers
    # The admin listener never sends CORS headers.
    client = Client(gateway.admin_port)
    try:
        answer = client.request("GET", "/readyz", None, [("origin", APP)])
    finally:
        client.close()
    assert answer.status == 200 and not _cors_names(answer.headers)


def test_cors_off_changes_nothing(mock_provider, loopback_gateway_factory):
    handle = mock_provider("p", cors_origin="*")
    gateway = _gateway(loopback_gateway_factory, handle.address, "t-nocors")
    auth = [("authorization", f"Bearer {KEY}")]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    plain = _post(gateway.port, "/v1/chat/completions", body, [*auth, ("x-request-id", "same")])
    from_page = _post(gateway.port, "/v1/chat/completions", body, [*auth, ("x-request-id", "same"), ("origin", APP)])
    strip = ("x-gridgate-overhead-ms", "date")
    assert {k: v for k, v in plain[1].items() if k not in strip} == \
        {k: v for k, v in from_page[1].items() if k not in strip}
    assert from_page[1]["access-control-allow-origin"] == "*"  # the provider's, relayed as before
    # A preflight is an ordinary request: it needs a key (401) and is not a route.
    status, headers, _ = _preflight(gateway.port, APP)
    assert status == 401 and not _cors_names(headers)


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDKs talk to loopback gateways: no proxy from the environment."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)




# --- the filters read each API's own body fields ------------------------------------------------------


def test_the_filters_read_each_apis_body_fields(providers, loopback_gateway_factory):
    models = [
        {"match": {"capability": "m", "cluster": "provider-a"}, "context_window": 2000, "features": ["tools"]},
        {"match": {"capability": "m", "cluster": "provider-b"}, "context_window": 100000, "features": ["vision"]},
        {"match": {"capability": "m"}, "context_window": 100000, "features": []},
    ]
    overlay = envelope([candidate("m", name) for name in providers], mode="roundRobin")
    gateway = loopback_gateway_factory({name: [handle.address] for name, handle in providers.items()}, overlay,
                              extra={"auth": {"keys": [{"tenant": "t-filters", "key": hash_api_key(KEY)}]},
                                     "routing": {"models": models}})
    claude, oai = _anthropic(gateway), _openai(gateway)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    tool = {"name": "f", "input_schema": {"type": "object"}}
    for _ in range(2):  # roundRobin would move on: only the capable provider is left each time
        seen = claude.messages.with_raw_response.create(
            model="m", max_tokens=50, messages=[{"role": "user", "content": [image, {"type": "text", "text": "?"}]}])
        assert seen.headers["x-gridgate-provider"] == "provider-b"
        tools = claude.messages.with_raw_response.create(
            model="m", max_tokens=50, tools=[tool], messages=[{"role": "user", "content": "hi"}])
        assert tools.headers["x-gridgate-provider"] == "provider-a"
        looked = oai.responses.with_raw_response.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/y.png"}]}])
        assert looked.headers["x-gridgate-provider"] == "provider-b"
    # Anthropic's max_tokens is the completion allowance: beyond every window, 400 in Anthropic's shape.
    with pytest.raises(anthropic.BadRequestError) as too_big:
        claude.messages.create(model="m", max_tokens=500_000, messages=[{"role": "user", "content": "hi"}], timeout=30)
    assert too_big.value.body["type"] == "error" and too_big.value.body["error"]["type"] == "invalid_request_error"
    assert too_big.value.body["error"]["code"] == "context_length_exceeded"
    with pytest.raises(anthropic.UnprocessableEntityError) as nobody:
        claude.messages.create(model="m", max_tokens=50, tools=[tool],
                               messages=[{"role": "user", "content": [image]}])
    assert nobody.value.body["type"] == "error" and nobody.value.body["error"]["code"] == "no_eligible_provider"


# --- what the provider received, surface by surface ------------------------------------------------

# (path, body, the key header, extra client headers, the stream rewritten for usage?)
_SURFACE_CASES = [
    ("/v1/chat/completions", {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
     "authorization", (), True),
    ("/v1/completions", {"model": "m", "stream": True, "prompt": "hi", "max_tokens": 5}, "authorization", (), True),
    ("/v1/embeddings", {"model": "m", "input": "hi"}, "authorization", (), False),
    ("/v1/responses", {"model": "m", "stream": True, "input": "hi", "max_output_tokens": 5}, "authorization", (),
     False),
    ("/v1/messages", {"model": "m", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
     "x-api-key", (VERSION, ("anthropic-beta", "prompt-caching-2024-07-31")), False),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "x-api-key",
     (VERSION,), False),
]


def _last_received(provider) -> dict[str, Any]:
    status, _, body = request("127.0.0.1", provider.port, "GET", "/admin/received")
    assert status == 200
    return json.loads(body)["requests"][-1]


@pytest.mark.parametrize(("path", "body", "key_header", "extra", "rewritten"), _SURFACE_CASES,
                         ids=[case[0] for case in _SURFACE_CASES])
def test_what_the_provider_receives_on_each_surface(valkey_url, mock_provider, gateway_factory,
                                                    path, body, key_header, extra, rewritten):
    """Only chat and legacy completions streams are rewritten for usage (stream_options); every other
    body reaches the provider byte for byte; the gateway key never does (in either key header), and
    Anthropic's version and beta headers pass through."""
    provider = mock_provider(f"surface-{uuid.uuid4().hex[:6]}")
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    gateway = _gateway(gateway_factory, provider.address, tenant, {"quota": _quota(valkey_url, 100_000)})
    sent = json.dumps(body).encode()
    key = ("Authorization", f"Bearer {KEY}") if key_header == "authorization" else ("x-api-key", KEY)
    client = Client(gateway.port)
    try:
        response = client.request("POST", path, sent, [("Content-Type", "application/json"), key, *extra])
    finally:
        client.close()
    assert response.status == 200, response.body[:300]
    received = _last_received(provider)
    assert received["path"] == path
    headers = {name.lower(): value for name, value in received["headers"]}
    assert KEY not in json.dumps(received["headers"])  # the gateway's key is never forwarded
    for name, value in extra:
        assert headers[name.lower()] == value
    forwarded = json.loads(received["body"])
    if rewritten:
        assert forwarded["stream_options"] == {"include_usage": True}
        assert {k: v for k, v in forwarded.items() if k != "stream_options"} == body
    else:
        assert received["body"].encode() == sent  # byte for byte
