"""The plain-head parser (gateway/http/request_head.py) against h11, over a large generated corpus: for
every head it returns None or exactly h11's result (method, target, version, header list), and never a
result for a head h11 refuses."""

from __future__ import annotations

import random
import re

import h11
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.http import codec
from gateway.http.errors import GatewayError
from gateway.http.framing import check_request_head
from gateway.http.request_head import RequestHead, parse_plain_head
from tests.fuzz_http import fuzz_settings

_HEAD_END = re.compile(rb"\n\r?\n")
REFUSED = "refused"


def h11_result(head: bytes) -> object:
    """What h11 makes of ``head`` alone, in a fresh parser (as the codec runs it)."""
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
    parser.receive_data(head)
    try:
        event = parser.next_event()
    except h11.RemoteProtocolError:
        return REFUSED
    if type(event) is not h11.Request:
        return REFUSED
    return event.method, event.target, event.http_version, codec.header_pairs(event.headers)


def as_cut(wire: bytes) -> bytes | None:
    """``wire`` up to and including the end of its head, found as the codec finds it (None: no end)."""
    match = _HEAD_END.search(wire)
    return None if match is None else wire[:match.end()]


def same_as_h11(head: bytes) -> RequestHead | None:
    """Assert the fast parse of ``head`` is None or h11's result; return it."""
    fast = parse_plain_head(head)
    if fast is not None:
        expected = h11_result(head)
        assert expected != REFUSED, f"h11 refuses {head!r}, the fast parser accepted it"
        assert (fast.method, fast.target, fast.http_version, fast.headers) == expected
        assert all(type(part) is bytes for pair in fast.headers for part in pair)
        assert type(fast.headers) is list and type(fast.method) is bytes and type(fast.target) is bytes
        assert fast.plain and strict_checks(fast, True) == strict_checks(fast, False)
    return fast


def strict_checks(head: RequestHead, values_checked: bool) -> tuple:
    """What gateway/http/framing.py makes of ``head``: its framing facts, or its refusal."""
    try:
        framing = check_request_head(head.method, head.target, head.http_version, head.headers, 1024, 1 << 20,
                                     values_checked)
    except GatewayError as error:
        return error.reply.status, error.reply.code, error.reply.message
    return framing.target, framing.content_length, framing.chunked, framing.keep_alive


# -- pieces a head is made of: plain ones and every kind of odd one ------------------------------------------

METHODS = [b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE", b"M-SEARCH",
           b"get", b"PO ST", b"", b"P\x00", b"POST\t", b"\xc3\xa9", b"G(T", b"*"]
TARGETS = [b"/", b"/v1/chat/completions", b"/a?b=c&d=%20", b"http://h/x", b"*", b"h:443", b"", b"/a b", b"/a\tb",
           b"/\x7f", b"/\x01", b"/\xff", b"/a\x00", b"/~!$&'()*+,;=:@"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1.1 ", b"HTTP/11", b"HTTP/1."]
NAMES = [b"Host", b"host", b"HOST", b"Content-Length", b"content-length", b"Transfer-Encoding", b"Expect",
         b"Authorization", b"Content-Type", b"X-Session-Id", b"Connection", b"Upgrade", b"X-a", b"a", b"!#$%&'*+-.^_`|~",
         b"X Y", b"", b"X\x7f", b"X\xff", b"X(", b"X@", b" X", b"\tX", b"X "]
VALUES = [b"", b"x", b"127.0.0.1:8080", b"application/json", b"Bearer eyJ.abc.def", b"100", b"0", b"007", b" 5 ",
          b"5, 5", b"5,6", b"-1", b"1x", b"9" * 19, b"9" * 21, b"chunked", b"100-continue", b"close", b"keep-alive",
          b"a b\tc", b" \t lead and trail \t ", b"\xff\x80obs", b"a\x01b", b"a\x00b", b"a\x0bb", b"a\x0cb", b"a\x7fb",
          b"a\rb", b"a\r", b"a:b:c", b"\"quoted, str\""]
ENDS = [b"\r\n"] * 12 + [b"\n", b"\r", b"\r\r\n", b" \r\n"]
ODD_BYTES = [b"\x00", b"\x01", b"\t", b"\n", b"\r", b"\r\n", b" ", b":", b"\x7f", b"\x80", b"\xff", b"\x0b", b"\x0c",
             b"\n ", b"\r\n\t", b"(", b"A"]


def build(rng: random.Random) -> bytes:
    """One random request head: mostly plain, often odd in one or more places."""
    plain = rng.random() < 0.5
    method = rng.choice(METHODS[:7] if plain else METHODS)
    target = rng.choice(TARGETS[:4] if plain else TARGETS)
    version = rng.choice(VERSIONS[:2] if plain else VERSIONS)
    lines = [method + b" " + target + b" " + version]
    names = [b"Host"] + [rng.choice(NAMES[3:15] if plain else NAMES) for _ in range(rng.randrange(8))]
    rng.shuffle(names)
    for name in names:
        value = rng.choice(VALUES[:20] if plain else VALUES)
        ows = rng.choice([b"", b" ", b"  ", b"\t", b" \t"]) if rng.random() < 0.3 else b" "
        lines.append(name + b":" + ows + value)
        if not plain and rng.random() < 0.05:
            lines.append(rng.choice([b" folded", b"\tfolded", b" "]))  # obs-fold
    ends = [b"\r\n" if plain else rng.choice(ENDS) for _ in lines]
    wire = b"".join(line + end for line, end in zip(lines, ends, strict=True)) + b"\r\n"
    if not plain and rng.random() < 0.5:
        at = rng.randrange(len(wire))
        wire = wire[:at] + rng.choice(ODD_BYTES) + wire[at:]
    if rng.random() < 0.05:
        wire = b"\r\n" + wire
    return wire


def test_a_large_generated_corpus_parses_as_h11_or_goes_to_it():
    rng = random.Random(20261207)
    fast = refused = 0
    for _ in range(20000):
        head = as_cut(build(rng))
        if head is None:
            continue
        parsed = same_as_h11(head)
        fast += parsed is not None
        refused += h11_result(head) == REFUSED
    # The corpus exercises both sides: many plain heads taken here, many refused ones left to h11.
    assert fast > 3000 and refused > 5000, (fast, refused)


BENCH_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer eyJ" + b"x" * 700 + b"\r\nX-Session-Id: session-17\r\nContent-Length: 100\r\n\r\n")


@pytest.mark.parametrize("head", [
    BENCH_HEAD,
    b"GET /v1/models HTTP/1.0\r\nHost: g\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: g\r\nX-Empty:\r\nX-Ows: \t a \t b \t \r\nX-Obs: \xff\x80\r\n\r\n",
    b"M-SEARCH * HTTP/1.1\r\nhost: g\r\nContent-Length: 0007\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHOST: g\r\nConnection: close\r\nUpgrade: websocket\r\nX: a:b\r\n\r\n",
])
def test_plain_heads_are_parsed_here(head):
    assert same_as_h11(head) is not None


@pytest.mark.parametrize("head", [
    b"POST / HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n",  # h11's checks
    b"POST / HTTP/1.1\r\nHost: g\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",  # h11's 100-continue state
    b"POST / HTTP/1.1\r\nHost: g\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",  # h11 merges them
    b"POST / HTTP/1.1\r\nHost: g\r\nContent-Length: 5, 5\r\n\r\n",  # h11 merges a list of equal values
    b"GET / HTTP/1.0\r\n\r\n",  # no Host: valid in HTTP/1.0, but rare
    b"GET / HTTP/1.1\r\nHost: g\r\nX-A: a\x01b\r\n\r\n",  # h11 lets it through, framing refuses it
    b"GET / HTTP/2.0\r\nHost: g\r\n\r\n",  # h11 parses it, framing answers 505
    b"GET / HTTP/1.1\r\nHost: g\r\nX: a\r\n b\r\n\r\n",  # obs-fold
    b"GET / HTTP/1.1\nHost: g\n\n",  # bare LF line ends
])
def test_odd_heads_go_to_h11(head):
    assert parse_plain_head(head) is None


_PART = st.sampled_from([*METHODS, *TARGETS, *VERSIONS, *NAMES, *VALUES, *ODD_BYTES, b":", b": ", b" ", b"\r\n",
                         b"Host: g\r\n", b"Content-Length: 3\r\n", b"GET / HTTP/1.1\r\n"])


@fuzz_settings(short_examples=400)
@given(parts=st.lists(_PART, max_size=24), seed=st.integers(0, 1 << 30))
@example(parts=[b"GET / HTTP/1.1\r\n", b"Host: g\r\n"], seed=0)
def test_any_head_parses_as_h11_or_goes_to_it(parts, seed):
    # Free-form heads out of the same pieces: a valid start, then anything, cut where the codec cuts.
    rng = random.Random(seed)
    start = build(rng) if seed % 3 == 0 else b"GET / HTTP/1.1\r\n"
    head = as_cut(start[:-2] + b"".join(parts) + b"\r\n\r\n")
    assert head is not None
    same_as_h11(head)


def test_a_plain_head_over_the_line_limit_goes_back_to_the_codec_count():
    # The codec's limit counts a head's LFs (its empty line's too): 2 field lines + 3 = 5 lines here.
    head = b"GET / HTTP/1.1\r\nHost: g\r\nX: y\r\n\r\n"
    assert head.count(b"\n") == 4
    assert parse_plain_head(head, 4) is not None and parse_plain_head(head) is not None
    assert parse_plain_head(head, 3) is None
