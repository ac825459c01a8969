"""ClientCodec's reuse rule, case by case: a pooled upstream connection carries another tenant's
request only after an answer framed beyond doubt (docs/upstream.md). The fuzzer
(test_client_codec_fuzz.py) checks the same rule on generated streams."""

from __future__ import annotations

import pytest

from gateway.http import client_codec, codec


def parse(wire: list[bytes], method: bytes = b"POST", eof: bool = False) -> tuple[list, client_codec.ClientCodec]:
    """Feed ``wire`` piece by piece; the events until the end (or until more data is needed)."""
    client = client_codec.ClientCodec()
    client.encode_request(method, b"/", b"up", [])
    events: list = []
    for piece in [*wire, b""] if eof else wire:
        client.feed(piece)
        if events and type(events[-1]) is codec.EndOfMessage:
            continue
        while (event := client.next_event()) is not codec.NEED_DATA and event is not codec.PAUSED:
            events.append(event)
            if type(event) is codec.EndOfMessage:
                break
    return events, client


def body_of(events: list) -> bytes:
    return b"".join(bytes(e.data) for e in events if type(e) is codec.Body)


def test_a_head_trickled_in_small_pieces_is_parsed():
    # The status code's first digit is sniffed once (for 1xx heads); small pieces after it used to be
    # held back for the sniff again, so a head ending in a 2-byte write never completed.
    wire = [b"HTTP/1.1 200 OK\r\n", b"Content-Length: 2\r\n", b"\r\n", b"ok"]
    events, client = parse(wire)
    assert events[0].status_code == 200 and body_of(events) == b"ok"
    assert type(events[-1]) is codec.EndOfMessage and client.reusable


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;x=1\r\nok\r\n0\r\nTrailer-Field: 1\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
])
def test_an_answer_framed_beyond_doubt_keeps_the_connection(wire):
    events, client = parse([wire])
    assert body_of(events) == b"ok" and client.reusable


@pytest.mark.parametrize(("method", "head"), [
    (b"HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 60\r\n\r\n"),
    (b"HEAD", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
    (b"POST", b"HTTP/1.1 204 No Content\r\nContent-Length: 60\r\n\r\n"),
    (b"POST", b"HTTP/1.1 204 No Content\r\n\r\n"),
    (b"GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 60\r\n\r\n"),
])
def test_bodiless_answers_never_keep_the_connection(method, head):
    # The provider may send the body it declared anyway, later: it would become the next answer.
    events, client = parse([head], method)
    assert events[0].status_code in (200, 204, 304) and type(events[-1]) is codec.EndOfMessage
    assert body_of(events) == b"" and not client.reusable


@pytest.mark.parametrize("wire", [
    b"HTTP/1.1 200 OK\r\n\r\nuntil close",  # close-delimited
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\nContent-Length: 5\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
])
def test_answers_whose_end_is_in_doubt_never_keep_the_connection(wire):
    events, client = parse([wire], eof=wire.endswith(b"until close"))
    assert not client.reusable


@pytest.mark.parametrize("later", [False, True])
def test_bytes_beyond_a_declared_length_are_dropped_and_forbid_reuse(later):
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    extra = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nleak"
    events, client = parse([answer, extra] if later else [answer + extra])
    assert body_of(events) == b"ok" and not client.reusable
    assert client.buffered == 0  # never kept: they are nobody's answer


def test_the_provider_closing_mid_body_is_a_parse_error():
    client = client_codec.ClientCodec()
    client.encode_request(b"POST", b"/", b"up", [])
    client.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    assert client.next_event().status_code == 200 and bytes(client.next_event().data) == b"abc"
    assert client.next_event() is codec.NEED_DATA
    client.feed(b"")
    with pytest.raises(codec.ParseError) as caught:
        client.next_event()
    assert caught.value.status == 502 and not client.reusable


def test_more_than_16_informational_heads_are_refused():
    client = client_codec.ClientCodec()
    client.encode_request(b"POST", b"/", b"up", [])
    client.feed(b"HTTP/1.1 100 Continue\r\n\r\n" * 17)
    for _ in range(client_codec.MAX_INFORMATIONAL_HEADS):
        assert type(client.next_event()) is codec.Informational
    with pytest.raises(client_codec.RefusedResponse) as caught:
        client.next_event()
    assert caught.value.status == 502
    assert str(caught.value) == "more than 16 informational (1xx) heads"


def test_the_informational_count_is_per_response():
    client = client_codec.ClientCodec()
    for _ in range(3):
        client.encode_request(b"POST", b"/", b"up", [])
        client.feed(b"HTTP/1.1 103 Early Hints\r\n\r\n" * 10 + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        while type(event := client.next_event()) is not codec.EndOfMessage:
            assert event is not codec.NEED_DATA
        assert client.reusable
        client.next_cycle()
