"""The codec seam: requests parsed, responses and upstream requests framed by the gateway itself."""

from __future__ import annotations

import h11
import pytest

from gateway.http import codec
from gateway.http.client_codec import ClientCodec


def parse_all(server: codec.ServerCodec) -> list:
    events = []
    while True:
        event = server.next_event()
        if event is codec.NEED_DATA or event is codec.PAUSED:
            return events
        events.append(event)


def client_parse(data: bytes, method: bytes = b"GET") -> list:
    """Read our bytes back with a plain h11 client: what any correct HTTP/1.1 peer would see."""
    peer = h11.Connection(h11.CLIENT)
    peer.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"x")]))
    peer.send(h11.EndOfMessage())
    peer.receive_data(data)
    events = []
    while True:
        event = peer.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return events
        events.append(event)
        if type(event) is h11.EndOfMessage:
            return events


def answer(server: codec.ServerCodec, status: int, content_length: int | None, chunks: list[bytes],
           close: bool = False) -> bytes:
    out = server.response_head(status, [(b"content-type", b"text/plain")], content_length, close)
    for chunk in chunks:
        out += server.response_data(chunk)
    return out + server.response_end()


def test_request_with_body_then_pipelined_request_is_kept_for_the_next_cycle():
    server = codec.ServerCodec(65536)
    server.feed(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabcGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    head, body, end = parse_all(server)
    assert (head.method, head.target, body.data, type(end)) == (b"POST", b"/a", b"abc", codec.EndOfMessage)
    assert server.buffered > 0
    server.next_cycle()
    (second, end2) = parse_all(server)
    assert second.target == b"/b" and type(end2) is codec.EndOfMessage


@pytest.mark.parametrize("version, chunks", [(b"1.1", [b"hello ", b"world"]), (b"1.1", [])])
def test_unknown_length_is_chunked_for_http11(version, chunks):
    server = codec.ServerCodec(65536)
    server.expect_response(b"GET", http11=True, keep_alive=True)
    data = answer(server, 200, None, chunks)
    assert b"transfer-encoding: chunked" in data
    events = client_parse(data)
    assert b"".join(e.data for e in events if type(e) is h11.Data) == b"".join(chunks)
    assert type(events[-1]) is h11.EndOfMessage and not server.must_close


def test_http10_client_gets_a_close_delimited_body_and_the_connection_closes():
    server = codec.ServerCodec(65536)
    server.expect_response(b"GET", http11=False, keep_alive=False)
    data = answer(server, 200, None, [b"abc"])
    assert b"transfer-encoding" not in data and b"connection: close" in data and data.endswith(b"abc")
    assert server.must_close


def test_content_length_is_enforced_both_ways():
    server = codec.ServerCodec(65536)
    server.expect_response(b"GET", http11=True, keep_alive=True)
    server.response_head(200, [], 3)
    with pytest.raises(codec.FramingError):
        server.response_data(b"abcd")
    server.response_head(200, [], 3)
    server.response_data(b"ab")
    with pytest.raises(codec.FramingError):
        server.response_end()


def test_head_response_announces_length_but_carries_no_body():
    server = codec.ServerCodec(65536)
    server.expect_response(b"HEAD", http11=True, keep_alive=True)
    data = server.response_head(200, [], 42)
    assert b"content-length: 42" in data and data.endswith(b"\r\n\r\n")
    with pytest.raises(codec.FramingError):
        server.response_data(b"x")
    assert server.response_end() == b""


@pytest.mark.parametrize("status", [204, 304])
def test_bodyless_statuses_get_no_framing_headers(status):
    server = codec.ServerCodec(65536)
    server.expect_response(b"GET", http11=True, keep_alive=True)
    data = server.response_head(status, [], None)
    assert b"transfer-encoding" not in data and b"content-length" not in data
    assert server.response_end() == b""


def test_close_requested_by_client_or_gateway_adds_connection_close():
    server = codec.ServerCodec(65536)
    server.expect_response(b"GET", http11=True, keep_alive=False)
    assert b"connection: close" in server.response_head(200, [], 0) and server.must_close
    server.expect_response(b"GET", http11=True, keep_alive=True)
    assert b"connection: close" in server.response_head(200, [], 0, close=True) and server.must_close
    server.expect_response(b"GET", http11=True, keep_alive=True)
    assert b"connection" not in server.response_head(200, [], 0) and not server.must_close


def test_malformed_request_raises_parse_error_with_a_status():
    server = codec.ServerCodec(65536)
    server.feed(b"GET / HTTP/1.1\r\nHost x\r\n\r\n")
    with pytest.raises(codec.ParseError) as caught:
        parse_all(server)
    assert caught.value.status == 400


@pytest.mark.parametrize("random_part", [bytes(range(14, 46)), bytes(range(32))],
                         ids=["no-blank-line", "random-bytes-holding-a-blank-line"])
def test_a_tls_handshake_is_not_http_and_other_garbage_is_a_plain_parse_error(random_part):
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + random_part + b"\n\n" * (random_part[0] == 0)
    server = codec.ServerCodec(65536)
    server.feed(hello)
    with pytest.raises(codec.NotHttp):
        server.next_event()
    other = codec.ServerCodec(65536)
    other.feed(b"\x17\x03\x03 nonsense\r\n\r\n")
    with pytest.raises(codec.ParseError) as info:
        other.next_event()
    assert not isinstance(info.value, codec.NotHttp) and info.value.status == 400


def test_client_codec_round_trip_and_reuse():
    client = ClientCodec()
    head = client.encode_request(b"POST", b"/v1/x", b"up", [(b"content-length", b"2")])
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\nhost: up\r\ncontent-length: 2\r\n") and head.endswith(b"\r\n\r\n")
    client.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    events = [client.next_event() for _ in range(3)]
    assert events[0].status_code == 200 and events[1].data == b"ok" and type(events[2]) is codec.EndOfMessage
    assert client.reusable
    client.next_cycle()
    client.encode_request(b"HEAD", b"/", b"up", [])
    client.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n")
    assert client.next_event().status_code == 200
    assert type(client.next_event()) is codec.EndOfMessage  # a HEAD answer has no body


def test_client_codec_bad_response_is_a_parse_error():
    client = ClientCodec()
    client.encode_request(b"GET", b"/", b"up", [])
    client.feed(b"NOT HTTP\r\n\r\n")
    with pytest.raises(codec.ParseError):
        client.next_event()


def test_raw_response_is_complete():
    data = codec.raw_response(400, [(b"content-length", b"2")], b"no")
    assert data == b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\nno"


@pytest.mark.parametrize("step", [None, 1, 4])
def test_client_codec_parses_informational_heads_and_split_status_lines(step):
    client = ClientCodec()
    client.encode_request(b"POST", b"/", b"up", [(b"content-length", b"0")])
    wire = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    for start in range(0, len(wire), step or len(wire)):
        client.feed(wire[start:start + (step or len(wire))])
    events = []
    while (event := client.next_event()) is not codec.NEED_DATA and event is not codec.PAUSED:
        events.append(event)
    assert type(events[0]) is codec.Informational and events[0].status_code == 103
    heads = [e for e in events if type(e) is codec.ResponseHead]
    assert [h.status_code for h in heads] == [200]
    assert b"".join(bytes(e.data) for e in events if type(e) is codec.Body) == b"ok"
    assert type(events[-1]) is codec.EndOfMessage and client.reusable


def test_header_pairs_are_a_plain_lowercase_list():
    server = codec.ServerCodec(65536)
    server.feed(b"GET / HTTP/1.1\r\nHost: x\r\nX-Mixed-Case: V\r\n\r\n")
    head = server.next_event()
    assert codec.header_pairs(head.headers) == [(b"host", b"x"), (b"x-mixed-case", b"V")]


@pytest.mark.parametrize("step", [None, 1, 5])
def test_server_frames_length_bodies_itself_and_keeps_the_next_request(step):
    server = codec.ServerCodec(65536)
    wire = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello world" + b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
    chunks = [wire[i:i + (step or len(wire))] for i in range(0, len(wire), step or len(wire))]
    server.feed(chunks.pop(0))
    while (head := server.next_event()) is codec.NEED_DATA:
        server.feed(chunks.pop(0))
    server.read_body(11)
    body = b""
    while True:
        event = server.next_event()
        if event is codec.NEED_DATA:
            server.feed(chunks.pop(0))
        elif type(event) is codec.Body:
            body += event.data
        else:
            assert event is codec.END
            break
    assert (head.target, body) == (b"/a", b"hello world")
    for chunk in chunks:
        server.feed(chunk)
    server.next_cycle()
    assert server.next_event().target == b"/b"


def test_body_reader_reports_a_connection_closed_mid_body():
    reader = codec.BodyReader(b"abc", 10, None)
    assert bytes(reader.next_event().data) == b"abc"
    assert reader.next_event() is codec.NEED_DATA
    reader.feed(b"")
    with pytest.raises(codec.ParseError):
        reader.next_event()


def test_client_counts_off_length_bodies_and_refuses_reuse_after_extra_bytes():
    client = ClientCodec()
    client.encode_request(b"POST", b"/", b"up", [])
    client.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert client.next_event().status_code == 200
    assert bytes(client.next_event().data) == b"ok" and client.next_event() is codec.END
    assert not client.reusable  # bytes after the end: the provider is not speaking HTTP as we understand it


def test_client_sees_connection_close_and_both_framings():
    client = ClientCodec()
    client.encode_request(b"GET", b"/", b"up", [])
    client.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert client.next_event().status_code == 200 and client.next_event() is codec.END
    assert not client.reusable
    doubtful = ClientCodec()
    doubtful.encode_request(b"GET", b"/", b"up", [])
    doubtful.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
    assert doubtful.next_event().status_code == 200 and doubtful.framing_doubt
    assert bytes(doubtful.next_event().data) == b"ok"  # Transfer-Encoding wins (RFC 9112 §6.3)


def test_tls_handshake_bytes_after_a_request_are_a_plain_parse_error():
    """Only a connection's first bytes can be a TLS client on the plain port; later, 0x16 0x03 is garbage
    (answered 400 after the requests before it, not a silent close that loses their answers)."""
    server = codec.ServerCodec(65536)
    server.feed(b"GET / HTTP/1.1\r\nhost: g\r\n\r\n" + b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")
    assert type(server.next_event()) is codec.RequestHead
    assert type(server.next_event()) is codec.EndOfMessage
    server.next_cycle()
    with pytest.raises(codec.ParseError) as info:
        server.next_event()
    assert not isinstance(info.value, codec.NotHttp) and info.value.status == 400
