"""What a proxied request sends upstream (workers/proxy.py ``Proxy.forward``): its body, rewritten to ask
for a usage report when the quota meters a stream that did not, and the headers every provider attempt
sends."""

from __future__ import annotations

from gateway.quota.gate import Admission
from gateway.request.capability import CapabilityRequest
from gateway.request.headers import ACCEPT_ENCODING, IDENTITY_ENCODING, RequestHeaders
from gateway.request.usage import rewrite_request_for_usage
from workers.exchange import Exchange

BODYLESS_METHODS = (b"GET", b"HEAD", b"DELETE", b"OPTIONS")


def upstream_body(request: CapabilityRequest, body: bytes, admission: Admission | None,
                  rewrites_stream: bool = True) -> tuple[bytes, bool | None]:
    """The body to send and the metering mode (None: not metered; True: rewritten to ask for usage).

    A metered stream whose client did not ask for a usage chunk is rewritten to ask for one, on the
    APIs that define that member (``route.surface.rewrites_stream``: the Responses and Messages APIs
    refuse it, and report usage in every stream anyway); the relay's usage filter then removes that
    chunk so the client sees exactly what it asked for.
    """
    if admission is None or not admission.metered:
        return body, None
    fields = request.body
    if rewrites_stream and fields is not None and fields.stream and not fields.include_usage:
        rewritten = rewrite_request_for_usage(body)
        if rewritten is not None:
            return rewritten, True
    return body, False


def forwarded_headers(exchange: Exchange, headers: RequestHeaders, request_id: bytes,
                      body: bytes, metering: bool | None = None) -> list[tuple[bytes, bytes]]:
    """The headers every provider attempt sends (each provider's own are added per attempt). The
    client's ``Accept-Encoding`` goes last; a metered request (``metering`` not None: ``upstream_body``'s)
    asks for ``identity`` instead, since the gateway reads the usage in the answer
    (``gateway.request.headers.ask_identity_encoding``, written out here: decided once per request)."""
    forward = headers.forward
    peer = exchange.peer
    xff = headers.xff
    forward.append((b"x-forwarded-for", xff + b", " + peer if xff else peer))
    forward.append((b"x-request-id", request_id))
    if body:
        forward.append((b"content-length", b"%d" % len(body)))
    elif exchange.method not in BODYLESS_METHODS:
        forward.append((b"content-length", b"0"))
    if metering is not None:
        forward.append(IDENTITY_ENCODING)
    elif headers.accept_encoding is not None:
        forward.append((ACCEPT_ENCODING, headers.accept_encoding))
    return forward
