"""The request head the codec hands on, and a strict parser of our own for the plainly valid one.

h11's parse of a request head (a regex per line, its header normalisation, a state machine) was a
sixth of a worker's time on every request. Almost every head a gateway sees is plainly valid, so
``parse_plain_head`` parses that common case with a few C-level scans (``translate``, ``count``,
``split``) and a short loop over the field lines, and returns None for anything else: the codec then
gives that head to h11 exactly as before (same errors, same words). So h11 still decides every odd or
bad head; this module only ever answers what h11 would answer.

Plainly valid (RFC 9112 §§2.2, 3, 5.1, 5.2), and only then parsed here:

- every byte of the head is HTAB, SP, visible ASCII or obs-text, besides CR and LF, and every line ends
  in CRLF (no bare CR, no bare LF);
- the request line is ``method SP target SP HTTP/1.1`` (or ``HTTP/1.0``): a token method, a target of
  visible ASCII only;
- every field line is ``name ":" value``: a token name (so no obs-fold line, which starts with SP /
  HTAB, and no space before the colon), the value stripped of OWS (SP / HTAB) at both ends, as h11 does;
- exactly one Host, at most one Content-Length of 1..18 digits, no Transfer-Encoding and no Expect
  (rare; h11 owns their checks and the 100-continue state).

The values are stricter than h11's (it lets control bytes through, which gateway/http/framing.py refuses
afterwards): a head with one goes to h11, and then to that refusal, as before. Pure: bytes in, a head out.
"""

from __future__ import annotations

# tchar (RFC 9110 §5.6.2): method and field names.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_VCHAR = bytes(range(0x21, 0x7F))
# Every byte a plainly valid head's lines may hold, CRLF apart (where each may stand is checked per part).
_LINE_BYTES = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))


def _to_nul_unless(allowed: bytes) -> bytes:
    """A ``translate`` table: every byte not in ``allowed`` becomes NUL (then one memchr finds any)."""
    return bytes(1 if byte in allowed else 0 for byte in range(256))


# translate + memchr is ~1 ns a byte, a third less than translate's deleting form and a fifth of sre's.
_LINE_BYTES_ONLY = _to_nul_unless(_LINE_BYTES)
_TOKEN_ONLY = _to_nul_unless(_TOKEN)
_VERSIONS = {b"HTTP/1.1": b"1.1", b"HTTP/1.0": b"1.0"}
_COMMON_METHODS = frozenset((b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH"))
_OWS = b" \t"
_NO_LINE_LIMIT = 1 << 62
_MAX_LENGTH_DIGITS = 18  # any body limit is far below; a longer value goes to h11 (which allows 20)


class RequestHead:
    """A parsed request head: ``method``, ``target``, ``http_version`` (b"1.1" / b"1.0"; h11 passes any
    digit.digit on), ``headers`` (a plain list of (lowercase name, value), in order); ``plain``: parsed
    here, so its values are known to hold no control byte (the strict checks need not look again)."""

    __slots__ = ("method", "target", "http_version", "headers", "plain")

    def __init__(self, method: bytes, target: bytes, http_version: bytes, headers: list[tuple[bytes, bytes]],
                 plain: bool = False) -> None:
        self.method = method
        self.target = target
        self.http_version = http_version
        self.headers = headers
        self.plain = plain

    def __repr__(self) -> str:
        return f"RequestHead({self.method!r}, {self.target!r}, {self.http_version!r}, {self.headers!r})"


def parse_plain_head(head: bytes, max_lines: int = _NO_LINE_LIMIT) -> RequestHead | None:
    """``head`` (a complete request head, up to and including its empty line) when it is plainly valid
    (see the module doc) and has at most ``max_lines`` lines (its empty line counted), else None: h11
    decides (the codec counts the lines of a head that comes back, and refuses too many)."""
    lines = head.split(b"\r\n")  # ends with the two empty pieces of the final CRLF CRLF
    if len(lines) > max_lines + 1:
        return None  # more lines than the codec admits: its count refuses them, before any Python loop over them
    # The head without its CRLFs holds no control byte, and no CR or LF either (a bare one: not every one
    # is part of a CRLF). One translate over the joined lines: two ``count`` passes (each a byte loop, 1 ns
    # a byte: 1.5 µs on a head with a 700-byte bearer) were a third of the parse.
    if b"\x00" in b"".join(lines).translate(_LINE_BYTES_ONLY):
        return None
    request_line = lines[0].split(b" ")
    if len(request_line) != 3:
        return None
    method, target, version = request_line
    http_version = _VERSIONS.get(version)
    if http_version is None or not target or target.translate(None, _VCHAR):
        return None
    if method not in _COMMON_METHODS and (not method or method.translate(None, _TOKEN)):
        return None
    headers = []
    names = []
    try:
        for line in lines[1:-2]:
            name, value = line.split(b":", 1)  # ValueError: a line without a colon
            name = name.lower()
            names.append(name)
            headers.append((name, value.strip(_OWS)))
    except ValueError:
        return None
    if b"" in names or b"\x00" in b"".join(names).translate(_TOKEN_ONLY):
        return None  # an empty name, an obs-fold line, a space before the colon...
    return _checked(RequestHead(method, target, http_version, headers, True), names)


def _checked(parsed: RequestHead, names: list[bytes]) -> RequestHead | None:
    """``parsed`` when its framing fields are the plain kind (see the module doc), else None."""
    if names.count(b"host") != 1 or b"transfer-encoding" in names or b"expect" in names:
        return None
    lengths = names.count(b"content-length")
    if lengths:
        value = parsed.headers[names.index(b"content-length")][1]
        if lengths > 1 or not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
            return None
    return parsed
