"""The fixed list of conformance checks: what each sends, when it does not apply, how it judges.

Each check proves one promise and only that one, so a provider that breaks one promise fails one
check: the stream check ignores usage, the usage check ignores ``[DONE]``, the context-window check
reads the refusal's code and not its shape (the error-shape check does that). Every request asks for
at most ``max_tokens`` output tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.conformance.judging import (
    Problem,
    counts,
    error_shape,
    event_stream,
    excerpt,
    json_events,
    json_object,
    member,
    need,
    retry_after_problem,
    status_is,
)
from gateway.conformance.probe import Answer, Probe, Target, post
from gateway.conformance.sse import parse_stream

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
ANTHROPIC_VERSION = (("anthropic-version", "2023-06-01"),)
# A 429 cannot be asked of a real provider; the mock provider's hint header provokes one, and a provider
# that ignores it answers 200: that part of the error check is then skipped, not failed.
PROVOKE_429 = (("x-mock-status", "429"),)
HELLO = [{"role": "user", "content": "Say hello."}]
CHAT_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
LATENCY_SAMPLES = 3
_decode = msgspec.json.decode

Verdict = tuple[str, dict[str, Any]]  # the pass reason and details; a failure raises Problem


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    required: bool
    skip: Callable[[Target], str | None]
    probes: Callable[[Target, int], list[Probe]]
    judge: Callable[[Target, list[Answer]], Verdict]


def _served(surface: str) -> Callable[[Target], str | None]:
    return lambda t: None if surface in t.surfaces else f"the pool does not serve {surface} (--surface)"


def _claimed(feature: str) -> Callable[[Target], str | None]:
    def skip(target: Target) -> str | None:
        if "chat" not in target.surfaces:
            return "the pool does not serve chat"
        return None if feature in target.features else f"routing.models claims no {feature!r} for it"
    return skip


def _chat(target: Target, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": target.model, "messages": HELLO, "max_tokens": max_tokens, **extra}


# ---------------------------------------------------------------- tls


def _tls_skip(target: Target) -> str | None:
    return None if target.tls else "the cluster sets no tls: plain HTTP"


def _tls_probes(target: Target, max_tokens: int) -> list[Probe]:
    return [Probe("GET", "/v1/models")]


def _tls_judge(target: Target, answers: list[Answer]) -> Verdict:
    """The handshake the workers would make succeeded (a refused certificate fails in the runner, naming the
    server name or the CA); any HTTP answer after it will do: the other checks judge the HTTP."""
    version, server_name = answers[0].tls or ("TLS", target.sni or target.address)
    trust = ("verified against " + (f"tls.ca_file {target.ca_file}" if target.ca_file else "the system's CAs")
             if target.verify else "NOT verified (tls.verify: false)")
    return f"{version} with server name {server_name}, certificate {trust}", {
        "version": version, "server_name": server_name, "verified": target.verify}


# ---------------------------------------------------------------- models


def _models_probes(target: Target, max_tokens: int) -> list[Probe]:
    return [Probe("GET", "/v1/models")]


def _models_judge(target: Target, answers: list[Answer]) -> Verdict:
    data = member(json_object(answers[0]), "data", list, "body")
    ids = [item.get("id") for item in data if isinstance(item, dict)]
    need(target.model in ids, f"{target.model!r} is not listed (listed: {', '.join(map(str, ids[:8])) or 'none'})")
    return f"lists {target.model}", {}


# ---------------------------------------------------------------- chat, non-stream and stream


def _chat_probes(target: Target, max_tokens: int) -> list[Probe]:
    return [post(CHAT, _chat(target, max_tokens), 8 + max_tokens)]


def _chat_judge(target: Target, answers: list[Answer]) -> Verdict:
    body = json_object(answers[0])
    need(body.get("object") == "chat.completion", f"object is {body.get('object')!r}, not chat.completion")
    choices = member(body, "choices", list, "body")
    need(choices, "choices is empty")
    message = member(choices[0], "message", dict, "choices[0]")
    need(message.get("role") == "assistant", "choices[0].message.role is not assistant")
    member(message, "content", str, "choices[0].message")
    need(choices[0].get("finish_reason") in ("stop", "length"), "choices[0].finish_reason is not stop or length")
    usage = counts(body.get("usage"), CHAT_USAGE)
    need(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"],
         "usage.total_tokens is not prompt_tokens + completion_tokens")
    return f"schema and usage ok ({usage['total_tokens']} tokens)", {}


def _stream_probes(target: Target, max_tokens: int) -> list[Probe]:
    return [post(CHAT, _chat(target, max_tokens, stream=True), 8 + max_tokens)]


def _stream_judge(target: Target, answers: list[Answer]) -> Verdict:
    """Framing, chunk objects, content before the finish, ``[DONE]`` last; usage is another check's."""
    stream = event_stream(answers[0])
    need(stream.data[-1] == "[DONE]", "the stream does not end with data: [DONE]")
    need(stream.data.count("[DONE]") == 1, "data: [DONE] is sent more than once")
    chunks = json_events(stream)
    need(chunks, "no chunk before [DONE]")
    finished = False
    for index, chunk in enumerate(chunks):
        need(chunk.get("object") == "chat.completion.chunk", f"chunk {index}: object is not chat.completion.chunk")
        choices = member(chunk, "choices", list, f"chunk {index}")
        if finished:
            need(not choices, f"chunk {index}: a choice after the finish_reason")
        for choice in choices:
            member(choice, "delta", dict, f"chunk {index}.choices[0]")
            finished = finished or choice.get("finish_reason") is not None
    need(finished, "no chunk carries a finish_reason")
    return f"{len(chunks)} chunks, finish_reason, [DONE] last", {}


def _usage_probes(target: Target, max_tokens: int) -> list[Probe]:
    body = _chat(target, max_tokens, stream=True, stream_options={"include_usage": True})
    return [post(CHAT, body, 8 + max_tokens)]


def _usage_judge(target: Target, answers: list[Answer]) -> Verdict:
    """``stream_options.include_usage``: the last chunk carries usage and no choice."""
    chunks = json_events(event_stream(answers[0]))
    need(chunks, "no chunk in the stream")
    last = chunks[-1]
    need(isinstance(last.get("usage"), dict), "the last chunk carries no usage (stream_options.include_usage)")
    usage = counts(last["usage"], CHAT_USAGE, "last chunk usage")
    need(last.get("choices") == [], "the usage chunk has choices (it must have none)")
    return f"usage in the last chunk ({usage['total_tokens']} tokens)", {}


# ---------------------------------------------------------------- other surfaces


def _completions_probes(target: Target, max_tokens: int) -> list[Probe]:
    return [post(COMPLETIONS, {"model": target.model, "prompt": "Say hello.", "max_tokens": max_tokens},
                 8 + max_tokens)]


def _completions_judge(target: Target, answers: list[Answer]) -> Verdict:
    body = json_object(answers[0])
    need(body.get("object") == "text_completion", f"object is {body.get('object')!r}, not text_completion")
    choices = member(body, "choices", list, "body")
    need(choices, "choices is empty")
    member(choices[0], "text", str, "choices[0]")
    counts(body.get("usage"), CHAT_USAGE)
    return "schema and usage ok", {}


def _embeddings_probes(target: Target, max_tokens: int) -> list[Probe]:
    return [post(EMBEDDINGS, {"model": target.model, "input": "hello"}, 2)]


def _embeddings_judge(target: Target, answers: list[Answer]) -> Verdict:
    data = member(json_object(answers[0]), "data", list, "body")
    need(data, "data is empty")
    vector = member(data[0], "embedding", list, "data[0]")
    need(vector and all(isinstance(x, (int, float)) for x in vector), "data[0].embedding is not a vector of numbers")
    counts(_decode(answers[0].body).get("usage"), ("prompt_tokens",))
    return f"a {len(vector)}-dimension vector, usage ok", {}


def _responses_probes(target: Target, max_tokens: int) -> list[Probe]:
    body = {"model": target.model, "input": "Say hello.", "max_output_tokens": max(16, max_tokens)}
    return [post(RESPONSES, body, 24 + max_tokens), post(RESPONSES, {**body, "stream": True}, 24 + max_tokens)]


def _responses_judge(target: Target, answers: list[Answer]) -> Verdict:
    body = json_object(answers[0])
    need(body.get("object") == "response", f"object is {body.get('object')!r}, not response")
    member(body, "output", list, "body")
    counts(body.get("usage"), ("input_tokens", "output_tokens"))
    events = event_stream(answers[1]).events
    last = events[-1]
    need(last.name in ("response.completed", "response.incomplete"),
         f"the stream's last event is {last.name!r}, not response.completed")
    final = member(_decode(last.data), "response", dict, last.name)
    counts(final.get("usage"), ("input_tokens", "output_tokens"), f"{last.name} usage")
    return "response object and stream with usage ok", {}


def _messages_probes(target: Target, max_tokens: int) -> list[Probe]:
    body = {"model": target.model, "max_tokens": max_tokens, "messages": HELLO}
    return [post(MESSAGES, body, 8 + max_tokens, ANTHROPIC_VERSION),
            post(MESSAGES, {**body, "stream": True}, 8 + max_tokens, ANTHROPIC_VERSION)]


def _messages_judge(target: Target, answers: list[Answer]) -> Verdict:
    body = json_object(answers[0])
    need(body.get("type") == "message", f"type is {body.get('type')!r}, not message")
    member(body, "content", list, "body")
    counts(body.get("usage"), ("input_tokens", "output_tokens"))
    names = [event.name for event in event_stream(answers[1]).events]
    need(names[0] == "message_start" and names[-1] == "message_stop",
         f"the stream runs {names[0]!r} .. {names[-1]!r}, not message_start .. message_stop")
    need("message_delta" in names, "no message_delta event (the output usage)")
    return "message and stream events ok", {}


# ---------------------------------------------------------------- claimed features


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def _tools_probes(target: Target, max_tokens: int) -> list[Probe]:
    body = _chat(target, max_tokens, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                 tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    return [post(CHAT, body, 80 + max_tokens)]


def _tools_judge(target: Target, answers: list[Answer]) -> Verdict:
    body = json_object(answers[0])
    choice = member(body, "choices", list, "body")
    need(choice, "choices is empty")
    calls = member(member(choice[0], "message", dict, "choices[0]"), "tool_calls", list, "choices[0].message")
    need(calls, "choices[0].message.tool_calls is empty")
    function = member(calls[0], "function", dict, "tool_calls[0]")
    need(function.get("name") == "get_weather", f"the call names {function.get('name')!r}, not get_weather")
    try:
        need(isinstance(_decode(member(function, "arguments", str, "function")), dict), "arguments is no object")
    except msgspec.DecodeError:
        raise Problem("tool_calls[0].function.arguments is not JSON") from None
    return "the forced function was called with JSON arguments", {}


def _json_probes(target: Target, max_tokens: int) -> list[Probe]:
    messages = [{"role": "user", "content": 'Answer with the JSON object {"answer": "hi"}.'}]
    body = _chat(target, max_tokens, messages=messages, response_format={"type": "json_object"})
    return [post(CHAT, body, 16 + max_tokens)]


def _json_judge(target: Target, answers: list[Answer]) -> Verdict:
    choices = member(json_object(answers[0]), "choices", list, "body")
    need(choices, "choices is empty")
    content = member(member(choices[0], "message", dict, "choices[0]"), "content", str, "choices[0].message")
    try:
        need(isinstance(_decode(content), dict), "the content is JSON but not an object")
    except msgspec.DecodeError:
        raise Problem(f"the content is not JSON: {content[:60]!r}") from None
    return "the content is a JSON object", {}


# ---------------------------------------------------------------- context window


def context_prompt(tokens: int) -> str:
    """About ``tokens`` tokens for any BPE tokenizer (and the mock's four characters per token)."""
    return " the" * max(1, tokens)


def _context_probes(target: Target, max_tokens: int) -> list[Probe]:
    window = target.context_window
    inside = max(1, int(window * 0.9) - max_tokens - 16)
    outside = int(window * 1.1) + 16
    return [post(CHAT, _chat(target, max_tokens, messages=[{"role": "user", "content": context_prompt(n)}]),
                 n + max_tokens) for n in (inside, outside)]


def _context_judge(target: Target, answers: list[Answer]) -> Verdict:
    inside, outside = answers
    if inside.status != 200:
        raise Problem(f"a prompt inside the declared {target.context_window} tokens got HTTP {inside.status}: "
                      f"{excerpt(inside.body)}")
    need(outside.status != 200, f"a prompt beyond the declared {target.context_window} tokens was answered "
         "(truncated?), not refused")
    status_is(outside, 400)
    need(b"context_length_exceeded" in outside.body, f"the refusal names no context_length_exceeded: "
         f"{excerpt(outside.body)}")
    return f"inside answered, outside refused (window {target.context_window})", {}


def _context_skip(target: Target) -> str | None:
    if "chat" not in target.surfaces:
        return "the pool does not serve chat"
    return None if target.context_window else "routing.models declares no context_window for it"


# ---------------------------------------------------------------- error shapes


def _errors_probes(target: Target, max_tokens: int) -> list[Probe]:
    broken = Probe("POST", CHAT, b'{"model": "' + target.model.encode() + b'", "messages": [', estimated_tokens=0)
    probes = [broken, post(CHAT, _chat(target, max_tokens), 8 + max_tokens, PROVOKE_429)]
    if target.credential_header is not None:
        probes.append(post(CHAT, _chat(target, max_tokens), 0, credential="wrong"))
    return probes


def _errors_judge(target: Target, answers: list[Answer]) -> Verdict:
    """400 (a broken body), 429 with Retry-After (when provoked) and 401 (a wrong credential)."""
    parts = []
    try:
        error_shape(answers[0], 400)
    except Problem as exc:
        raise Problem(f"400: {exc}") from None
    parts.append("400 ok")
    if answers[1].status == 429:
        try:
            error_shape(answers[1], 429)
        except Problem as exc:
            raise Problem(f"429: {exc}") from None
        problem = retry_after_problem(answers[1].headers.get("retry-after"))
        need(problem is None, f"429: {problem}")
        parts.append(f"429 ok (Retry-After: {answers[1].headers['retry-after']})")
    else:
        parts.append(f"429 skipped (not provoked: HTTP {answers[1].status})")
    if len(answers) > 2:
        try:
            error_shape(answers[2], 401)
        except Problem as exc:
            raise Problem(f"401 with a wrong credential: {exc}") from None
        parts.append("401 ok")
    else:
        parts.append("401 skipped (no upstream_auth)")
    return "; ".join(parts), {}


# ---------------------------------------------------------------- latency


def _latency_probes(target: Target, max_tokens: int) -> list[Probe]:
    return _stream_probes(target, max_tokens) * LATENCY_SAMPLES


def first_token_s(answer: Answer) -> float | None:
    """When the first data event with content arrived (seconds since the request was sent)."""
    seen = b""
    for at, data in answer.chunks:
        seen += data
        for event in parse_stream(seen[:seen.rfind(b"\n\n") + 2]).events:
            if _has_content(event.data):
                return at
    return None


def _has_content(data: str) -> bool:
    try:
        choices = _decode(data).get("choices") or [{}]
    except (msgspec.DecodeError, AttributeError):
        return False
    delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
    return isinstance(delta, dict) and bool(delta.get("content"))


def _latency_judge(target: Target, answers: list[Answer]) -> Verdict:
    for answer in answers:
        status_is(answer, 200)
    first = [first_token_s(a) for a in answers]
    totals = sorted(a.total_s * 1000 for a in answers)
    firsts = sorted(f * 1000 for f in first if f is not None)
    details = {"first_token_ms": [round(f, 1) for f in firsts], "total_ms": [round(t, 1) for t in totals]}
    median = firsts[len(firsts) // 2] if firsts else None
    reason = f"first token {median:.1f} ms" if median is not None else "no content event seen"
    return f"{reason}, total {totals[len(totals) // 2]:.1f} ms (median of {len(answers)})", details


def _always(target: Target) -> str | None:
    return None


CHECKS: tuple[Check, ...] = (
    Check("tls", True, _tls_skip, _tls_probes, _tls_judge),
    Check("models", True, _always, _models_probes, _models_judge),
    Check("chat", True, _served("chat"), _chat_probes, _chat_judge),
    Check("chat_stream", True, _served("chat"), _stream_probes, _stream_judge),
    Check("stream_usage", True, _served("chat"), _usage_probes, _usage_judge),
    Check("completions", True, _served("completions"), _completions_probes, _completions_judge),
    Check("embeddings", True, _served("embeddings"), _embeddings_probes, _embeddings_judge),
    Check("responses", True, _served("responses"), _responses_probes, _responses_judge),
    Check("messages", True, _served("messages"), _messages_probes, _messages_judge),
    Check("tools", True, _claimed("tools"), _tools_probes, _tools_judge),
    Check("json_mode", True, _claimed("json_schema"), _json_probes, _json_judge),
    Check("context_window", True, _context_skip, _context_probes, _context_judge),
    Check("error_shapes", True, _served("chat"), _errors_probes, _errors_judge),
    Check("latency", False, _served("chat"), _latency_probes, _latency_judge),
)
CHECK_NAMES = tuple(check.name for check in CHECKS)
