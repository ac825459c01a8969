"""The mock provider's conformance behaviour and its switchable non-conformance (loadtest/mock_provider.py).

Conformant by default, as a strict pool needs a provider to be: with ``--api-key`` it answers 401 to a
request without that key; with ``--context-window N`` a prompt plus its ``max_tokens`` beyond N tokens
is a 400 ``context_length_exceeded`` (never a truncation); a chat request whose ``tool_choice`` forces
a function gets a ``tool_calls`` answer; ``response_format`` json_object/json_schema gets JSON content.

``--nonconformance a,b`` (or ``POST /admin/config {"nonconformance": "a,b"}``) breaks one promise each,
so ``gridgate providers verify`` can show it catches each one with the check made for it and no other:

- ``short_context``: the real window is half of ``--context-window``;
- ``no_stream_usage``: streams ignore ``stream_options.include_usage``;
- ``wrong_error_shape``: error bodies are ``{"message", "code"}``, not ``{"error": {...}}``;
- ``no_tools``: a request with ``tools`` is refused (400);
- ``no_done``: chat and completion streams end without ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

FAULTS = ("short_context", "no_stream_usage", "wrong_error_shape", "no_tools", "no_done")


def parse_faults(text: str) -> frozenset[str]:
    """A comma-separated fault list; ValueError names an unknown one."""
    faults = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(faults - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown nonconformance {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    return faults


class Refusal(Exception):
    """A request this provider refuses: status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, err_type: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.payload: dict[str, Any] = {"error": {"message": message, "type": err_type, "param": param,
                                                  "code": code}}


def check_credential(fields: dict[str, str], api_key: str | None) -> None:
    """With an ``api_key`` set, ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` is required."""
    if not api_key:
        return
    bearer = fields.get("authorization", "")
    given = bearer[7:] if bearer.lower().startswith("bearer ") else fields.get("x-api-key", "")
    if given.removeprefix("Bearer ") != api_key:
        raise Refusal(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")


def effective_window(context_window: int, faults: frozenset[str]) -> int:
    """The window the mock enforces (0: none)."""
    return context_window // 2 if "short_context" in faults else context_window


def check_context(prompt_tokens: int, body: dict[str, Any], window: int) -> None:
    """OpenAI's refusal of a prompt that, with the output it asks for, does not fit the window."""
    if window <= 0:
        return
    limit = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens", 0)))
    wanted = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
    if prompt_tokens + wanted > window:
        raise Refusal(400, f"This model's maximum context length is {window} tokens. However, you requested "
                      f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the messages, {wanted} in the "
                      "completion).", "invalid_request_error", "context_length_exceeded", "messages")


def check_tools(body: dict[str, Any], faults: frozenset[str]) -> None:
    if "no_tools" in faults and body.get("tools"):
        raise Refusal(400, "tools are not supported by this model", "invalid_request_error",
                      "unsupported_parameter", "tools")


def forced_tool(body: dict[str, Any]) -> str | None:
    """The function a chat request's ``tool_choice`` forces ("required": the first tool), else None."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        return name if isinstance(name, str) else None
    if choice == "required":
        first = tools[0].get("function") if isinstance(tools[0], dict) else None
        name = first.get("name") if isinstance(first, dict) else None
        return name if isinstance(name, str) else None
    return None


def tool_call_message(name: str, call_id: int) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_mock_{call_id}", "type": "function", "function": {"name": name, "arguments": "{}"}}]}


def wants_json(body: dict[str, Any]) -> bool:
    response_format = body.get("response_format")
    return isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema")


def error_body(payload: dict[str, Any], faults: frozenset[str]) -> dict[str, Any]:
    """An error body as sent: the wrong shape under ``wrong_error_shape``."""
    error = payload.get("error")
    if "wrong_error_shape" not in faults or not isinstance(error, dict):
        return payload
    return {"message": error.get("message"), "code": error.get("code")}
