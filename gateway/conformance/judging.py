"""Small helpers the checks judge answers with: each raises :class:`Problem` with the reason a person reads."""

from __future__ import annotations

import email.utils
from typing import Any

import msgspec

from gateway.conformance.probe import Answer
from gateway.conformance.sse import Stream, parse_stream

_decode = msgspec.json.decode


class Problem(Exception):
    """A failed expectation; the message is the check's reason."""


def need(condition: object, reason: str) -> None:
    if not condition:
        raise Problem(reason)


def excerpt(body: bytes, limit: int = 120) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def status_is(answer: Answer, status: int) -> None:
    need(answer.status == status, f"HTTP {answer.status} where {status} was due: {excerpt(answer.body)}")


def json_object(answer: Answer, status: int = 200) -> dict[str, Any]:
    status_is(answer, status)
    try:
        value = _decode(answer.body)
    except msgspec.DecodeError:
        raise Problem(f"the body is not JSON: {excerpt(answer.body)}") from None
    need(isinstance(value, dict), "the body is not a JSON object")
    return value


def member(value: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``value[key]``, which must be of ``kind`` (bool is never an int here)."""
    need(isinstance(value, dict), f"{where} is not an object")
    item = value.get(key)
    ok = isinstance(item, kind) and not (isinstance(item, bool) and kind in (int, (int, float)))
    need(ok, f"{where}.{key} is missing or not {_kind_name(kind)}")
    return item


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = [k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,))]
    return " or ".join({"str": "a string", "int": "an integer", "list": "an array", "dict": "an object",
                        "float": "a number"}.get(n, n) for n in names)


def counts(usage: Any, keys: tuple[str, ...], where: str = "usage") -> dict[str, int]:
    """Token counts that must be non-negative integers."""
    found = {key: member(usage, key, int, where) for key in keys}
    need(all(v >= 0 for v in found.values()), f"{where} has a negative count")
    return found


def event_stream(answer: Answer) -> Stream:
    status_is(answer, 200)
    kind = answer.headers.get("content-type", "")
    need(kind.startswith("text/event-stream"), f"content-type {kind!r} is not text/event-stream")
    stream = parse_stream(answer.body)
    need(not stream.problems, "SSE framing: " + "; ".join(stream.problems[:3]))
    need(stream.events, "the stream carried no event")
    return stream


def json_events(stream: Stream) -> list[dict[str, Any]]:
    """The JSON payload of every data event but ``[DONE]``."""
    payloads = []
    for index, data in enumerate(stream.data):
        if data == "[DONE]":
            continue
        try:
            value = _decode(data)
        except msgspec.DecodeError:
            raise Problem(f"event {index} is not JSON: {data[:60]!r}") from None
        need(isinstance(value, dict), f"event {index} is not a JSON object")
        payloads.append(value)
    return payloads


def error_shape(answer: Answer, status: int) -> str:
    """An OpenAI error body ``{"error": {"message": str, "type": str|null, ...}}``: its message."""
    body = json_object(answer, status)
    error = body.get("error")
    need(isinstance(error, dict), f"HTTP {status} body has no error object: {excerpt(answer.body)}")
    message = member(error, "message", str, "error")
    need(error.get("type") is None or isinstance(error.get("type"), str), "error.type is not a string")
    return message


def retry_after_problem(value: str | None) -> str | None:
    """None when ``value`` is a valid Retry-After (delta seconds or an HTTP date)."""
    if value is None:
        return "no Retry-After header"
    if value.strip().isdigit() or email.utils.parsedate_tz(value) is not None:
        return None
    return f"Retry-After {value!r} is neither seconds nor an HTTP date"


def usage_tokens(payload: Any) -> int | None:
    """Tokens an answer says it used, from any API's usage object."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        response = payload.get("response") or payload.get("message")
        usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get(k) for k in ("input_tokens", "output_tokens", "prompt_tokens", "completion_tokens")]
    found = [p for p in parts if isinstance(p, int)]
    return sum(found) if found else None
