"""The client-facing server answers exactly the same with the plain-head parser (gateway/http/request_head.py)
on as with every head given to h11: same statuses, same error codes and words, same bytes handed on, same
close, whatever the stream holds (valid pipelined requests, malformed ones, random mutations, odd heads)
and however it is split. The real parse loop of workers/server.py runs (tests/sansio_server.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.http.request_head import parse_plain_head
from tests.fuzz_http import (
    LIMITS,
    MALFORMED,
    MALFORMED_NAMES,
    MUTATIONS,
    fuzz_settings,
    mutated,
    pieces,
    valid_streams,
)
from tests.sansio_server import serve, settings
from tests.unit.test_request_head import BENCH_HEAD, as_cut, build

SETTINGS = settings(**LIMITS)
CUTS = st.lists(st.integers(1, 1 << 16), max_size=8)


def outcome(wire: bytes, cuts: list[int], plain_heads: bool, eof: bool = True) -> tuple:
    chunks = pieces(wire, [cut % max(len(wire), 1) for cut in cuts]) if wire else []
    run = asyncio.run(serve(chunks, SETTINGS, eof=eof, plain_heads=plain_heads))
    assert not run.loop_errors, run.loop_errors
    transport = run.transport
    return bytes(transport.out), transport.closed, transport.aborted, transport.eof_written, run.state.body_bytes


def same_both_ways(wire: bytes, cuts: list[int] = (), eof: bool = True) -> bytes:
    with_plain = outcome(wire, list(cuts), True, eof)
    assert with_plain == outcome(wire, list(cuts), False, eof)
    return with_plain[0]


@fuzz_settings()
@given(stream=valid_streams(), cuts=CUTS)
def test_valid_streams_are_answered_the_same(stream, cuts):
    answers = same_both_ways(b"".join(item.wire for item in stream), cuts)
    assert answers.count(b"HTTP/1.1 200 ") == len(stream)
    # Requests of these framings are plain heads: the fast path did the parse (chunked ones go to h11).
    for item in stream:
        if item.framing in ("length", "bodyless"):
            assert parse_plain_head(as_cut(item.wire)) is not None


@pytest.mark.parametrize("case", MALFORMED_NAMES)
@fuzz_settings(short_examples=4)
@given(before=valid_streams(2), cuts=CUTS, half_close=st.booleans())
def test_malformed_requests_are_refused_the_same(case, before, cuts, half_close):
    _, bad, _ = MALFORMED[MALFORMED_NAMES.index(case)]
    same_both_ways(b"".join(item.wire for item in before) + bad, cuts, half_close)


@fuzz_settings()
@given(stream=valid_streams(3), cuts=CUTS,
       mutations=MUTATIONS)
def test_mutated_streams_end_the_same(stream, cuts, mutations):
    wire = mutated(b"".join(item.wire for item in stream), mutations)
    same_both_ways(wire, cuts)


@fuzz_settings(short_examples=150)
@given(seed=st.integers(0, 1 << 30), count=st.integers(1, 3), cuts=CUTS)
@example(seed=0, count=1, cuts=[])
def test_generated_heads_end_the_same(seed, count, cuts):
    # The plain and odd heads of the parser's own corpus, each with the body its Content-Length asks.
    rng = random.Random(seed)
    wire = b"".join(build(rng) + b"x" * rng.randrange(4) for _ in range(count))
    same_both_ways(wire, cuts)


def test_a_long_credential_head_is_answered_the_same():
    answers = same_both_ways(BENCH_HEAD + b"y" * 100 + BENCH_HEAD.replace(b"xxx", b"x\x01x", 1) + b"y" * 100)
    assert answers.count(b"HTTP/1.1 200 ") == 1 and b"invalid_header" in answers
