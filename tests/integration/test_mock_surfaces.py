"""The mock provider's Responses and Messages APIs, checked with the official ``openai`` and
``anthropic`` SDKs pointed at it directly (loadtest/mock_surfaces.py): the answers parse as the real
APIs' do, the refusals are the real ones, and the usage the gateway's parsers read from the raw bytes
(gateway/request/usage_surfaces.py) is the usage the SDKs report."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from gateway.request.usage_surfaces import MessagesUsage, ResponsesUsage
from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process

VERSION = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProviderHandle]:
    with start_mock_provider_process(0, "surfaces-mock", tokens=8) as handle:
        yield handle


@pytest.fixture(scope="module")
def oai(mock: MockProviderHandle) -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-test", base_url=mock.base_url + "/v1", max_retries=0)


@pytest.fixture(scope="module")
def claude(mock: MockProviderHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="sk-ant-test", base_url=mock.base_url, max_retries=0)


def raw_post(mock: MockProviderHandle, path: str, body: dict[str, Any],
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One POST on a fresh connection; the status and the body's bytes as they came (chunked decoded)."""
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {mock.address}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" not in head_bytes.lower():
        return status, rest
    body_bytes = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body_bytes, rest = body_bytes + rest[:size], rest[size + 2:]
    return status, body_bytes


# --- OpenAI Responses -----------------------------------------------------------------------------


def test_responses_create(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="gpt-5-mini", input="Say hello", max_output_tokens=100)
    assert response.status == "completed" and response.output_text == "Hello from surfaces-mock. lorem ipsum dolor sit"
    usage = response.usage
    assert usage is not None and (usage.output_tokens, usage.total_tokens) == (8, usage.input_tokens + 8)


def test_responses_stream_events_and_usage(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model="gpt-5-mini", input="Say hello", stream=True))
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 8,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.usage is None
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens == 8 and final.output_text.startswith("Hello")


def test_responses_stream_helper_accumulates(oai: openai.OpenAI) -> None:
    with oai.responses.stream(model="gpt-5-mini", input="Say hello") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.usage is not None


def test_responses_cut_by_max_output_tokens_is_incomplete(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model="gpt-5-mini", input="Hi", stream=True, max_output_tokens=3))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3


def test_responses_refuse_stream_options_include_usage(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        oai.responses.create(model="gpt-5-mini", input="Hi", stream=True,
                             extra_body={"stream_options": {"include_usage": True}})
    assert raised.value.body == {"message": "Unknown parameter: 'stream_options.include_usage'.",
                                 "type": "invalid_request_error", "param": "stream_options.include_usage",
                                 "code": "unknown_parameter"}
    with pytest.raises(openai.BadRequestError, match="Unknown parameter: 'messages'"):
        oai.responses.create(model="gpt-5-mini", input="Hi", extra_body={"messages": []})
    # The member it does define is accepted.
    oai.responses.create(model="gpt-5-mini", input="Hi", stream=True, stream_options={"include_obfuscation": False})


def test_responses_usage_details_on_request(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="gpt-5-mini", input="A long prompt " * 40, extra_headers={
        "x-mock-cached-tokens": "64", "x-mock-cache-write-tokens": "32", "x-mock-reasoning-tokens": "20"})
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens_details.cached_tokens, usage.input_tokens_details.cache_write_tokens) == (64, 32)
    assert (usage.output_tokens_details.reasoning_tokens, usage.output_tokens) == (20, 28)


# --- Anthropic Messages ---------------------------------------------------------------------------

MESSAGE = [{"role": "user", "content": "Say hello"}]


def test_messages_create(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model="claude-sonnet-4-5", max_tokens=100, messages=MESSAGE)
    assert message.content[0].text == "Hello from surfaces-mock. lorem ipsum dolor sit"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 8


def test_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=5, messages=MESSAGE) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello from surfaces-mock. lorem" and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5


def test_messages_raw_stream_events(claude: anthropic.Anthropic) -> None:
    events = list(claude.messages.create(model="claude-sonnet-4-5", max_tokens=100, messages=MESSAGE, stream=True))
    assert [event.type for event in events] == [
        "message_start", "content_block_start", *["content_block_delta"] * 8, "content_block_stop",
        "message_delta", "message_stop",
    ]  # the SDK drops ping
    assert events[0].message.usage.output_tokens == 1 and events[-2].usage.output_tokens == 8


def test_count_tokens(claude: anthropic.Anthropic) -> None:
    counted = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=MESSAGE)
    created = claude.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=MESSAGE)
    assert counted.input_tokens == created.usage.input_tokens > 0


def test_messages_cache_tokens_are_outside_input_tokens(claude: anthropic.Anthropic) -> None:
    long = [{"role": "user", "content": "A long prompt " * 40}]
    plain = claude.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=long)
    cached = claude.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=long, extra_headers={
        "x-mock-cached-tokens": "100", "x-mock-cache-write-tokens": "20"})
    usage = cached.usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (100, 20)
    assert usage.input_tokens + 100 + 20 == plain.usage.input_tokens


@pytest.mark.parametrize(("extra", "message"), [
    ({"extra_body": {"stream_options": {"include_usage": True}}, "stream": True},
     "stream_options: Extra inputs are not permitted"),
    ({"extra_headers": {"anthropic-version": ""}}, "anthropic-version: header is required"),
])
def test_messages_refusals_are_anthropic_s(claude: anthropic.Anthropic, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=MESSAGE, **extra)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"] == {"type": "invalid_request_error", "message": message}


def test_messages_missing_field_and_injected_overload(mock: MockProviderHandle,
                                                      claude: anthropic.Anthropic) -> None:
    status, body = raw_post(mock, "/v1/messages", {"model": "c", "messages": MESSAGE}, VERSION)
    assert status == 400 and json.loads(body)["error"] == {"type": "invalid_request_error",
                                                           "message": "max_tokens: Field required"}
    with pytest.raises(anthropic.InternalServerError) as raised:
        claude.messages.create(model="c", max_tokens=10, messages=MESSAGE, extra_headers={"x-mock-status": "529"})
    assert raised.value.status_code == 529 and raised.value.body["error"]["type"] == "overloaded_error"


# --- what the gateway's parsers read from the same bytes ------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_responses_bytes_parse_to_the_usage_the_sdk_reports(mock: MockProviderHandle, oai: openai.OpenAI,
                                                           stream: bool) -> None:
    headers = {"x-mock-cached-tokens": "3", "x-mock-reasoning-tokens": "5"}
    body = {"model": "gpt-5-mini", "input": "Tell me a story " * 10, "stream": stream}
    status, raw = raw_post(mock, "/v1/responses", body, headers)
    observer = ResponsesUsage(stream)
    observer.feed(raw)
    observer.flush()
    usage = oai.responses.create(model="gpt-5-mini", input="Tell me a story " * 10, extra_headers=headers).usage
    assert status == 200 and usage is not None
    assert (observer.prompt_tokens, observer.completion_tokens, observer.total_tokens, observer.cached_tokens,
            observer.reasoning_tokens) == (usage.input_tokens, usage.output_tokens, usage.total_tokens,
                                           3, 5)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_bytes_parse_to_the_usage_the_sdk_reports(mock: MockProviderHandle, claude: anthropic.Anthropic,
                                                          stream: bool) -> None:
    headers = {**VERSION, "x-mock-cached-tokens": "7", "x-mock-cache-write-tokens": "2"}
    body = {"model": "c", "max_tokens": 50, "messages": [{"role": "user", "content": "Tell me a story " * 10}],
            "stream": stream}
    status, raw = raw_post(mock, "/v1/messages", body, headers)
    observer = MessagesUsage(stream)
    observer.feed(raw)
    observer.flush()
    usage = claude.messages.create(model="c", max_tokens=50, messages=body["messages"],
                                   extra_headers={"x-mock-cached-tokens": "7", "x-mock-cache-write-tokens": "2"}).usage
    prompt = usage.input_tokens + 7 + 2
    assert status == 200
    assert (observer.prompt_tokens, observer.completion_tokens, observer.total_tokens, observer.cached_tokens,
            observer.cache_write_tokens) == (prompt, usage.output_tokens, prompt + usage.output_tokens, 7, 2)


def test_received_requests_are_listed(mock: MockProviderHandle, claude: anthropic.Anthropic) -> None:
    claude.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=MESSAGE,
                           extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    with socket.create_connection((mock.host, mock.port), timeout=5) as sock:
        sock.sendall(f"GET /admin/received HTTP/1.1\r\nHost: {mock.address}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    last = json.loads(data.partition(b"\r\n\r\n")[2])["requests"][-1]
    headers = {name.lower(): value for name, value in last["headers"]}
    assert last["path"] == "/v1/messages" and headers["anthropic-beta"] == "prompt-caching-2024-07-31"
    # The SDK's credential as it sent it (x-api-key or, in recent SDKs, a bearer token) and its version.
    assert "sk-ant-test" in (headers.get("x-api-key", ""), headers.get("authorization", "")[len("Bearer "):])
    assert headers["anthropic-version"]
    assert json.loads(last["body"])["messages"] == MESSAGE
