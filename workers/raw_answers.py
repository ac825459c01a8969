"""The answers the client-facing server writes itself, without the codec's framing state: a request
whose framing is in doubt, one refused on its head (workers/head_gate.py, workers/cors_gate.py), a
connection over the worker's limit. Each is the connection's last answer (``Connection: close``).

An error has the shape of the API its request was sent to (Anthropic's under ``/v1/messages``:
docs/api-surfaces.md), and carries the CORS headers of an allowed origin (docs/cors.md), so a page can
read why it was refused. A 204 is an allowed CORS preflight: its headers are all it says.
"""

from __future__ import annotations

from gateway.http import codec
from gateway.http.errors import OPENAI_SHAPE, ErrorReply, error_headers
from gateway.request.cors import CorsPolicy
from gateway.request.surfaces import error_shape_of_target
from workers.cors_gate import request_origin

__all__ = ["CorsPolicy", "raw_answer"]

_CLOSE = (b"connection", b"close")


def raw_answer(reply: ErrorReply, target: bytes | None = None,
               request_headers: list[tuple[bytes, bytes]] | None = None, cors: CorsPolicy | None = None) -> bytes:
    """The whole answer to ``reply``. ``target`` (None: no head was read) and ``request_headers``: the
    request's; ``cors``: the policy, when CORS is on."""
    if reply.status == 204:
        return codec.raw_response(204, [*reply.headers, _CLOSE], b"")
    body = reply.body(OPENAI_SHAPE if target is None else error_shape_of_target(target))
    headers = [*error_headers(body), *reply.headers, _CLOSE]
    if cors is not None and target is not None and request_headers is not None:
        origin = request_origin(request_headers)
        if origin is not None:
            headers += cors.response_headers(origin)
    return codec.raw_response(reply.status, headers, body)
