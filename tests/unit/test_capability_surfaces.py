"""The body fields the filters read on each API (gateway/request/capability.py, docs/api-surfaces.md): the
Responses API's ``max_output_tokens``, ``tools``, ``input_image`` parts and ``text.format``; Anthropic's
``max_tokens``, ``tools`` and image blocks. Requests decoded as the request path does (``facts``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.request import surfaces
from gateway.request.capability import CapabilityRequest, body_features, lookup_capability, request_features
from gateway.routing.eligibility import EMBEDDINGS, JSON_SCHEMA, TOOLS, VISION

JSON = b"application/json"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def decoded(body: dict[str, Any]) -> CapabilityRequest:
    result = lookup_capability(None, json.dumps(body).encode(), JSON, facts=True)
    assert isinstance(result, CapabilityRequest), result
    return result


def features(surface: surfaces.Surface, body: dict[str, Any]) -> int:
    fields = decoded(body).body
    by_row = body_features(fields, surface.body)
    assert request_features(fields, surface.path.encode() + b"?x=1") == by_row  # type: ignore[union-attr]
    return by_row


# --- Anthropic Messages -----------------------------------------------------------------------------


def message(content: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 1024, "messages": [{"role": "user", "content": content}],
            **extra}


def test_messages_max_tokens_is_the_completion_allowance() -> None:
    fields = decoded(message("Hello")).body
    assert fields is not None and fields.completion_allowance == 1024


def test_messages_image_block_needs_vision() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    assert features(surfaces.MESSAGES, message([image, {"type": "text", "text": "What is this?"}])) == VISION
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    assert features(surfaces.COUNT_TOKENS, message([url_image])) == VISION


def test_messages_image_inside_a_tool_result_needs_vision() -> None:
    history = {"model": "claude-sonnet-4-5", "max_tokens": 64, "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Radar for Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type" : "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]},
    ]}
    assert features(surfaces.MESSAGES, history) == TOOLS | VISION


def test_messages_text_that_says_image_is_not_an_image() -> None:
    assert features(surfaces.MESSAGES, message([{"type": "text", "text": "image"}])) == 0
    assert features(surfaces.MESSAGES, message('{"type": "image"}')) == 0  # a string content: all text


def test_messages_tools_need_tools() -> None:
    assert features(surfaces.MESSAGES, message("Weather?", tools=[WEATHER_TOOL])) == TOOLS
    assert features(surfaces.MESSAGES, message("Hi", tools=[])) == 0


# --- OpenAI Responses ---------------------------------------------------------------------------------


def test_responses_features() -> None:
    assert features(surfaces.RESPONSES, {"model": "gpt-5", "input": "Hi"}) == 0
    image = {"role": "user", "content": [{"type": "input_text", "text": "What is in this image?"},
                                         {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}
    assert features(surfaces.RESPONSES, {"model": "gpt-5", "input": [image]}) == VISION
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]
    assert features(surfaces.RESPONSES, {"model": "gpt-5", "input": "Weather?", "tools": tools}) == TOOLS
    schema = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}}
    assert features(surfaces.RESPONSES, {"model": "gpt-5", "input": "Hi", "text": schema}) == JSON_SCHEMA
    assert features(surfaces.RESPONSES, {"model": "gpt-5", "input": "Hi", "text": {"format": {"type": "text"}}}) == 0


def test_responses_max_output_tokens_is_the_completion_allowance() -> None:
    fields = decoded({"model": "gpt-5", "input": "Hi", "max_output_tokens": 4096}).body
    assert fields is not None and fields.completion_allowance == 4096


@pytest.mark.parametrize("surface", [surfaces.CHAT_COMPLETIONS, surfaces.OTHER])
def test_other_apis_do_not_read_text_or_anthropic_blocks(surface: surfaces.Surface) -> None:
    """A ``text`` member of another API (any type) is not a Responses output config, and chat pays
    nothing for Anthropic's image blocks."""
    body = {"model": "m", "text": "plain words", "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": PNG}}]}]}
    assert body_features(decoded(body).body, surface.body) == 0


def test_embeddings_need_embeddings() -> None:
    assert features(surfaces.EMBEDDINGS, {"model": "text-embedding-3-small", "input": "hi"}) == EMBEDDINGS
