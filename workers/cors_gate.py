"""Browser clients at the head gate (docs/cors.md): the ``cors`` block applied to each request head.

Built only when the configuration has a ``cors`` block (off: the server runs the head gate alone and
nothing here costs anything). ``CorsGate`` wraps the head gate (workers/head_gate.py):

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``, on any path) is
  answered here, *before* the key is checked: it carries no key (browsers never send credentials on a
  preflight), takes no quota and never reaches a provider. An allowed origin gets 204 with the policy's
  headers, another one 403 ``origin_not_allowed`` without any CORS header, a malformed one 400;
  each is a ``HeadRefusal``, which the server answers at once (workers/server.py);
- any other request goes to the head gate; an admitted one carries the CORS headers of its answer on
  ``Admitted.cors`` (empty when it sent no ``Origin`` or one the policy does not list), which the
  exchange adds to whatever answers it (workers/exchange.py); a refusal gets them from the server.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.http.errors import ErrorReply
from gateway.request.cors import CorsPolicy, PreflightReply
from workers.head_gate import Admitted, HeadRefusal, request_origin

__all__ = ["CorsGate", "request_origin"]

_OPTIONS = b"OPTIONS"
_REQUEST_METHOD = b"access-control-request-method"
_REQUEST_HEADERS = b"access-control-request-headers"
NO_CORS: tuple[tuple[bytes, bytes], ...] = ()


def _header(headers: list[tuple[bytes, bytes]], wanted: bytes) -> bytes | None:
    for name, value in headers:
        if name == wanted:
            return value
    return None


class CorsGate:
    """The head gate with the CORS policy in front (see the module docstring); one per worker."""

    __slots__ = ("policy", "gate", "next_id")

    def __init__(self, policy: CorsPolicy, gate: Callable[..., Admitted | HeadRefusal],
                 next_id: Callable[[], bytes]) -> None:
        self.policy = policy
        self.gate = gate
        self.next_id = next_id  # a request id for the preflights answered here

    def __call__(self, conn: object, method: bytes, target: bytes,
                 headers: list[tuple[bytes, bytes]]) -> Admitted | HeadRefusal:
        origin = request_origin(headers)
        if origin is not None and method == _OPTIONS:
            request_method = _header(headers, _REQUEST_METHOD)
            if request_method is not None:
                return self.preflight(origin, request_method, _header(headers, _REQUEST_HEADERS), target)
        verdict = self.gate(conn, method, target, headers)
        if type(verdict) is Admitted:
            verdict.cors = NO_CORS if origin is None else self.policy.response_headers(origin)
        return verdict

    def preflight(self, origin: bytes, request_method: bytes, request_headers: bytes | None,
                  target: bytes) -> HeadRefusal:
        """The answer to a preflight, as a head refusal (answered at once, never forwarded)."""
        request_id = self.next_id()
        answer = self.policy.preflight(origin, request_method, request_headers)
        if type(answer) is PreflightReply:
            return HeadRefusal(204, "cors_preflight", "", [*answer.headers, (b"x-request-id", request_id)],
                               request_id=request_id, method=_OPTIONS, target=target, tenant=None)
        assert isinstance(answer, ErrorReply)
        return HeadRefusal(answer.status, answer.code, answer.message,
                           [*answer.headers, (b"x-request-id", request_id)],
                           request_id=request_id, method=_OPTIONS, target=target, tenant=None)
