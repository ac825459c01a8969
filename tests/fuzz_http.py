"""HTTP/1.1 message builders and hypothesis strategies shared by the codec fuzzers.

The request side (valid requests of every framing kind, the mutations that make them malformed) is
used by tests/unit/test_server_fuzz.py; the generic pieces (chunked encoding with extensions, trailers
and zero-padded sizes, random splits of a byte stream, the hypothesis profiles) serve the response
side too.

Profiles: ``ci`` (the default: a short, derandomized run inside ``make test``) and ``long``
(``make fuzz``: GRIDGATE_FUZZ=long, many more examples, random seeds, failures kept in the local
example database). A failure found by a long run is pasted as an explicit ``@example`` next to the
test it broke, so every later short run replays it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "ci", max_examples=60, derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", max_examples=int(os.environ.get("GRIDGATE_FUZZ_EXAMPLES", "5000")), deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ_PROFILE = "long" if os.environ.get("GRIDGATE_FUZZ") == "long" else "ci"


def fuzz_settings(short_examples: int | None = None, **overrides) -> settings:
    """The active profile (see the module doc), with per-test overrides; ``short_examples`` replaces
    the example count of the short profile only (for a test whose examples cost more)."""
    if short_examples is not None and FUZZ_PROFILE == "ci":
        overrides["max_examples"] = short_examples
    return settings(settings.get_profile(FUZZ_PROFILE), **overrides)


# -- building blocks ----------------------------------------------------------------------------------

def encode_chunked(body: bytes, sizes: list[int] | None = None, extensions: list[bytes] | None = None,
                   trailers: list[tuple[bytes, bytes]] = (), zero_pad: int = 0) -> bytes:
    """``body`` as chunks of ``sizes`` (cycled; the whole body as one chunk when None), each size line
    carrying the next of ``extensions`` (cycled) and ``zero_pad`` leading zeros, then the last chunk
    (with the extension too) and ``trailers``."""
    sizes = [size for size in (sizes or [len(body) or 1]) if size > 0] or [1]
    extensions = extensions or [b""]
    out: list[bytes] = []
    pos = turn = 0
    while pos < len(body):
        size = min(sizes[turn % len(sizes)], len(body) - pos)
        out.append(b"0" * zero_pad + b"%x" % size + extensions[turn % len(extensions)] + b"\r\n")
        out.append(body[pos:pos + size] + b"\r\n")
        pos += size
        turn += 1
    out.append(b"0" * zero_pad + b"0" + extensions[turn % len(extensions)] + b"\r\n")
    out.extend(name + b": " + value + b"\r\n" for name, value in trailers)
    out.append(b"\r\n")
    return b"".join(out)


def pieces(wire: bytes, cuts: list[int]) -> list[bytes]:
    """``wire`` cut at the given offsets (any order, duplicates and out-of-range offsets ignored)."""
    points = sorted({cut for cut in cuts if 0 < cut < len(wire)})
    bounds = [0, *points, len(wire)]
    return [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def random_pieces(wire: bytes) -> st.SearchStrategy[list[bytes]]:
    """``wire`` delivered in random pieces: whole, a byte at a time, or cut at random offsets."""
    if len(wire) < 2:
        return st.just([wire])
    return st.one_of(
        st.just([wire]),
        st.just([wire[i:i + 1] for i in range(len(wire))]),
        st.lists(st.integers(1, len(wire) - 1), max_size=12).map(lambda cuts: pieces(wire, cuts)),
    )


# -- requests -----------------------------------------------------------------------------------------

FRAMINGS = ("length", "chunked", "chunked_ext", "chunked_trailers", "chunked_ext_trailers", "empty_chunked",
            "bodyless")


@dataclass(frozen=True)
class Sent:
    """One request as the reference model knows it: what a correct server must hand on, once."""

    method: bytes
    target: bytes
    body: bytes
    wire: bytes
    framing: str


def request(framing: str, target: bytes = b"/v1/chat/completions", body: bytes = b'{"model": "m"}', *,
            sizes: list[int] | None = None, extension: bytes = b";ext=1", trailers=((b"x-trailer", b"t"),),
            zero_pad: int = 0, headers: list[tuple[bytes, bytes]] = ()) -> Sent:
    """A valid request of one framing kind (see ``FRAMINGS``)."""
    head = [b"host: g", *(name + b": " + value for name, value in headers)]
    method = b"POST"
    if framing == "length":
        head.append(b"content-length: %d" % len(body))
        encoded = body
    elif framing == "bodyless":
        method, body, encoded = b"GET", b"", b""
    else:
        if framing == "empty_chunked":
            body = b""
        head.append(b"transfer-encoding: chunked")
        encoded = encode_chunked(
            body, sizes,
            [extension] if "ext" in framing else None,
            trailers if "trailers" in framing else (),
            zero_pad,
        )
    wire = b"%s %s HTTP/1.1\r\n" % (method, target) + b"\r\n".join(head) + b"\r\n\r\n" + encoded
    return Sent(method, target, body, wire, framing)


_TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=8).map(str.encode)
_QUOTED = st.text("abc xyz=;,\\\"", max_size=8).map(
    lambda text: b'"' + text.replace("\\", "\\\\").replace('"', '\\"').encode() + b'"')
_EXTENSION = st.lists(
    st.tuples(_TOKEN, st.none() | _TOKEN | _QUOTED), min_size=1, max_size=3,
).map(lambda items: b"".join(b";" + name + (b"" if value is None else b"=" + value) for name, value in items))
_TRAILERS = st.lists(st.tuples(_TOKEN.map(lambda name: b"x-" + name), _TOKEN), min_size=1, max_size=3)


@st.composite
def valid_requests(draw, index: int = 0) -> Sent:
    """Any valid request: every framing kind, with random bodies, chunk sizes, extensions, trailers and
    zero-padded sizes; the target carries ``index`` so that each request of a stream is recognisable."""
    framing = draw(st.sampled_from(FRAMINGS))
    body = draw(st.binary(min_size=1, max_size=300))
    return request(
        framing, b"/r/%d" % index, body,
        sizes=draw(st.lists(st.integers(1, 64), min_size=1, max_size=4)),
        extension=draw(_EXTENSION), trailers=draw(_TRAILERS), zero_pad=draw(st.integers(0, 6)),
        headers=draw(st.lists(st.tuples(_TOKEN.map(lambda name: b"x-" + name), _TOKEN), max_size=3)),
    )


@st.composite
def valid_streams(draw, max_requests: int = 5) -> list[Sent]:
    """1..max_requests valid requests, pipelined (the last may ask to close the connection)."""
    count = draw(st.integers(1, max_requests))
    return [draw(valid_requests(index)) for index in range(count)]


# Malformed requests: (name, wire, the statuses a strict server may answer). The server must answer
# exactly one of them, then close, whatever came before (answered) or after (never read).
def _chunked_head(version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return b"POST /bad HTTP/" + version + b"\r\nHost: g\r\n" + extra + b"Transfer-Encoding: chunked\r\n\r\n"


MALFORMED: list[tuple[str, bytes, frozenset[int]]] = [
    ("cl_and_te", _chunked_head(extra=b"Content-Length: 5\r\n") + b"5\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("te_and_cl", b"POST /bad HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
     b"0\r\n\r\n", frozenset({400})),
    ("te_on_http10", _chunked_head(b"1.0") + b"5\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("te_not_chunked", b"POST /bad HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", frozenset({501})),
    ("te_obfuscated", b"POST /bad HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: xchunked\r\n\r\n", frozenset({501})),
    ("two_te", b"POST /bad HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
     frozenset({501})),
    ("bad_size_not_hex", _chunked_head() + b"zz\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("bad_size_empty", _chunked_head() + b"\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("bad_size_negative", _chunked_head() + b"-5\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("bad_size_0x", _chunked_head() + b"0x5\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("bad_size_space_inside", _chunked_head() + b"5 5\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("size_shorter_than_data", _chunked_head() + b"3\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("bare_lf_size_line", _chunked_head() + b"5\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("bare_cr_after_data", _chunked_head() + b"5\r\nhello\r0\r\n\r\n", frozenset({400})),
    ("huge_chunk_size", _chunked_head() + b"ffffffffffffffffffff\r\nabc", frozenset({413})),
    ("huge_size_behind_zeros", _chunked_head() + b"0" * 60 + b"fffffffff\r\nabc", frozenset({413})),
    ("huge_content_length", b"POST /bad HTTP/1.1\r\nHost: g\r\nContent-Length: 99999999999999\r\n\r\nabc",
     frozenset({413})),
    ("bad_extension_no_name", _chunked_head() + b"5;=x\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("control_in_extension", _chunked_head() + b'5;a="\x01"\r\nhello\r\n0\r\n\r\n', frozenset({400})),
    ("long_extension", _chunked_head() + b"5;a=" + b"b" * 5000 + b"\r\nhello\r\n0\r\n\r\n", frozenset({400})),
    ("bad_trailer", _chunked_head() + b"0\r\nno colon\r\n\r\n", frozenset({400})),
    ("control_in_header", b"GET /bad HTTP/1.1\r\nHost: g\r\nX-A: a\x01b\r\n\r\n", frozenset({400})),
    ("nul_in_header", b"GET /bad HTTP/1.1\r\nHost: g\r\nX-A: a\x00b\r\n\r\n", frozenset({400})),
    ("del_in_header", b"GET /bad HTTP/1.1\r\nHost: g\r\nX-A: a\x7fb\r\n\r\n", frozenset({400})),
    ("conflicting_lengths", b"POST /bad HTTP/1.1\r\nHost: g\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
     frozenset({400})),
    ("bad_content_length", b"POST /bad HTTP/1.1\r\nHost: g\r\nContent-Length: 1x\r\n\r\na", frozenset({400})),
    ("space_before_colon", b"GET /bad HTTP/1.1\r\nHost : g\r\n\r\n", frozenset({400})),
    ("missing_host", b"GET /bad HTTP/1.1\r\nX: y\r\n\r\n", frozenset({400})),
    ("two_hosts", b"GET /bad HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", frozenset({400})),
    ("http2_line", b"GET /bad HTTP/2.0\r\nHost: g\r\n\r\n", frozenset({505})),
    ("garbage_line", b"HELLO\r\n\r\n", frozenset({400})),
    ("nul_in_request_line", b"GET /b\x00d HTTP/1.1\r\nHost: g\r\n\r\n", frozenset({400})),
    ("tls_hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", frozenset({400})),
    ("two_empty_lines_first", b"\r\n\r\nGET /bad HTTP/1.1\r\nHost: g\r\n\r\n", frozenset({400})),
    ("connect", b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n", frozenset({405})),
    ("too_many_headers", b"GET /bad HTTP/1.1\r\nHost: g\r\n" + b"a:b\r\n" * 400 + b"\r\n", frozenset({431})),
    ("header_block_too_large", b"GET /bad HTTP/1.1\r\nHost: g\r\nX: " + b"y" * 5000 + b"\r\n\r\n",
     frozenset({431})),
    ("url_too_long", b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: g\r\n\r\n", frozenset({414})),
]
MALFORMED_NAMES = [name for name, _, _ in MALFORMED]

# Up to four byte mutations of a stream ("flip", "insert", "delete" at a position, with a byte): ``mutated``.
MUTATIONS = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, 1 << 16),
                               st.integers(0, 255)), min_size=1, max_size=4)


def mutated(wire: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    """``wire`` with ``mutations`` (from ``MUTATIONS``) applied in order, positions taken modulo its length."""
    changed = bytearray(wire)
    for kind, at, value in mutations:
        at %= len(changed) + 1
        if kind == "insert":
            changed[at:at] = bytes([value])
        elif at < len(changed):
            if kind == "flip":
                changed[at] = value
            else:
                del changed[at]
    return bytes(changed)
# The limits the malformed cases above are written against (pass them to the server under test).
LIMITS = {"max_header_bytes": 4096, "max_header_count": 100, "max_body_bytes": 65536, "max_url_bytes": 1024}
