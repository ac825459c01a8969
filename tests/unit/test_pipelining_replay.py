"""Issue 20: a request is handed on exactly once, whatever follows it and however its bytes arrive.

A chunked request whose terminator arrived in one read with the next pipelined request had the bytes
after its body processed again on every call: one chunked POST and a GET in one write were forwarded
three times, two chunked POSTs and a GET 45 times. Here every framing kind (Content-Length, chunked
with and without extensions and trailers, an empty chunked body, a bodyless GET) is followed by 0, 1
and 2 pipelined requests and delivered whole, split at every byte boundary, a byte at a time and in
random pieces, to the codec driven exactly as workers/server.py drives it; the requests that come out
must be the ones that went in, once each, in order. (End to end through a real gateway and provider:
tests/integration/test_pipelining.py.)
"""

from __future__ import annotations

import random

import pytest

from gateway.http import codec
from gateway.http.framing import ChunkedDecoder, check_request_head
from tests.fuzz_http import FRAMINGS, Sent, pieces, request

MAX_BODY = 65536


def parse(chunks: list[bytes], eof: bool = False, feed_while_answering: bool = False) -> list[tuple]:
    """Requests handed on (method, target, body) when ``chunks`` arrive one by one; the codec is driven
    as the server does (strict head checks, body read by the codec's reader, next cycle after END).
    ``feed_while_answering``: the next chunk arrives after a request ended and before its answer did."""
    parser = codec.ServerCodec(65536, 100)
    queue = list(chunks)
    handed_on: list[tuple] = []
    head = None
    body: list[bytes] = []
    while True:
        event = parser.next_event()
        if event is codec.NEED_DATA:
            if not queue:
                if not eof:
                    break
                eof = False
                parser.feed(b"")
                continue
            parser.feed(queue.pop(0))
        elif type(event) is codec.RequestHead:
            head = event
            framing = check_request_head(event.method, event.target, event.http_version,
                                         codec.header_pairs(event.headers), 8192, MAX_BODY)
            parser.read_body(framing.content_length,
                             ChunkedDecoder(MAX_BODY, 65536) if framing.chunked else None)
        elif type(event) is codec.Body:
            body.append(bytes(event.data))
        elif event is codec.END:
            handed_on.append((head.method, head.target, b"".join(body)))
            assert len(handed_on) <= 20, "requests replayed"  # fail fast where main looped forever
            body = []
            if feed_while_answering and queue:
                parser.feed(queue.pop(0))
            parser.expect_response(head.method, True, True)
            parser.next_cycle()
        elif type(event) is codec.ConnectionClosed:
            break
        else:
            raise AssertionError(f"unexpected event {event!r}")
    assert parser.buffered == 0, "bytes left over that no request claimed"
    return handed_on


def stream(first: str, followers: list[str]) -> list[Sent]:
    kinds = [first, *followers]
    return [request(kind, b"/r/%d" % index, b'{"model": "m", "n": %d}' % index, sizes=[5, 4])
            for index, kind in enumerate(kinds)]


FOLLOWERS = [[], *([kind] for kind in FRAMINGS),
             *([kind, FRAMINGS[(index + 3) % len(FRAMINGS)]] for index, kind in enumerate(FRAMINGS))]
STREAMS = [(first, followers) for first in FRAMINGS for followers in FOLLOWERS]
IDS = [f"{first}+{'+'.join(followers) or 'nothing'}" for first, followers in STREAMS]


def expected(sent: list[Sent]) -> list[tuple]:
    return [(item.method, item.target, item.body) for item in sent]


@pytest.mark.parametrize(("first", "followers"), STREAMS, ids=IDS)
def test_each_request_is_handed_on_once_in_order_however_it_is_split(first, followers):
    sent = stream(first, followers)
    wire = b"".join(item.wire for item in sent)
    want = expected(sent)
    assert parse([wire]) == want
    assert parse([wire], eof=True) == want
    assert parse([wire[i:i + 1] for i in range(len(wire))]) == want
    for cut in range(1, len(wire)):  # the second piece arrives before or while the first is answered
        assert parse([wire[:cut], wire[cut:]], feed_while_answering=cut % 2 == 1) == want, f"split at {cut}"
    rng = random.Random(f"{first}/{followers}")
    for _ in range(25):
        cuts = [rng.randrange(1, len(wire)) for _ in range(rng.randrange(1, 10))]
        assert parse(pieces(wire, cuts), feed_while_answering=rng.random() < 0.5) == want, f"cuts {sorted(cuts)}"


def test_three_chunked_posts_in_one_write_are_three_requests():
    # The 450 bytes that grew a worker to 4 GB (issue 20).
    sent = [request("chunked", b"/r/%d" % index, b"x" * 40, sizes=[7]) for index in range(3)]
    assert parse([b"".join(item.wire for item in sent)]) == expected(sent)


def test_the_bytes_after_a_body_are_kept_without_a_copy_per_request():
    # O(n) for n pipelined bytes: the buffer that follows a body is handed to the next cycle as it
    # is, never rebuilt from a copy (next_cycle and read_body used to copy it whole each request).
    one = request("length", body=b"x" * 10).wire
    parser = codec.ServerCodec(65536)
    parser.feed(one * 500)
    buffers = set()
    for _ in range(500):
        head = parser.next_event()
        assert type(head) is codec.RequestHead
        buffers.add(id(parser._buf))
        parser.read_body(10)
        assert bytes(parser.next_event().data) == b"x" * 10 and parser.next_event() is codec.END
        parser.next_cycle()
    assert len(buffers) == 1 and parser.buffered == 0


@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_half_close_after_complete_requests_ends_cleanly_and_inside_one_is_an_error(framing):
    sent = stream(framing, ["bodyless"])
    wire = b"".join(item.wire for item in sent)
    assert parse([wire], eof=True) == expected(sent)
    with pytest.raises(codec.ParseError):
        parse([wire[:-1]], eof=True)


def _five_line_limit(end: bytes, extra_lines: int) -> codec.ServerCodec:
    """A codec allowing 5 header lines, fed a head of Host plus ``extra_lines`` more, each ending in ``end``."""
    parser = codec.ServerCodec(4096, max_header_count=5)
    parser.feed(b"GET / HTTP/1.1\r\nHost: g" + end + (b"a:b" + end) * extra_lines + b"\r\n")
    return parser


def test_the_head_is_limited_in_size_and_in_lines_before_h11_parses_it():
    # A head the plain parser leaves to h11 (bare LFs) is counted as one: its LFs, whatever ends its lines.
    for end in (b"\r\n", b"\n"):
        with pytest.raises(codec.ParseError) as caught:
            _five_line_limit(end, 5).next_event()
        assert caught.value.status == 431
    assert type(_five_line_limit(b"\r\n", 4).next_event()) is codec.RequestHead
    head = _five_line_limit(b"\n", 4).next_event()
    assert type(head) is codec.RequestHead and not head.plain and len(head.headers) == 5
    parser = codec.ServerCodec(64)
    parser.feed(b"GET / HTTP/1.1\r\nHost: g\r\nX: " + b"y" * 64)  # incomplete, already over the limit
    with pytest.raises(codec.ParseError) as caught:
        parser.next_event()
    assert caught.value.status == 431


def test_next_cycle_before_the_body_ended_is_refused():
    # Parsing the rest of a body as the next request would be request smuggling.
    parser = codec.ServerCodec(4096)
    parser.feed(request("length", body=b"x" * 10).wire[:-3])
    parser.next_event()
    parser.read_body(10)
    parser.next_event()
    with pytest.raises(RuntimeError):
        parser.next_cycle()
