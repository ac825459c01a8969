"""A long Authorization value set aside before h11 (gateway/http/credential_line.py): the codec's outcome
is h11's own, byte for byte, whatever the head holds and however its bytes arrive."""

from __future__ import annotations

import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.http import codec
from gateway.http.credential_line import MIN_SET_ASIDE_BYTES, STAND_IN, set_aside
from gateway.http.framing import check_request_head
from gateway.request.headers import HeaderPlan

TOKEN = b"eyJhbGciOiJSUzI1NiJ9." + b"x" * 600 + b".sig"
ONLY_H11 = sys.maxsize


def outcome(wire: bytes, set_aside_bytes: int, cuts: tuple[int, ...] = (), plain_heads: bool = False) -> object:
    """What the codec makes of ``wire`` delivered in pieces at ``cuts``: (method, target, header pairs)
    of every head, or the error (status, message) it ended with. The plain-head parser is off unless
    asked for: these tests are about the set-aside before h11."""
    server = codec.ServerCodec(65536, 100, set_aside_bytes, plain_heads)
    heads = []
    bounds = [0, *sorted(cut % (len(wire) + 1) for cut in cuts), len(wire)]
    try:
        for start, stop in zip(bounds, bounds[1:], strict=False):
            if start == stop:
                continue  # a socket never delivers b"": to the codec that is the client's half-close
            server.feed(wire[start:stop])
            for _ in range(len(wire) + 2):  # every event but NEED_DATA consumes bytes: a bound, not a hang
                event = server.next_event()
                if type(event) is codec.RequestHead:
                    heads.append((event.method, event.target, codec.header_pairs(event.headers)))
                elif type(event) is codec.EndOfMessage:
                    server.next_cycle()
                elif event is codec.NEED_DATA:
                    break
                else:
                    raise AssertionError(f"unexpected event {event!r}")
            else:
                raise AssertionError("the codec kept answering without consuming the bytes")
    except codec.ParseError as error:
        return heads, (error.status, str(error))
    return heads, None


def same_as_h11(wire: bytes, cuts: tuple[int, ...] = ()) -> object:
    ours = outcome(wire, MIN_SET_ASIDE_BYTES, cuts)
    assert ours == outcome(wire, ONLY_H11, cuts)
    assert ours == outcome(wire, MIN_SET_ASIDE_BYTES, cuts, plain_heads=True)  # as the server runs it
    return ours


def request(*lines: bytes) -> bytes:
    return b"\r\n".join([b"POST /v1/chat/completions HTTP/1.1", b"Host: gw", *lines, b"Content-Length: 0", b"", b""])


def test_a_long_bearer_token_arrives_whole_and_untouched():
    heads, error = same_as_h11(request(b"Authorization:  Bearer " + TOKEN + b" \t", b"X-Other: 1"))
    assert error is None
    assert dict(heads[0][2])[b"authorization"] == b"Bearer " + TOKEN


def test_the_head_h11_sees_holds_only_the_stand_in():
    aside = set_aside(bytearray(request(b"User-Agent: t", b"Authorization: Bearer " + TOKEN)))
    assert aside is not None
    head, index, value = aside
    assert TOKEN not in head and b"Authorization:" + STAND_IN + b"\r\n" in head
    assert (index, value) == (2, b"Bearer " + TOKEN)


@pytest.mark.parametrize("lines", [
    [b"Authorization: Bearer " + TOKEN, b"Authorization: Bearer " + TOKEN[:-1] + b"2"],  # duplicates, in order
    [b"authorization: Bearer short", b"Authorization: Bearer " + TOKEN],
    [b"Authorization: Bearer " + TOKEN, b" folded-onto-the-token"],  # obs-fold joins the next line to it
    [b"X-Before: a", b"\tfolded", b"Authorization: Bearer " + TOKEN, b"authorization: -"],  # a fold before it
    [b"Authorization: Bearer " + TOKEN, b"Content-Length: 0"],  # h11 merges the two: one field fewer
    [b"Content-Length: 0", b"X-A: b", b" c", b"Authorization: Bearer " + TOKEN, b"authorization: -"],
    [b"AUTHORIZATION: Bearer " + TOKEN],  # another spelling: h11 alone
    [b"Authorization: Bearer " + TOKEN + b"\r"],  # a CR left after h11 drops one
    [b"Authorization: Bearer " + TOKEN[:300] + b"\x00" + TOKEN[300:]],
    [b"Authorization: Bearer " + TOKEN[:300] + b"\x0b" + TOKEN[300:]],
    [b"Authorization: Bearer " + TOKEN[:300] + b"\x0c" + TOKEN[300:]],
    [b"Authorization: Bearer " + TOKEN[:300] + b"\r" + TOKEN[300:]],
    [b"Authorization: Bearer " + TOKEN[:300] + b"\x01" + TOKEN[300:]],  # h11 tolerates it; framing does not
    [b"Authorization: Bearer " + TOKEN[:300] + b"\xff\x80" + TOKEN[300:]],  # obs-text
    [b"Authorization: Bearer " + TOKEN[:300] + b" \t " + TOKEN[300:]],
    [b"Authorization :Bearer " + TOKEN],  # a space before the colon
    [b"Authorization:" + b" " * 300],  # only OWS: an empty value
])
def test_odd_and_bad_heads_end_exactly_as_with_h11_alone(lines):
    wire = request(*lines)
    same_as_h11(wire)
    for cut in range(1, len(wire), 97):  # and in two pieces, cut anywhere
        same_as_h11(wire, (cut,))


@pytest.mark.parametrize("bad", [b"\x00", b"\x0b", b"\r"])
def test_an_error_never_echoes_the_credential(bad):
    _, error = same_as_h11(request(b"Authorization: Bearer " + TOKEN[:300] + bad + TOKEN[300:]))
    assert error == (400, "illegal header line")


def test_limits_hold_for_the_head_as_sent():
    server = codec.ServerCodec(512, 100, MIN_SET_ASIDE_BYTES)
    server.feed(request(b"Authorization: Bearer " + TOKEN))
    with pytest.raises(codec.ParseError) as refused:
        server.next_event()
    assert refused.value.status == 431
    many = [b"X-%d: v" % number for number in range(5)]
    server = codec.ServerCodec(65536, 4, MIN_SET_ASIDE_BYTES)
    server.feed(request(b"Authorization: Bearer " + TOKEN, *many))
    with pytest.raises(codec.ParseError) as refused:
        server.next_event()
    assert refused.value.status == 431


def test_a_control_byte_h11_tolerates_is_still_refused_by_the_strict_checks():
    heads, error = same_as_h11(request(b"Authorization: Bearer " + TOKEN[:300] + b"\x01" + TOKEN[300:]))
    assert error is None
    method, target, headers = heads[0]
    with pytest.raises(Exception) as refused:
        check_request_head(method, target, b"1.1", headers, 8192, 1 << 20)
    assert refused.value.reply.status == 400  # type: ignore[attr-defined]


def test_the_restored_token_is_the_credential_the_gateway_reads():
    heads, _ = same_as_h11(request(b"Authorization: Bearer " + TOKEN, b"Accept: */*"))
    scanned = HeaderPlan("x-model").scan(heads[0][2])
    assert scanned.authorization == b"Bearer " + TOKEN and (b"accept", b"*/*") in scanned.forward


def test_pipelined_requests_each_get_their_own_token():
    first, second = request(b"Authorization: Bearer " + TOKEN), request(b"Authorization: Bearer " + TOKEN[::-1])
    heads, error = same_as_h11(first + second)
    assert error is None and [dict(head[2])[b"authorization"] for head in heads] == [
        b"Bearer " + TOKEN, b"Bearer " + TOKEN[::-1]]


@pytest.mark.parametrize("piece", [1, 3, 7, 64])
def test_a_long_token_in_small_writes_ends_as_in_one(piece):
    # The head is set aside only once complete: however it arrives, each request gets its whole token.
    wire = request(b"Authorization: Bearer " + TOKEN) + request(b"Authorization: Bearer " + TOKEN[::-1])
    whole = same_as_h11(wire)
    assert same_as_h11(wire, tuple(range(piece, len(wire), piece))) == whole
    assert [dict(head[2])[b"authorization"] for head in whole[0]] == [b"Bearer " + TOKEN, b"Bearer " + TOKEN[::-1]]


def test_a_half_close_in_the_middle_of_a_long_credential_is_refused():
    wire = request(b"Authorization: Bearer " + TOKEN)
    for cut in (40, len(wire) // 2, len(wire) - 3):
        server = codec.ServerCodec(65536, 100, MIN_SET_ASIDE_BYTES)
        server.feed(wire[:cut])
        assert server.next_event() is codec.NEED_DATA
        server.feed(b"")
        with pytest.raises(codec.ParseError):
            server.next_event()


_VALUE_BYTES = st.sampled_from([b"x", b"A", b".", b" ", b"\t", b"\r", b"\x00", b"\x01", b"\x0b", b"\x0c", b"\x7f",
                                b"\x80", b"\xff", b"\n", b"\r\n", b"\n ", b":"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    before=st.lists(st.sampled_from([b"X-A: 1", b"authorization: -", b" fold", b"User-Agent: t", b"Bad Name: x"]),
                    max_size=3),
    name=st.sampled_from([b"Authorization:", b"authorization:", b"Authorization: ", b"AuthoriZation:"]),
    length=st.integers(100, 900),
    inserts=st.lists(st.tuples(st.integers(0, 900), _VALUE_BYTES), max_size=3),
    after=st.lists(st.sampled_from([b"X-B: 2", b"\tfold", b"Authorization: Bearer again"]), max_size=2),
    cuts=st.lists(st.integers(0, 4096), max_size=4),
)
@example(before=[], name=b"Authorization: ", length=700, inserts=[], after=[], cuts=[])
def test_any_head_with_a_long_credential_ends_as_with_h11_alone(before, name, length, inserts, after, cuts):
    value = bytearray(b"Bearer " + b"t" * length)
    for at, piece in inserts:
        value[at % len(value):at % len(value)] = piece
    same_as_h11(request(*before, name + bytes(value), *after), tuple(cuts))
