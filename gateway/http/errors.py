"""The one builder of gateway-made errors, for the data plane, the admin listener and the SSE error event
that ends a stream the gateway cannot finish.

Two shapes (docs/api-surfaces.md), since a client's SDK parses only its own API's errors:
``OPENAI_SHAPE`` (``{"error": {"message", "type", "code"}}``, every API but Anthropic's) and
``ANTHROPIC_SHAPE`` (``{"type": "error", "error": {"type", "message"}}`` plus our ``code``, for
``/v1/messages*``). The status is the same in both; the request's surface picks the shape
(gateway/request/surfaces.py).

``ErrorReply`` is a value: request steps *return* it instead of raising, and the proxy answers with
it. ``GatewayError`` carries one through code that cannot return it (the parser's strict checks,
deep inside a byte loop).
"""

from __future__ import annotations

from collections.abc import Awaitable

import msgspec

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    501: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
    505: "invalid_request_error",
}

# Anthropic's error types (docs.anthropic.com, "Errors"), by status.
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    501: "invalid_request_error",  # a transfer-coding or HTTP version the gateway does not take
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    505: "invalid_request_error",
    529: "overloaded_error",
}
ANTHROPIC_TYPES = frozenset(_ANTHROPIC_TYPE_BY_STATUS.values())
# An OpenAI-style type the gateway gives (e.g. in an SSE error event) -> Anthropic's nearest.
_ANTHROPIC_TYPE_BY_OPENAI_TYPE = {
    "upstream_error": "api_error",
    "service_unavailable": "overloaded_error",
    "timeout_error": "timeout_error",
    "rate_limit_error": "rate_limit_error",
}

OPENAI_SHAPE = 0
ANTHROPIC_SHAPE = 1

_encode = msgspec.json.Encoder().encode
JSON_CONTENT_TYPE = (b"content-type", b"application/json")


class ErrorReply:
    """A gateway-made error answer: status, OpenAI error ``code``/``message``/``type``, extra headers.

    ``close``: the request's framing is in doubt, so the connection must not be reused.
    """

    __slots__ = ("status", "code", "message", "headers", "error_type", "close")

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...] = (),
        *,
        error_type: str | None = None,
        close: bool = False,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.error_type = error_type
        self.close = close

    def body(self, shape: int = OPENAI_SHAPE) -> bytes:
        """The JSON body in the request's API's shape (``route.surface.errors``)."""
        if shape == OPENAI_SHAPE:
            return error_body(self.status, self.code, self.message, self.error_type)
        return anthropic_error_body(self.status, self.code, self.message, self.error_type)

    def __repr__(self) -> str:
        return f"ErrorReply({self.status}, {self.code!r}, {self.message!r})"


class GatewayError(Exception):
    """Raised where an ``ErrorReply`` cannot be returned (strict parsing checks)."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


class HeadWait(Exception):  # noqa: N818 - a verdict deferred, not an error
    """Raised by the head gate when its verdict on a head needs a wait (a token naming a kid its issuer's
    key set lacks: docs/identity.md): the server reads and parses nothing more of the connection until
    ``until`` is done, then calls the gate again, once, with ``head_waited`` set."""

    def __init__(self, until: Awaitable[None]) -> None:
        super().__init__("the head gate waits")
        self.until = until


def error_type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "api_error")


def error_payload(status: int, code: str, message: str, error_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type or error_type_for(status), "code": code}}


def error_body(status: int, code: str, message: str, error_type: str | None = None) -> bytes:
    return _encode(error_payload(status, code, message, error_type))


def anthropic_error_type(status: int | None, error_type: str | None = None) -> str:
    """The Anthropic error type for a status (or for an OpenAI-style type the gateway gave)."""
    if error_type is not None:
        if error_type in ANTHROPIC_TYPES:
            return error_type
        mapped = _ANTHROPIC_TYPE_BY_OPENAI_TYPE.get(error_type)
        if mapped is not None:
            return mapped
    if status is None:
        return "api_error"
    found = _ANTHROPIC_TYPE_BY_STATUS.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_payload(status: int, code: str, message: str, error_type: str | None = None) -> dict:
    """Anthropic's error shape. ``code`` (the gateway's reason, as in the OpenAI shape) rides along in
    the error object: Anthropic's SDKs read ``type`` and ``message`` and ignore it."""
    return {"type": "error", "error": {"type": anthropic_error_type(status, error_type), "message": message,
                                       "code": code}}


def anthropic_error_body(status: int, code: str, message: str, error_type: str | None = None) -> bytes:
    return _encode(anthropic_error_payload(status, code, message, error_type))


def error_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """Content-Type and Content-Length of a complete error body (for raw, codec-less answers)."""
    return [JSON_CONTENT_TYPE, (b"content-length", b"%d" % len(body))]


def sse_error_event(code: str, message: str, error_type: str = "upstream_error") -> bytes:
    """The last event of a stream the gateway has to end early: clients see why, never a bare cut."""
    return b"data: " + _encode({"error": {"message": message, "type": error_type, "code": code}}) + b"\n\n"


def sse_error_event_in(shape: int, code: str, message: str, error_type: str = "upstream_error") -> bytes:
    """``sse_error_event`` in the stream's API's shape. Anthropic's SDKs skip an event without an
    ``event:`` line, so a Messages stream ends with ``event: error`` and Anthropic's error object."""
    if shape == OPENAI_SHAPE:
        return sse_error_event(code, message, error_type)
    payload = {"type": "error", "error": {"type": anthropic_error_type(None, error_type), "message": message,
                                          "code": code}}
    return b"event: error\ndata: " + _encode(payload) + b"\n\n"
