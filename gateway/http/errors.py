"""The one builder of gateway-made errors: OpenAI-style JSON bodies (CONTRACT §3), for the data plane,
the admin listener and the SSE error event that ends a stream the gateway cannot finish.

``ErrorReply`` is a value: request steps *return* it instead of raising, and the proxy answers with
it. ``GatewayError`` carries one through code that cannot return it (the parser's strict checks,
deep inside a byte loop).
"""

from __future__ import annotations

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

    def body(self) -> bytes:
        return error_body(self.status, self.code, self.message, self.error_type)

    def __repr__(self) -> str:
        return f"ErrorReply({self.status}, {self.code!r}, {self.message!r})"


class GatewayError(Exception):
    """Raised where an ``ErrorReply`` cannot be returned (strict parsing checks)."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def error_type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "api_error")


def error_payload(status: int, code: str, message: str, error_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type or error_type_for(status), "code": code}}


def error_body(status: int, code: str, message: str, error_type: str | None = None) -> bytes:
    return _encode(error_payload(status, code, message, error_type))


def error_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """Content-Type and Content-Length of a complete error body (for raw, codec-less answers)."""
    return [JSON_CONTENT_TYPE, (b"content-length", b"%d" % len(body))]


def sse_error_event(code: str, message: str, error_type: str = "upstream_error") -> bytes:
    """The last event of a stream the gateway has to end early: clients see why, never a bare cut."""
    return b"data: " + _encode({"error": {"message": message, "type": error_type, "code": code}}) + b"\n\n"
