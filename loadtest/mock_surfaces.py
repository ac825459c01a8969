"""The mock provider's OpenAI Responses and Anthropic Messages APIs (loadtest/mock_provider.py).

Faithful where a gateway or an SDK can tell: the requests the real APIs refuse are refused with the
real error bodies (a member the API does not define, such as ``stream_options.include_usage``;
Anthropic without ``anthropic-version`` or a required field), and the answers have the real shapes
and event sequences, with usage where the real APIs put it:

- ``POST /v1/responses``: a ``response`` object; streamed, ``response.created``,
  ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
  ``response.output_text.delta`` per token, ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done`` and ``response.completed`` (``response.incomplete`` when
  ``max_output_tokens`` cut it) carrying ``usage``. No ``[DONE]``.
- ``POST /v1/messages``: a ``message``; streamed, ``message_start`` (input usage), ``content_block_start``,
  ``ping``, one ``content_block_delta`` per token, ``content_block_stop``, ``message_delta`` (final
  ``output_tokens``) and ``message_stop``.
- ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``.

Usage extras, per request: ``X-Mock-Cached-Tokens: N`` (prompt tokens read from a cache: Responses
``input_tokens_details.cached_tokens``, Anthropic ``cache_read_input_tokens``),
``X-Mock-Cache-Write-Tokens: N`` (Responses ``input_tokens_details.cache_write_tokens``, Anthropic
``cache_creation_input_tokens``) and
``X-Mock-Reasoning-Tokens: N`` (Responses ``output_tokens_details.reasoning_tokens``, added to the
output). Anthropic's ``input_tokens`` excludes the cache parts, as the real API's does.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec


class Request(Protocol):
    """What a shape reads of the mock provider's request (``loadtest.mock_provider.Request``)."""

    fields: dict[str, str]  # header name (lower case) -> value


class MockCounter(Protocol):
    def next_id(self) -> int: ...


class Completion(Protocol):
    """What a shape reads of the mock provider's completion (``loadtest.mock_provider.Completion``)."""

    req: Request
    state: MockCounter
    body: dict[str, Any]
    model: str
    prompt_tokens: int
    tokens: int
    truncated: bool
    prefix_cached: int | None  # the prompt cache's cached tokens (None: no --prefix-cache)

_encode = msgspec.json.Encoder().encode

# The members each API defines (the official SDKs' request parameters, across recent versions).
RESPONSES_MEMBERS = frozenset({
    "access_programs", "background", "background_options", "context_management", "conversation", "image",
    "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
    "moderation", "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier",
    "store", "stream", "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs",
    "top_p", "truncation", "user",
})
RESPONSES_STREAM_OPTIONS = frozenset({"include_obfuscation"})
MESSAGES_MEMBERS = frozenset({
    "cache_control", "container", "context_management", "diagnostics", "inference_geo", "max_tokens",
    "mcp_servers", "messages", "metadata", "model", "output_config", "output_format", "service_tier", "speed",
    "stop_sequences", "stream", "system", "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p",
    "user_profile_id", "workspace_id",
})
COUNT_TOKENS_MEMBERS = frozenset({
    "cache_control", "context_management", "mcp_servers", "messages", "model", "output_config", "output_format",
    "speed", "system", "thinking", "tool_choice", "tools", "user_profile_id", "workspace_id",
})

_ANTHROPIC_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                             403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                             429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
                             529: "overloaded_error"}


class SurfaceError(Exception):
    """A request the API refuses: the status and the provider's own error body."""

    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        super().__init__(str(payload))
        self.status = status
        self.payload = payload


def sse_event(name: str, payload: Any) -> bytes:
    """One named SSE event as one HTTP chunk."""
    event = b"event: " + name.encode() + b"\ndata: " + _encode(payload) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def header_count(fields: dict[str, str], name: str) -> int:
    """A count from a request header (0 when absent); ValueError when it is not an integer."""
    raw = fields.get(name)
    if raw is None:
        return 0
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"{name} must be an integer") from None


def text_tokens(value: Any) -> int:
    """A rough token count of the text in a value: four characters per token."""
    if isinstance(value, str):
        return len(value) // 4 + 1
    if isinstance(value, list):
        return sum(text_tokens(item) for item in value)
    if isinstance(value, dict):
        return sum(text_tokens(item) for key, item in value.items() if key in ("content", "text"))
    return 0


# --------------------------------------------------------------------------------------------------
# OpenAI Responses


def openai_error(status: int, message: str, err_type: str, code: str | None, param: str | None = None) -> SurfaceError:
    return SurfaceError(status, {"error": {"message": message, "type": err_type, "param": param, "code": code}})


class ResponsesShape:
    """One ``/v1/responses`` request's answer."""

    streams = True

    def __init__(self, completion: Completion) -> None:
        self.c = completion
        self.sequence = 0
        counter = completion.state.next_id()
        self.response_id = f"resp_mock{counter:040d}"
        self.item_id = f"msg_mock{counter:040d}"
        self.created = int(time.time())
        fields = completion.req.fields
        cached = completion.prefix_cached  # the prompt cache's (--prefix-cache), else the header's
        if cached is None:
            cached = header_count(fields, "x-mock-cached-tokens")
        self.cached = min(cached, completion.prompt_tokens)
        self.written = min(header_count(fields, "x-mock-cache-write-tokens"), completion.prompt_tokens - self.cached)
        self.reasoning = header_count(fields, "x-mock-reasoning-tokens")

    @staticmethod
    def check(req: Request, body: dict[str, Any]) -> None:
        for name in body:
            if name not in RESPONSES_MEMBERS:
                raise openai_error(400, f"Unknown parameter: '{name}'.", "invalid_request_error", "unknown_parameter",
                                   name)
        options = body.get("stream_options")
        if isinstance(options, dict):
            for name in options:
                if name not in RESPONSES_STREAM_OPTIONS:
                    param = f"stream_options.{name}"
                    raise openai_error(400, f"Unknown parameter: '{param}'.", "invalid_request_error",
                                       "unknown_parameter", param)
        if "model" not in body:
            raise openai_error(400, "Missing required parameter: 'model'.", "invalid_request_error",
                               "missing_required_parameter", "model")

    @staticmethod
    def prompt_tokens(body: dict[str, Any]) -> int:
        return max(1, text_tokens(body.get("input", "")) + text_tokens(body.get("instructions") or ""))

    @staticmethod
    def output_limit(body: dict[str, Any]) -> Any:
        return body.get("max_output_tokens")

    @staticmethod
    def error_payload(status: int, message: str, err_type: str, code: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": err_type, "param": None, "code": code}}

    # -- the answer --------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        c = self.c
        output = c.tokens + self.reasoning
        details = {"cache_write_tokens": self.written, "cached_tokens": self.cached}
        return {"input_tokens": c.prompt_tokens, "input_tokens_details": details,
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": self.reasoning},
                "total_tokens": c.prompt_tokens + output}

    def response(self, status: str, output: list[Any], usage: dict[str, Any] | None) -> dict[str, Any]:
        body = self.c.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": None, "model": self.c.model, "output": output, "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"), "prompt_cache_key": None,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": None, "service_tier": "default",
            "store": body.get("store", True), "temperature": body.get("temperature", 1.0),
            "text": body.get("text", {"format": {"type": "text"}, "verbosity": "medium"}),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []), "top_logprobs": 0,
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage, "user": None,
            "metadata": body.get("metadata", {}),
        }

    def _status(self) -> str:
        return "incomplete" if self.c.truncated else "completed"

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    def _item(self, status: str, content: list[Any]) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "content": content, "role": "assistant"}

    def json_payload(self, text: str) -> dict[str, Any]:
        status = self._status()
        return self.response(status, [self._item(status, [self._part(text)])], self.usage())

    def _event(self, name: str, payload: dict[str, Any]) -> bytes:
        event = {"type": name, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return sse_event(name, event)

    def stream_opening(self) -> bytes:
        started = self.response("in_progress", [], None)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join((
            self._event("response.created", {"response": started}),
            self._event("response.in_progress", {"response": started}),
            self._event("response.output_item.added", {"output_index": 0, "item": self._item("in_progress", [])}),
            self._event("response.content_part.added", {**where, "part": self._part("")}),
        ))

    def stream_token(self, piece: str) -> bytes:
        return self._event("response.output_text.delta", {"item_id": self.item_id, "output_index": 0,
                                                          "content_index": 0, "delta": piece, "logprobs": []})

    def stream_error(self) -> bytes:
        """The event that ends a stream the provider failed mid-way (x-mock-stream-error)."""
        return self._event("error", {"code": "server_error", "param": None,
                                     "message": "The server had an error while processing your request."})

    def stream_closing(self, text: str) -> bytes:
        status = self._status()
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = self._item(status, [self._part(text)])
        final = self.response(status, [item], self.usage())
        return b"".join((
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**where, "part": self._part(text)}),
            self._event("response.output_item.done", {"output_index": 0, "item": item}),
            self._event(f"response.{status}", {"response": final}),
        ))


# --------------------------------------------------------------------------------------------------
# Anthropic Messages


def anthropic_payload(err_type: str, message: str, request_id: str = "req_mock") -> dict[str, Any]:
    return {"type": "error", "error": {"type": err_type, "message": message}, "request_id": request_id}


def anthropic_error(status: int, message: str) -> SurfaceError:
    return SurfaceError(status, anthropic_payload(anthropic_type(status), message))


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")


class MessagesShape:
    """One ``/v1/messages`` request's answer."""

    streams = True
    members = MESSAGES_MEMBERS
    required = ("model", "messages", "max_tokens")

    def __init__(self, completion: Completion) -> None:
        self.c = completion
        self.message_id = f"msg_mock{completion.state.next_id():020d}"
        prompt, fields = completion.prompt_tokens, completion.req.fields
        cached = completion.prefix_cached  # the prompt cache's (--prefix-cache), else the header's
        self.read = min(header_count(fields, "x-mock-cached-tokens") if cached is None else cached, prompt)
        self.written = min(header_count(fields, "x-mock-cache-write-tokens"), prompt - self.read)

    @classmethod
    def check(cls, req: Request, body: dict[str, Any]) -> None:
        if not req.fields.get("anthropic-version"):
            raise anthropic_error(400, "anthropic-version: header is required")
        for name in body:
            if name not in cls.members:
                raise anthropic_error(400, f"{name}: Extra inputs are not permitted")
        for name in cls.required:
            if name not in body:
                raise anthropic_error(400, f"{name}: Field required")
        if not isinstance(body["messages"], list):
            raise anthropic_error(400, "messages: Input should be a valid list")

    @staticmethod
    def prompt_tokens(body: dict[str, Any]) -> int:
        return max(1, text_tokens(body.get("messages", [])) + text_tokens(body.get("system") or ""))

    @staticmethod
    def output_limit(body: dict[str, Any]) -> Any:
        return body.get("max_tokens")

    @staticmethod
    def error_payload(status: int, message: str, err_type: str, code: str) -> dict[str, Any]:
        return anthropic_payload(anthropic_type(status), message)

    # -- the answer --------------------------------------------------------------------------------

    def input_usage(self) -> dict[str, int]:
        """The prompt as Anthropic splits it: ``input_tokens`` excludes the cache's reads and writes."""
        return {"input_tokens": self.c.prompt_tokens - self.read - self.written,
                "cache_creation_input_tokens": self.written, "cache_read_input_tokens": self.read}

    def _stop_reason(self) -> str:
        return "max_tokens" if self.c.truncated else "end_turn"

    def json_payload(self, text: str) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.c.model,
                "content": [{"type": "text", "text": text}], "stop_reason": self._stop_reason(),
                "stop_sequence": None,
                "usage": {**self.input_usage(), "output_tokens": self.c.tokens, "service_tier": "standard"}}

    def stream_opening(self) -> bytes:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.c.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**self.input_usage(), "output_tokens": 1, "service_tier": "standard"}}
        return b"".join((
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}}),
            sse_event("ping", {"type": "ping"}),
        ))

    @staticmethod
    def stream_token(piece: str) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": piece}})

    @staticmethod
    def stream_error() -> bytes:
        """The event that ends a stream the provider failed mid-way (x-mock-stream-error)."""
        return sse_event("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})

    def stream_closing(self, text: str) -> bytes:
        return b"".join((
            sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse_event("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": self._stop_reason(), "stop_sequence": None},
                                        "usage": {"output_tokens": self.c.tokens}}),
            sse_event("message_stop", {"type": "message_stop"}),
        ))


class CountTokensShape(MessagesShape):
    """``/v1/messages/count_tokens``: the prompt's size, never streamed."""

    streams = False
    members = COUNT_TOKENS_MEMBERS
    required = ("model", "messages")

    def json_payload(self, text: str) -> dict[str, Any]:
        return {"input_tokens": self.c.prompt_tokens}


SHAPES: dict[str, type[ResponsesShape] | type[MessagesShape]] = {
    "responses": ResponsesShape, "messages": MessagesShape, "count_tokens": CountTokensShape,
}
ANTHROPIC_ENDPOINTS = ("messages", "count_tokens")
