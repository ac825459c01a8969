"""Table-driven checks of the strict-intermediary rules (pure: no sockets)."""

from __future__ import annotations

import pytest

from gateway.http.errors import GatewayError
from gateway.http.framing import MAX_CHUNK_LINE, ChunkedDecoder, check_request_head

H = [(b"host", b"g")]

HEAD_CASES = [
    # (id, method, target, version, headers, expected status or None, expected target)
    ("plain", b"GET", b"/v1/models", b"1.1", H, None, b"/v1/models"),
    ("absolute_form", b"GET", b"http://h/v1/x?q=1", b"1.1", H, None, b"/v1/x?q=1"),
    ("absolute_form_query_only", b"GET", b"https://h?q", b"1.1", H, None, b"/?q"),
    ("absolute_form_bare", b"GET", b"http://h", b"1.1", H, None, b"/"),
    ("http10_without_host", b"GET", b"/", b"1.0", [], None, b"/"),
    ("ipv6_host", b"GET", b"/", b"1.1", [(b"host", b"[::1]:80")], None, b"/"),
    ("http2", b"GET", b"/", b"2.0", H, 505, None),
    ("connect", b"CONNECT", b"a:443", b"1.1", H, 405, None),
    ("asterisk", b"OPTIONS", b"*", b"1.1", H, 400, None),
    ("authority_form", b"GET", b"a:80", b"1.1", H, 400, None),
    ("missing_host", b"GET", b"/", b"1.1", [], 400, None),
    ("host_list", b"GET", b"/", b"1.1", [(b"host", b"a, b")], 400, None),
    ("empty_host", b"GET", b"/", b"1.1", [(b"host", b"")], 400, None),
    ("userinfo_host", b"GET", b"/", b"1.1", [(b"host", b"u@a")], 400, None),
    ("control_host", b"GET", b"/", b"1.1", [(b"host", b"\x07")], 400, None),
    ("space_host", b"GET", b"/", b"1.1", [(b"host", b"a b")], 400, None),
    ("bad_port", b"GET", b"/", b"1.1", [(b"host", b"a:x")], 400, None),
    ("control_byte_value", b"GET", b"/", b"1.1", [*H, (b"x-a", b"a\x01")], 400, None),
    ("del_byte_value", b"GET", b"/", b"1.1", [*H, (b"x-a", b"\x7f")], 400, None),
    ("tab_in_value_is_fine", b"GET", b"/", b"1.1", [*H, (b"x-a", b"a\tb")], None, b"/"),
    ("obs_text_is_fine", b"GET", b"/", b"1.1", [*H, (b"x-a", b"caf\xe9")], None, b"/"),
    ("cl_and_te", b"POST", b"/", b"1.1", [*H, (b"content-length", b"1"), (b"transfer-encoding", b"chunked")], 400,
     None),
    ("te_on_http10", b"POST", b"/", b"1.0", [(b"transfer-encoding", b"chunked")], 400, None),
    ("cl_over_limit", b"POST", b"/", b"1.1", [*H, (b"content-length", b"101")], 413, None),
    ("url_over_limit", b"GET", b"/" + b"a" * 64, b"1.1", H, 414, None),
]


@pytest.mark.parametrize(("method", "target", "version", "headers", "status", "origin"),
                         [case[1:] for case in HEAD_CASES], ids=[case[0] for case in HEAD_CASES])
def test_request_head(method, target, version, headers, status, origin):
    if status is None:
        framing = check_request_head(method, target, version, headers, 64, 100)
        assert framing.target == origin
        return
    with pytest.raises(GatewayError) as caught:
        check_request_head(method, target, version, headers, 64, 100)
    assert caught.value.reply.status == status and caught.value.reply.close


@pytest.mark.parametrize(("headers", "version", "keep_alive"), [
    (H, b"1.1", True),
    ([*H, (b"connection", b"Keep-Alive, Close")], b"1.1", False),
    ([*H, (b"connection", b"closed")], b"1.1", True),
    (H, b"1.0", False),
])
def test_keep_alive(headers, version, keep_alive):
    assert check_request_head(b"GET", b"/", version, headers, 64, 100).keep_alive is keep_alive


def decode(wire: bytes, step: int | None = None, max_body: int = 100) -> tuple[bytes, bytes]:
    """Feed ``wire`` in pieces as a reader does (never after the end); (body, bytes left after it)."""
    decoder = ChunkedDecoder(max_body, 64)
    pieces: list[bytes] = []
    rest = b""
    for start in range(0, len(wire), step or len(wire)):
        piece = wire[start:start + (step or len(wire))]
        if decoder.done:
            rest += piece
            continue
        decoded, used = decoder.feed(piece)
        pieces += decoded
        rest += piece[used:]
        assert used == len(piece) or decoder.done  # everything is consumed until the body ends
    assert decoder.done
    return b"".join(pieces), rest


CHUNK_OK = [
    ("simple", b"5\r\nhello\r\n0\r\n\r\n", b"hello"),
    ("two_chunks", b"2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n", b"hello"),
    ("uppercase_hex", b"A\r\n0123456789\r\n0\r\n\r\n", b"0123456789"),
    ("leading_zeros", b"0000000000000000000000000005\r\nhello\r\n00000000000000000000000\r\n\r\n", b"hello"),
    ("extensions", b'5;a=1;b="x y";c\r\nhello\r\n0;last\r\n\r\n', b"hello"),
    ("trailers_dropped", b"5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n", b"hello"),
]


@pytest.mark.parametrize(("wire", "body"), [c[1:] for c in CHUNK_OK], ids=[c[0] for c in CHUNK_OK])
@pytest.mark.parametrize("step", [None, 1, 3])
def test_chunked_decoding(wire, body, step):
    assert decode(wire + b"NEXT", step) == (body, b"NEXT")


CHUNK_BAD = [
    ("not_hex", b"zz\r\n", 400),
    ("empty_size", b"\r\n", 400),
    ("bare_lf", b"5\nhello\r\n0\r\n\r\n", 400),
    ("missing_crlf_after_data", b"5\r\nhelloX\r\n0\r\n\r\n", 400),
    ("bad_extension", b"5;=x\r\nhello\r\n0\r\n\r\n", 400),
    ("control_in_extension", b'5;a="\x01"\r\nhello\r\n0\r\n\r\n', 400),
    ("over_the_body_limit", b"65\r\n", 413),
    ("total_over_the_limit", b"40\r\n" + b"x" * 64 + b"\r\n40\r\n", 413),
    ("long_line", b"5;" + b"a" * MAX_CHUNK_LINE + b"\r\n", 400),
    ("huge_value_behind_zeros", b"0" * 40 + b"ffffffffffffffffffff\r\n", 413),
    ("bad_trailer", b"0\r\nno colon\r\n\r\n", 400),
    ("trailers_too_large", b"0\r\n" + b"x-a: " + b"b" * 80 + b"\r\n\r\n", 431),
]


@pytest.mark.parametrize(("wire", "status"), [c[1:] for c in CHUNK_BAD], ids=[c[0] for c in CHUNK_BAD])
@pytest.mark.parametrize("step", [None, 1])
def test_chunked_violations(wire, status, step):
    decoder = ChunkedDecoder(100, 64)
    with pytest.raises(GatewayError) as caught:
        for start in range(0, len(wire), step or len(wire)):
            decoder.feed(wire[start:start + (step or len(wire))])
    assert caught.value.reply.status == status


@pytest.mark.parametrize(("wire", "body"), [c[1:] for c in CHUNK_OK], ids=[c[0] for c in CHUNK_OK])
def test_the_decoder_stops_at_the_end_of_the_body_and_takes_no_byte_after_it(wire, body):
    # Issue 20: bytes after the terminator (the next pipelined request) were appended to a leftover
    # that was fed back in, so they were processed again on every call.
    after = b"GET /next HTTP/1.1\r\nHost: g\r\n\r\n"
    decoder = ChunkedDecoder(100, 64)
    pieces, used = decoder.feed(wire + after)
    assert decoder.done and b"".join(pieces) == body and used == len(wire)
    with pytest.raises(RuntimeError):
        decoder.feed(after)  # a done decoder is never fed again


def test_the_decoder_keeps_at_most_one_bounded_line_between_calls():
    decoder = ChunkedDecoder(10**9, 64)
    for _ in range(MAX_CHUNK_LINE):
        pieces, used = decoder.feed(b"0")  # an endless run of leading zeros, one byte at a time
        assert (pieces, used) == ([], 1)
    with pytest.raises(GatewayError) as caught:
        decoder.feed(b"0")
    assert caught.value.reply.status == 400


def test_bytes_other_than_crlf_after_chunk_data_are_refused_at_once():
    decoder = ChunkedDecoder(100, 64)
    decoder.feed(b"2\r\nab")
    with pytest.raises(GatewayError) as caught:
        decoder.feed(b"\rX")  # not a prefix of CRLF: refused without waiting for a line end
    assert caught.value.reply.status == 400
