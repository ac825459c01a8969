"""The conformance checks' pure parts: SSE framing, judging crafted answers, token counting."""

from __future__ import annotations

import json

from gateway.conformance.checks import CHECKS, context_prompt, first_token_s
from gateway.conformance.judging import retry_after_problem
from gateway.conformance.probe import Answer, Probe, Target
from gateway.conformance.runner import answer_tokens
from gateway.conformance.sse import parse_stream

TARGET = Target("pool-a", "127.0.0.1:1", "m", context_window=100, features=frozenset({"tools"}))
BY_NAME = {check.name: check for check in CHECKS}


def sse(*events: str) -> bytes:
    return b"".join(f"data: {e}\n\n".encode() for e in events)


def chunk(delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True) -> str:
    body = {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []}
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body)


def stream_answer(body: bytes) -> Answer:
    return Answer(200, {"content-type": "text/event-stream"}, body, [(0.01, body)])


def judge(name: str, *answers: Answer) -> str:
    try:
        return "pass: " + BY_NAME[name].judge(TARGET, list(answers))[0]
    except Exception as exc:  # Problem: the reason
        return "fail: " + str(exc)


def test_sse_framing_problems_are_named() -> None:
    assert parse_stream(b"data: a\n\nevent: x\ndata: b\n\n").data == ["a", "b"]
    assert parse_stream(b"data: a\n\ndata: b").problems == [
        "the stream ended inside an event (no blank line after the last one)"]
    assert "not an SSE field" in parse_stream(b"garbage\n\n").problems[0]
    assert parse_stream(b": ping\r\n\r\ndata: x\r\n\r\n").data == ["x"]


def test_stream_needs_done_last_and_a_finish() -> None:
    good = sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "hi"}), chunk({}, "stop"), "[DONE]")
    assert judge("chat_stream", stream_answer(good)).startswith("pass")
    no_done = sse(chunk({"content": "hi"}), chunk({}, "stop"))
    assert judge("chat_stream", stream_answer(no_done)) == "fail: the stream does not end with data: [DONE]"
    no_finish = sse(chunk({"content": "hi"}), "[DONE]")
    assert judge("chat_stream", stream_answer(no_finish)) == "fail: no chunk carries a finish_reason"


def test_stream_usage_wants_a_last_usage_chunk_without_choices() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    good = sse(chunk({"content": "hi"}, usage=None), chunk({}, "stop"), chunk({}, usage=usage, choices=False))
    assert judge("stream_usage", stream_answer(good)) == "pass: usage in the last chunk (5 tokens)"
    assert judge("stream_usage", stream_answer(sse(chunk({}, "stop"), "[DONE]"))).startswith(
        "fail: the last chunk carries no usage")


def test_context_window_wants_a_refusal_not_a_truncation() -> None:
    ok = Answer(200, {}, b"{}")
    refused = Answer(400, {}, b'{"error": {"message": "too long", "code": "context_length_exceeded"}}')
    assert judge("context_window", ok, refused).startswith("pass")
    assert "was answered (truncated?)" in judge("context_window", ok, ok)
    assert "inside the declared 100 tokens got HTTP 400" in judge("context_window", refused, refused)
    assert context_prompt(3) == " the the the"


def test_error_shapes_and_retry_after() -> None:
    shaped = Answer(400, {}, b'{"error": {"message": "bad", "type": "invalid_request_error"}}')
    flat = Answer(400, {}, b'{"message": "bad"}')
    ok200 = Answer(200, {}, b"{}")
    assert judge("error_shapes", shaped, ok200) == "pass: 400 ok; 429 skipped (not provoked: HTTP 200); " \
        "401 skipped (no upstream_auth)"
    assert judge("error_shapes", flat, ok200).startswith("fail: 400: HTTP 400 body has no error object")
    limited = Answer(429, {}, b'{"error": {"message": "slow down", "type": "rate_limit"}}')
    assert judge("error_shapes", shaped, limited) == "fail: 429: no Retry-After header"
    assert retry_after_problem("7") is None
    assert retry_after_problem("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_problem("soon") is not None


def test_tokens_come_from_usage_else_the_estimate() -> None:
    probe = Probe("POST", "/v1/chat/completions", estimated_tokens=40)
    assert answer_tokens(probe, Answer(200, {}, b'{"usage": {"total_tokens": 7}}')) == 7
    assert answer_tokens(probe, Answer(200, {}, b'{"id": 1}')) == 40
    assert answer_tokens(probe, Answer(400, {}, b"{}")) == 0
    usage = chunk({}, usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, choices=False)
    assert answer_tokens(probe, stream_answer(sse(chunk({"content": "x"}), usage, "[DONE]"))) == 3


def test_first_token_is_the_first_event_with_content() -> None:
    answer = Answer(200, {}, b"", [(0.1, sse(chunk({"role": "assistant", "content": ""}))),
                                   (0.3, sse(chunk({"content": "hi"})))])
    assert first_token_s(answer) == 0.3


def test_skips_say_why() -> None:
    bare = Target("p", "h:1", "m")
    assert BY_NAME["tools"].skip(bare) == "routing.models claims no 'tools' for it"
    assert BY_NAME["context_window"].skip(bare) == "routing.models declares no context_window for it"
    assert BY_NAME["messages"].skip(bare) == "the pool does not serve messages (--surface)"
    assert BY_NAME["tools"].skip(TARGET) is None
