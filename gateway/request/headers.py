"""One pass over a client's request headers: what the gateway consumes, what it forwards.

A ``HeaderPlan`` is built once per worker from the config (which names matter and why); ``scan``
runs once per request and returns ``RequestHeaders``. Hop-by-hop headers, the client's credentials,
framing headers, client-supplied ``x-gridgate-*`` / ``x-ai-routing-*`` headers and any header named like
a cluster's ``upstream_auth.header`` (the provider would read it as a credential) are never forwarded;
names listed in ``Connection`` are dropped too (RFC 9110 §7.6.1).

``Accept-Encoding`` is kept aside: the proxy forwards the client's own as the last header of the list
(``forwarded_headers``) and a metered request replaces it with ``identity`` (``ask_identity_encoding``),
since the usage in a compressed body cannot be read.
"""

from __future__ import annotations

from collections.abc import Iterable

# What a header name means to the gateway.
(
    _FORWARD, _AUTHORIZATION, _API_KEY, _CONNECTION, _REQUEST_ID, _XFF, _COOKIE, _DROP, _MODEL, _SESSION,
    _CONTENT_TYPE, _BALANCE_KEY, _PIN, _ACCEPT_ENCODING,
) = range(14)

_ALWAYS: dict[bytes, int] = {
    b"authorization": _AUTHORIZATION,
    b"x-api-key": _API_KEY,
    b"connection": _CONNECTION,
    b"x-request-id": _REQUEST_ID,
    b"x-forwarded-for": _XFF,
    b"cookie": _COOKIE,
    b"content-type": _CONTENT_TYPE,
    b"accept-encoding": _ACCEPT_ENCODING,
    b"host": _DROP,
    b"content-length": _DROP,
    b"transfer-encoding": _DROP,
    b"keep-alive": _DROP,
    b"proxy-connection": _DROP,
    b"proxy-authorization": _DROP,
    b"te": _DROP,
    b"trailer": _DROP,
    b"upgrade": _DROP,
    b"expect": _DROP,
    b"x-ai-routing-candidate": _DROP,
    b"x-ai-routing-request-id": _DROP,
    b"x-ai-routing-revision": _DROP,
}
_MAX_REQUEST_ID = 128
# A header token (a capability name, a session key) longer than this is ignored (gateway/request/capability.py).
MAX_TOKEN_BYTES = 256
OWS = b" \t"  # optional whitespace around a header value (RFC 9110 section 5.6.3)
# Names the gateway reads from the client and never forwards anyway: a credential header may share them.
_CONSUMED = (_AUTHORIZATION, _API_KEY)

ACCEPT_ENCODING = b"accept-encoding"
IDENTITY_ENCODING = (ACCEPT_ENCODING, b"identity")


def ask_identity_encoding(forward: list[tuple[bytes, bytes]]) -> None:
    """Make a metered request ask for an uncompressed answer: the gateway reads the usage in it (a gzip
    body's usage is never found, and the request would be charged its estimate, whatever it used).
    The client's own ``Accept-Encoding``, when it sent one, is the list's last header (``forwarded_headers``
    in workers/proxy.py puts it there): replaced in place, no scan of the list."""
    if forward and forward[-1][0] == ACCEPT_ENCODING:
        forward[-1] = IDENTITY_ENCODING
    else:
        forward.append(IDENTITY_ENCODING)


def connection_tokens(value: bytes) -> set[bytes]:
    """The lowercase option names listed in a ``Connection`` header value."""
    return {token.strip().lower() for token in value.split(b",") if token.strip()}


# Visible ASCII (RFC 5234 VCHAR): translate(None, VISIBLE_ASCII) deletes these in C, so a value
# made of them alone comes back empty (a generator over the bytes cost 2.4 µs for a 100-byte id).
VISIBLE_ASCII = bytes(range(33, 127))


def valid_request_id(value: bytes) -> bool:
    return 0 < len(value) <= _MAX_REQUEST_ID and not value.translate(None, VISIBLE_ASCII)


class RequestHeaders:
    """The outcome of one scan. ``forward`` is the list to send upstream (the caller appends to it)."""

    __slots__ = (
        "forward", "authorization", "api_key", "request_id", "xff", "cookie", "content_type", "model",
        "session", "pin", "balance_keys", "accept_encoding",
    )

    def __init__(self) -> None:
        self.forward: list[tuple[bytes, bytes]] = []
        self.authorization: bytes | None = None
        self.api_key: bytes | None = None
        self.request_id: bytes | None = None
        self.xff: bytes | None = None
        self.cookie: bytes | None = None
        self.content_type: bytes | None = None
        self.model: bytes | None = None  # the configured capability header
        # The configured session-affinity header trimmed of OWS, when it is a valid session key (1..256
        # visible ASCII: ``gateway.request.capability.session_key``), else None (the cookie may name the session).
        self.session: bytes | None = None
        self.pin: bytes | None = None  # the configured pin header
        self.balance_keys: dict[bytes, bytes] | None = None  # consistent-hash headers of the clusters
        self.accept_encoding: bytes | None = None  # forwarded last (see ask_identity_encoding)


class HeaderPlan:
    """Which request header names the gateway reads, built once per worker."""

    __slots__ = ("_kinds",)

    def __init__(
        self,
        model_header: str,
        session_header: str | None = None,
        pin_header: str | None = None,
        balance_key_headers: Iterable[str] = (),
        credential_headers: Iterable[str] = (),
    ) -> None:
        """``credential_headers``: every cluster's ``upstream_auth.header``; a client header of that name
        is never forwarded (it would reach the provider beside, or ahead of, the gateway's own)."""
        kinds = dict(_ALWAYS)
        for name in balance_key_headers:
            kinds[name.lower().encode()] = _BALANCE_KEY
        if session_header:
            kinds[session_header.lower().encode()] = _SESSION
        if pin_header:
            kinds[pin_header.lower().encode()] = _PIN
        kinds[model_header.lower().encode()] = _MODEL
        for name in credential_headers:
            key = name.lower().encode()
            if kinds.get(key) not in _CONSUMED:  # a credential wins over any other use of the name
                kinds[key] = _DROP
        self._kinds = kinds

    def scan(self, headers: list[tuple[bytes, bytes]]) -> RequestHeaders:
        """Sort one request's headers (names are lowercase, as the codec delivers them)."""
        found = RequestHeaders()
        forward = found.forward
        kinds = self._kinds
        listed: set[bytes] | None = None
        for name, value in headers:
            kind = kinds.get(name)
            if kind is None:
                if name[:11] != b"x-gridgate-":
                    forward.append((name, value))
            # The most frequent kinds first (Host and Content-Length are in every request): each test on
            # the way costs a step per header.
            elif kind == _DROP:  # consumed or hop-by-hop
                pass
            elif kind == _CONTENT_TYPE:
                found.content_type = value
                forward.append((name, value))
            elif kind == _ACCEPT_ENCODING:  # sent by most SDKs (the openai one asks for gzip)
                accept = found.accept_encoding
                found.accept_encoding = value if accept is None else accept + b", " + value
            elif kind == _AUTHORIZATION:
                found.authorization = value
            elif kind == _SESSION:
                # The session key read here, where the header is met (``gateway.request.capability.session_key``'s
                # test of a header written out): the proxy makes no call for it. An invalid one is None.
                key = value.strip(OWS)
                found.session = key if key and len(key) <= MAX_TOKEN_BYTES and not key.translate(
                    None, VISIBLE_ASCII) else None
                forward.append((name, value))
            elif kind == _MODEL:
                found.model = value
                forward.append((name, value))
            elif kind == _API_KEY:
                found.api_key = value
            elif kind == _REQUEST_ID:  # the last one wins, if valid
                found.request_id = value if valid_request_id(value) else None
            elif kind == _XFF:
                found.xff = value if found.xff is None else found.xff + b", " + value
            elif kind == _COOKIE:
                found.cookie = value
                forward.append((name, value))
            elif kind == _CONNECTION:
                listed = connection_tokens(value) if listed is None else listed | connection_tokens(value)
            else:  # configured routing headers, rare: out of the common path
                _routing_header(found, kind, name, value)
        if listed:
            _drop_listed(found, listed)
        return found


def _routing_header(found: RequestHeaders, kind: int, name: bytes, value: bytes) -> None:
    """A cluster's consistent-hash header (forwarded) or the pin header (consumed)."""
    if kind == _BALANCE_KEY:
        if found.balance_keys is None:
            found.balance_keys = {}
        found.balance_keys[name] = value
        found.forward.append((name, value))
    elif kind == _PIN:
        found.pin = value


def _drop_listed(found: RequestHeaders, listed: set[bytes]) -> None:
    """Drop the names the client's ``Connection`` header listed (hop-by-hop: RFC 9110 section 7.6.1)."""
    found.forward = [(n, v) for n, v in found.forward if n not in listed]
    if ACCEPT_ENCODING in listed:
        found.accept_encoding = None
