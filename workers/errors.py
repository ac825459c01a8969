"""The one builder of gateway-made errors: OpenAI-style JSON bodies (CONTRACT §3)."""

from __future__ import annotations

import msgspec

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    501: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
    505: "invalid_request_error",
}

_encode = msgspec.json.Encoder().encode


class GatewayError(Exception):
    """Raised anywhere on the request path to answer the client with ``status`` and a JSON error."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: list[tuple[bytes, bytes]] | None = None,
        close: bool = False,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or []
        # True when framing is in doubt: the connection must not be reused.
        self.close = close
        self.error_type = error_type


def error_body(status: int, code: str, message: str, error_type: str | None = None) -> bytes:
    kind = error_type or _TYPE_BY_STATUS.get(status, "api_error")
    return _encode({"error": {"message": message, "type": kind, "code": code}})


def error_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
