"""The first content event of a stream per surface (gateway/request/first_token.py)."""

from __future__ import annotations

from gateway.request.first_token import first_token_pattern
from gateway.request.surfaces import MESSAGES_USAGE, NO_USAGE, OPENAI_USAGE, RESPONSES_USAGE


def found(kind: int, event: bytes) -> bool:
    pattern = first_token_pattern(kind)
    assert pattern is not None
    return pattern.search(event) is not None


def test_chat_openings_are_not_tokens_but_content_and_tool_calls_are():
    assert not found(OPENAI_USAGE, b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
    assert not found(OPENAI_USAGE, b'data: {"choices":[{"delta":{"content":null}}]}\n\n')
    assert found(OPENAI_USAGE, b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n')
    assert found(OPENAI_USAGE, b'data: {"choices":[{"delta": {"content": "x"}}]}\n\n')
    assert found(OPENAI_USAGE, b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    assert found(OPENAI_USAGE, b'data: {"choices":[{"text":"a","index":0}]}\n\n')  # completions
    assert not found(OPENAI_USAGE, b'data: {"choices":[{"text":"","finish_reason":"stop"}]}\n\n')


def test_responses_and_messages_deltas_are_tokens_their_openings_are_not():
    assert not found(RESPONSES_USAGE, b'event: response.created\ndata: {"type":"response.created"}\n\n')
    assert not found(RESPONSES_USAGE, b'event: response.content_part.added\ndata: {}\n\n')
    assert found(RESPONSES_USAGE, b'event: response.output_text.delta\ndata: {"delta":"a"}\n\n')
    assert found(RESPONSES_USAGE, b'data: {"type":"response.function_call_arguments.delta"}\n\n')
    assert not found(MESSAGES_USAGE, b'event: message_start\ndata: {}\n\nevent: content_block_start\ndata: {}\n\n')
    assert found(MESSAGES_USAGE, b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n')
    assert first_token_pattern(NO_USAGE) is None
