"""Browser clients: the CORS policy (docs/cors.md). Pure.

A ``CorsPolicy`` is built once per worker from the ``cors`` block (off when the block is absent) and
answers three questions of the request path:

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``: workers/cors_gate.py
  tells them apart) is answered by the gateway before anything else, with no key, no quota, and never forwarded:
  ``policy.preflight(...)`` returns the 204 to send (``PreflightReply``) or a 403/400 ``ErrorReply``;
- every other answer to a request with an ``Origin`` (relayed or gateway-made, errors included, so a
  page can read why it was refused) gets ``policy.response_headers(origin)``: empty for an origin that
  is not allowed, else ``Access-Control-Allow-Origin``, ``Access-Control-Expose-Headers`` and
  ``Vary: Origin``. One dict lookup per request with an ``Origin`` once the origin was seen;
- a key's own ``allowed_origins`` narrows who may use it: ``key_origin_reply`` (403 ``origin_not_allowed``).

Credentials (cookies, TLS client certificates) are never allowed: a browser client sends its API key
itself, in a header. So ``*`` can only be the literal any-origin of the Fetch standard, and no answer
ever carries ``Access-Control-Allow-Credentials``. Listed origins are exact (``scheme://host[:port]``,
compared as browsers serialise them: lowercase, default port omitted) or ``regex:<pattern>`` (matched
against the whole origin).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from gateway.http.errors import ErrorReply

ANY_ORIGIN = "*"
REGEX_PREFIX = "regex:"
DEFAULT_EXPOSE = "default"

# The gateway's own response headers a page may read (docs/cors.md). CORS takes no prefix wildcard,
# so `x-ratelimit-*` and `x-gridgate-*` are spelt out.
GATEWAY_HEADERS = (
    "x-request-id", "retry-after",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    "x-gridgate-provider", "x-gridgate-stable-id", "x-gridgate-selection-group", "x-gridgate-selection-mode",
    "x-gridgate-overlay-revision", "x-gridgate-affinity", "x-gridgate-overhead-ms", "x-gridgate-attempts",
    "x-gridgate-filtered", "x-gridgate-model", "x-gridgate-fallback-hops",
)

_ORIGIN = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<host>\[[0-9a-f:.]+\]|[a-z0-9._~!$&'()+,;=-]+)"
                     r"(?::(?P<port>[0-9]{1,5}))?")
_DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token: a method or a field name
_MAX_ACCESS_LIST = 4096  # bytes of Access-Control-Request-Headers a preflight may name
_MAX_SEEN = 1024  # origins remembered with their headers; then forgotten all at once

_VARY_ORIGIN = (b"vary", b"Origin")
_PREFLIGHT_VARY = (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers")


def exact_origin(text: str) -> str:
    """An exact origin as browsers send it (lowercased); ValueError says what is wrong with it."""
    origin = text.strip().lower()
    if origin == "null":
        raise ValueError("'null' is the origin of sandboxed frames and local files, which any site can "
                         "produce: it cannot be allowed")
    if "*" in origin:
        raise ValueError(f"{text!r}: globs are not origins; write regex:<pattern> (e.g. "
                         r"'regex:https://[a-z0-9-]+\.example\.com') or '*' alone for any origin")
    match = _ORIGIN.fullmatch(origin)
    if match is None:
        raise ValueError(f"{text!r} is not an origin: scheme://host[:port], without a path or a trailing /")
    port = match.group("port")
    if port is not None:
        if not 0 < int(port) < 65536 or port[0] == "0":
            raise ValueError(f"{text!r}: port must be 1..65535")
        if _DEFAULT_PORTS.get(match.group("scheme")) == port:
            raise ValueError(f"{text!r}: browsers omit the default port; write it without :{port}")
    return origin


def origin_pattern(text: str) -> re.Pattern[bytes]:
    """A ``regex:<pattern>`` entry compiled (matched against the whole origin); ValueError if bad."""
    pattern = text[len(REGEX_PREFIX):]
    if not pattern:
        raise ValueError("regex: needs a pattern")
    try:
        return re.compile(pattern.encode("ascii"))
    except UnicodeEncodeError:
        raise ValueError(f"{text!r}: origins are ASCII; the pattern must be too") from None
    except re.error as exc:
        raise ValueError(f"{text!r}: bad regular expression: {exc}") from None


class OriginList:
    """Which origins a list admits: ``*`` (any), exact origins and ``regex:`` patterns."""

    __slots__ = ("any", "exact", "patterns")

    def __init__(self, entries: Iterable[str]) -> None:
        """ValueError names the entry (``[2]: ...``) that is wrong."""
        entries = list(entries)
        self.any = False
        exact: set[bytes] = set()
        patterns: list[re.Pattern[bytes]] = []
        for index, entry in enumerate(entries):
            try:
                if entry == ANY_ORIGIN:
                    if len(entries) > 1:
                        raise ValueError("'*' admits every origin: list it alone")
                    self.any = True
                elif entry.startswith(REGEX_PREFIX):
                    patterns.append(origin_pattern(entry))
                else:
                    exact.add(exact_origin(entry).encode("ascii"))
            except ValueError as exc:
                raise ValueError(f"[{index}]: {exc}") from None
        self.exact = frozenset(exact)
        self.patterns = tuple(patterns)

    def allows(self, origin: bytes) -> bool:
        if self.any or origin in self.exact:
            return True
        return any(pattern.fullmatch(origin) is not None for pattern in self.patterns)


def expose_list(setting: str | Sequence[str]) -> tuple[str, ...]:
    """The header names of ``expose_headers``: ``default`` (the gateway's headers), or a list of
    names where ``default`` stands for them, or ``*`` alone (every header). ValueError if bad."""
    entries = [setting] if isinstance(setting, str) else list(setting)
    names: list[str] = []
    for index, entry in enumerate(entries):
        where = "" if isinstance(setting, str) else f"[{index}]: "
        if entry == DEFAULT_EXPOSE:
            names.extend(GATEWAY_HEADERS)
        elif entry == "*":
            if len(entries) > 1:
                raise ValueError(f"{where}'*' exposes every header: list it alone")
            names.append("*")
        elif _TOKEN.fullmatch(entry.encode("latin-1", "replace")) is None:
            raise ValueError(f"{where}{entry!r} is not a header name")
        else:
            names.append(entry.lower())
    return tuple(dict.fromkeys(names))


class PreflightReply:
    """The gateway's answer to an allowed preflight: 204 and these headers, no body."""

    __slots__ = ("status", "headers")

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = 204
        self.headers = headers


class CorsPolicy:
    """The ``cors`` block, compiled (see the module docstring)."""

    __slots__ = ("origins", "max_age", "expose", "_seen", "_allow_any")

    def __init__(self, allowed_origins: Iterable[str], max_age: float = 600,
                 expose_headers: str | Sequence[str] = DEFAULT_EXPOSE) -> None:
        self.origins = OriginList(allowed_origins)
        self.max_age = b"%d" % int(max_age)
        self.expose = ", ".join(expose_list(expose_headers)).encode("ascii")
        self._allow_any = (b"access-control-allow-origin", b"*")
        self._seen: dict[bytes, tuple[tuple[bytes, bytes], ...]] = {}

    @classmethod
    def from_config(cls, block: object | None) -> CorsPolicy | None:
        """From the config's ``cors`` block (gateway.config.cors.Cors); None when CORS is off."""
        if block is None:
            return None
        return cls(block.allowed_origins, block.max_age, block.expose_headers)  # type: ignore[attr-defined]

    def allows(self, origin: bytes) -> bool:
        return self.origins.allows(origin)

    def response_headers(self, origin: bytes) -> tuple[tuple[bytes, bytes], ...]:
        """The CORS headers of an answer to a request from ``origin`` (empty: not an allowed origin)."""
        headers = self._seen.get(origin)
        if headers is None:
            headers = ()
            if self.origins.allows(origin):
                allow = self._allow_any if self.origins.any else (b"access-control-allow-origin", origin)
                headers = (allow, (b"access-control-expose-headers", self.expose), _VARY_ORIGIN)
            if len(self._seen) >= _MAX_SEEN:  # many distinct origins (a scan): start over, stay bounded
                self._seen.clear()
            self._seen[origin] = headers
        return headers

    def preflight(self, origin: bytes, request_method: bytes,
                  request_headers: bytes | None) -> PreflightReply | ErrorReply:
        """The answer to a preflight: 204 with what it may do, 403 ``origin_not_allowed`` for an origin
        not listed, 400 ``invalid_preflight`` for a malformed one. Every answer varies by origin and by
        what was asked, so each says so (``Vary``)."""
        vary = [_PREFLIGHT_VARY]
        if not self.origins.allows(origin):
            return ErrorReply(403, "origin_not_allowed",
                              f"Origin {origin.decode('latin-1')!r} may not call this gateway from a browser.", vary)
        if _TOKEN.fullmatch(request_method) is None:
            return ErrorReply(400, "invalid_preflight", "Access-Control-Request-Method is not a method.", vary)
        allow = self._allow_any if self.origins.any else (b"access-control-allow-origin", origin)
        headers = [allow, (b"access-control-allow-methods", request_method)]
        if request_headers is not None and request_headers.strip():
            names = _header_names(request_headers)
            if names is None:
                return ErrorReply(400, "invalid_preflight",
                                  "Access-Control-Request-Headers is not a list of header names.", vary)
            headers.append((b"access-control-allow-headers", names))
        headers.append((b"access-control-max-age", self.max_age))
        headers.append(_PREFLIGHT_VARY)
        return PreflightReply(headers)


def _header_names(value: bytes) -> bytes | None:
    """The requested header names, lowercased and comma-joined; None if any is not a field name."""
    if len(value) > _MAX_ACCESS_LIST:
        return None
    names = [name.strip(b" \t").lower() for name in value.split(b",")]
    names = [name for name in names if name]
    if not names or any(_TOKEN.fullmatch(name) is None for name in names):
        return None
    return b",".join(names)


def parse_key_origins(entries: Iterable[str]) -> OriginList:
    """A key's ``allowed_origins`` (exact origins and ``regex:`` patterns, as the admin API takes them;
    ``*`` is not a narrowing, so a key does not take it). ValueError names the entry."""
    entries = list(entries)
    for index, entry in enumerate(entries):
        if entry.strip() == ANY_ORIGIN:
            raise ValueError(f"[{index}]: '*' admits every origin: leave allowed_origins out instead")
    return OriginList(entries)


def key_origin_reply(origin: bytes | None, allowed: OriginList | None) -> ErrorReply | None:
    """None when the key may be used from ``origin``, else 403 ``origin_not_allowed``.

    A key without ``allowed_origins`` may be used from anywhere. A request without ``Origin`` did not
    come from a browser page (browsers always send it on cross-origin requests and on POST): it passes,
    since any other client can write any ``Origin`` it likes. The list keeps other sites' pages from
    using a key that a page exposed; it does not make a key secret.
    """
    if allowed is None or origin is None or allowed.allows(origin):
        return None
    return ErrorReply(403, "origin_not_allowed",
                      f"This API key may not be used from origin {origin.decode('latin-1')!r}.")
