"""Differential fuzzing of the client-facing server (issue 20 item 2).

Generated request streams (tests/fuzz_http.py: pipelined requests of every framing kind, malformed
requests, truncations, random byte mutations) go through the real parse loop of workers/server.py
(tests/sansio_server.py: the server unchanged, a stand-in transport) in random pieces, and the answers
are compared with a reference model, the list of requests that were sent:

- a valid stream: each request answered once, in order, whatever the split (the reference does not
  depend on the split, so every split gives the same answers);
- a malformed request: the requests before it answered, then exactly one error of the statuses its
  case allows and a close; nothing after it is ever read;
- anything at all: no exception, no 500, the connection ends (no hang) once the client half-closes,
  the bytes buffered stay under the ceiling, and the worker's body budget returns to 0.

``make test`` runs the short, derandomized profile; ``make fuzz`` the long one (tests/fuzz_http.py).
"""

from __future__ import annotations

import asyncio

from hypothesis import example, given
from hypothesis import strategies as st

from gateway.http.framing import MAX_CHUNK_LINE
from tests.fuzz_http import (
    LIMITS,
    MALFORMED,
    MALFORMED_NAMES,
    MUTATIONS,
    Sent,
    fuzz_settings,
    mutated,
    pieces,
    request,
    valid_streams,
)
from tests.sansio_server import Run, serve, settings
from workers.server import _PIPELINE_BUFFER_LIMIT

SETTINGS = settings(**LIMITS)
ERROR_STATUSES = {400, 405, 408, 413, 414, 431, 501, 503, 505}
DELIVERIES = st.sampled_from(["whole", "bytes", "cuts"])
CUTS = st.lists(st.integers(1, 1 << 16), max_size=12)


def deliver(wire: bytes, delivery: str, cuts: list[int]) -> list[bytes]:
    if delivery == "whole" or len(wire) < 2:
        return [wire]
    if delivery == "bytes":
        return [wire[i:i + 1] for i in range(len(wire))]
    return pieces(wire, [cut % len(wire) for cut in cuts])


def run(chunks: list[bytes], **options) -> Run:
    result = asyncio.run(serve(chunks, SETTINGS, **options))
    assert not result.loop_errors, result.loop_errors  # no exception escaped the server
    return result


def echoed(sent: list[Sent]) -> list[tuple[int, bytes]]:
    return [(200, item.method + b" " + item.target + b"\n" + item.body) for item in sent]


def check_invariants(result: Run, chunks: list[bytes]) -> None:
    answers = result.answers()
    statuses = [status for status, _, _ in answers]
    assert 500 not in statuses
    errors = [index for index, status in enumerate(statuses) if status != 200]
    if errors:  # exactly one error, the last answer, with a close
        assert errors == [len(answers) - 1], statuses
        assert statuses[-1] in ERROR_STATUSES, statuses
        assert b"connection: close" in answers[-1][1].lower()
        assert result.transport.finished
    largest = max((len(chunk) for chunk in chunks), default=0)
    assert result.max_buffered <= max(_PIPELINE_BUFFER_LIMIT, LIMITS["max_header_bytes"]) + largest
    assert result.max_pending_line <= MAX_CHUNK_LINE + largest
    assert result.state.body_bytes == 0 or not result.transport.finished


def issue_20(*kinds: str) -> list[Sent]:
    return [request(kind, b"/r/%d" % index, b'{"model": "m"}', sizes=[5]) for index, kind in enumerate(kinds)]


@fuzz_settings()
@given(stream=valid_streams(), delivery=DELIVERIES, cuts=CUTS)
@example(stream=issue_20("chunked", "bodyless"), delivery="whole", cuts=[])  # forwarded 3 times
@example(stream=issue_20("chunked", "chunked", "bodyless"), delivery="whole", cuts=[])  # 45 times
@example(stream=issue_20("chunked", "chunked", "chunked"), delivery="whole", cuts=[])  # 4 GB worker
def test_valid_pipelined_requests_are_answered_once_each_in_order(stream, delivery, cuts):
    wire = b"".join(item.wire for item in stream)
    chunks = deliver(wire, delivery, cuts)
    result = run(chunks)
    assert [(status, body) for status, _, body in result.answers()] == echoed(stream)
    check_invariants(result, chunks)
    assert result.transport.closed and not result.transport.aborted  # the half-close ended it cleanly
    assert result.state.body_bytes == 0


@fuzz_settings()
# A TLS hello after a request was closed silently, losing the earlier answer (found by this fuzzer).
@example(before=[request("length", b"/r/0", b"\x00")], case="tls_hello", after=[], delivery="whole", cuts=[],
         half_close=False)
# A TLS hello sent a byte at a time was answered 400, sent whole closed silently (found by this fuzzer).
@example(before=[], case="tls_hello", after=[request("length", b"/r/0", b"\x00")], delivery="bytes", cuts=[],
         half_close=False)
@given(before=valid_streams(3) | st.just([]), case=st.sampled_from(MALFORMED_NAMES), after=valid_streams(2),
       delivery=DELIVERIES, cuts=CUTS, half_close=st.booleans())
def test_a_malformed_request_gets_one_error_and_a_close_and_nothing_after_it_is_read(
        before, case, after, delivery, cuts, half_close):
    _, bad, statuses = MALFORMED[MALFORMED_NAMES.index(case)]
    wire = b"".join(item.wire for item in before) + bad + b"".join(item.wire for item in after)
    chunks = deliver(wire, delivery, cuts)
    result = run(chunks, eof=half_close)
    answers = result.answers()
    if case == "tls_hello" and not before:  # a TLS client on the plain port: closed, nothing to answer
        assert answers == [] and result.transport.finished
        check_invariants(result, chunks)
        return
    assert [(status, body) for status, _, body in answers[:-1]] == echoed(before)
    assert answers[-1][0] in statuses, (case, answers[-1][:2])
    assert b"connection: close" in answers[-1][1].lower()
    assert result.transport.finished
    check_invariants(result, chunks)
    assert result.state.body_bytes == 0


@fuzz_settings()
@given(stream=valid_streams(), cut=st.integers(0, 1 << 16), delivery=DELIVERIES, cuts=CUTS)
def test_a_stream_cut_short_by_a_half_close_answers_what_came_whole_then_ends(stream, cut, delivery, cuts):
    wire = b"".join(item.wire for item in stream)
    cut %= len(wire) + 1
    whole, ends = [], 0
    for item in stream:
        ends += len(item.wire)
        if ends <= cut:
            whole.append(item)
    chunks = deliver(wire[:cut], delivery, cuts) if cut else []
    result = run(chunks)
    answers = result.answers()
    assert [(status, body) for status, _, body in answers[:len(whole)]] == echoed(whole)
    if cut == sum(len(item.wire) for item in whole):  # cut between two requests: a clean end
        assert len(answers) == len(whole) and result.transport.closed and not result.transport.aborted
    else:  # cut inside a request: it can never complete
        assert len(answers) == len(whole) + 1 and answers[-1][0] == 400
    check_invariants(result, chunks)


@fuzz_settings()
@given(stream=valid_streams(), delivery=DELIVERIES, cuts=CUTS,
       mutations=MUTATIONS)
def test_random_byte_mutations_never_crash_hang_or_leak(stream, delivery, cuts, mutations):
    wire = mutated(b"".join(item.wire for item in stream), mutations)
    chunks = deliver(wire, delivery, cuts)
    result = run(chunks)
    check_invariants(result, chunks)
    assert result.transport.finished  # after the half-close, the server always ends the connection
    assert len([a for a in result.answers() if a[0] == 200]) <= len(stream) + len(mutations)


@fuzz_settings(short_examples=15)
@given(count=st.integers(20, 120), window=st.integers(1, 4096), delivery=DELIVERIES, cuts=CUTS)
def test_a_client_that_reads_its_answers_late_gets_them_all_in_order_and_stays_bounded(count, window, delivery, cuts):
    stream = [request(kind, b"/r/%d" % index, b"y" * 300, sizes=[64])
              for index, kind in zip(range(count), ["length", "chunked_ext_trailers", "bodyless"] * count, strict=False)]
    wire = b"".join(item.wire for item in stream)
    chunks = deliver(wire, delivery, cuts)
    result = run(chunks, window=window)
    assert [(status, body) for status, _, body in result.answers()] == echoed(stream)
    check_invariants(result, chunks)
