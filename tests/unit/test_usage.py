from __future__ import annotations

import json
import random

import msgspec
import pytest

from gateway.request.usage import (
    SseUsageFilter,
    UsageScanner,
    needs_usage_rewrite,
    rewrite_request_for_usage,
    usage_observer,
)

USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def sse_stream(
    include_usage: bool, *, compact: bool = True, newline: bytes = b"\n", usage_first: bool = False,
    usage: dict | None = None,
) -> bytes:
    """An OpenAI-style chat completion stream; with include_usage the provider adds `"usage": null` to
    every chunk and a final usage-only chunk."""
    separators = (",", ":") if compact else (", ", ": ")
    pieces = ["Hel", 'lo "usage": null', " wor", "ld", None]
    events = []
    for piece in pieces:
        chunk: dict[str, object] = {}
        if include_usage and usage_first:
            chunk["usage"] = None
        delta = {"content": piece} if piece is not None else {}
        chunk |= {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None if piece else "stop"}],
        }
        if include_usage and not usage_first:
            chunk["usage"] = None
        events.append(chunk)
    if include_usage:
        events.append(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": USAGE if usage is None else usage,
            }
        )
    blank = newline + newline
    out = b"".join(b"data: " + json.dumps(e, separators=separators).encode() + blank for e in events)
    return out + b": keep-alive" + blank + b"data: [DONE]" + blank


def run(observer: UsageScanner | SseUsageFilter, data: bytes, cuts: list[int]) -> bytes:
    out = []
    prev = 0
    for cut in [*sorted(cuts), len(data)]:
        out.append(observer.feed(data[prev:cut]))
        prev = cut
    out.append(observer.flush())
    return b"".join(out)


def random_cuts(data: bytes, rng: random.Random) -> list[int]:
    return rng.sample(range(1, len(data)), rng.randint(1, min(40, len(data) - 1)))


# --- extraction -----------------------------------------------------------------------------------


def counts(observer: UsageScanner | SseUsageFilter) -> tuple[int | None, int | None, int | None]:
    return observer.prompt_tokens, observer.completion_tokens, observer.total_tokens


def parts(observer: UsageScanner | SseUsageFilter) -> tuple[int | None, int | None]:
    """The parts priced apart: (cached prompt tokens, reasoning completion tokens)."""
    return observer.cached_tokens, observer.reasoning_tokens


# What OpenAI reports for a chat completion (its details carry other counts beside the two we read).
DETAILED = {
    "prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
    "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 256, "audio_tokens": 0, "accepted_prediction_tokens": 0,
                                  "rejected_prediction_tokens": 0},
}


def test_scanner_finds_the_usage_counts_in_plain_json_at_every_split() -> None:
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 2}, "completion_tokens_details": {
        "reasoning_tokens": 1}}
    body = json.dumps(
        {"id": "x", "choices": [{"message": {"content": "hi"}}], "usage": usage}, indent=1
    ).encode()
    for cut in range(len(body) + 1):
        scanner = UsageScanner()
        assert run(scanner, body, [cut]) == body
        assert counts(scanner) == (5, 4, 9), cut
        assert parts(scanner) == (2, 1), cut


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # The whole answer in one chunk: its top-level usage, read by the JSON decoder.
        (b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}', (5, 4, 9)),
        (b'{"usage":{"total_tokens":9}}', (None, None, 9)),
        # Shapes the decoder refuses or that carry no top-level total: the byte scan decides, as for a
        # body in pieces (a float is read up to its point, a negative count is no count).
        (b'{"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9.0}}', (5, 4, 9)),
        (b'{"usage":{"total_tokens":-3}}', (None, None, None)),
        (b'{"usage":null,"data":[{"usage":{"total_tokens":7}}]}', (None, None, 7)),
        (b'{"usage":{"total_tokens":9}', (None, None, 9)),  # truncated: not one whole document
        (b'{"a":1} {"usage":{"total_tokens":9}}', (None, None, 9)),  # two documents: scanned
    ],
)
def test_scanner_reads_a_whole_json_answer_like_the_scan_does(body: bytes, expected: tuple) -> None:
    whole = UsageScanner()
    assert run(whole, body, []) == body
    assert counts(whole) == expected
    for cut in range(1, len(body)):  # in pieces the scan alone reads it: the same counts
        pieces = UsageScanner()
        run(pieces, body, [cut])
        assert counts(pieces) == expected, cut


def test_scanner_finds_usage_in_an_sse_stream_across_random_splits() -> None:
    stream = sse_stream(include_usage=True)
    rng = random.Random(7)
    for _ in range(300):
        scanner = UsageScanner()
        assert run(scanner, stream, random_cuts(stream, rng)) == stream
        assert counts(scanner) == (5, 4, 9)


def test_scanner_handles_one_byte_chunks_and_numbers_ending_the_stream() -> None:
    body = b'{"usage":{"total_tokens":  123456}}'
    scanner = UsageScanner()
    run(scanner, body, list(range(1, len(body))))
    assert scanner.total_tokens == 123456
    truncated = b'{"usage":{"total_tokens":77'
    scanner = UsageScanner()
    run(scanner, truncated, [20])
    assert scanner.total_tokens == 77


def test_scanner_ignores_lookalikes_inside_strings_and_non_numbers() -> None:
    body = json.dumps({"content": 'say "total_tokens": 5', "usage": {"total_tokens": None}}).encode()
    scanner = UsageScanner()
    run(scanner, body, [10])
    assert scanner.total_tokens is None


def test_last_usage_wins() -> None:
    scanner = UsageScanner()
    run(scanner, b'data: {"usage":{"total_tokens":3}}\n\ndata: {"usage":{"total_tokens":11}}\n\n', [5])
    assert scanner.total_tokens == 11


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (DETAILED, (1920, 256)),
        ({**USAGE}, (None, None)),  # no details: unknown, not 0
        ({**USAGE, "prompt_tokens_details": None, "completion_tokens_details": None}, (None, None)),
        ({**USAGE, "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {}}, (0, None)),
    ],
)
def test_cached_and_reasoning_tokens_are_read_from_a_whole_answer_and_in_pieces(usage: dict, expected: tuple) -> None:
    body = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": usage}).encode()
    whole = UsageScanner()
    assert run(whole, body, []) == body
    assert parts(whole) == expected
    for cut in range(1, len(body)):
        pieces = UsageScanner()
        run(pieces, body, [cut])
        assert parts(pieces) == expected, cut
        assert pieces.total_tokens == usage["total_tokens"]


@pytest.mark.parametrize("cached", [-3, 1.5, "7", True])
def test_a_cached_count_that_is_no_count_is_not_read(cached: object) -> None:
    body = json.dumps({"usage": {**USAGE, "prompt_tokens_details": {"cached_tokens": cached}}}).encode()
    scanner = UsageScanner()
    run(scanner, body, [])
    assert counts(scanner) == (5, 4, 9)  # the rest of the usage still counts
    assert scanner.cached_tokens in (None, 1)  # 1.5 is read up to its point, like any count of the scan
    stream = sse_stream(include_usage=True, usage={**USAGE, "prompt_tokens_details": {"cached_tokens": cached}})
    sse = SseUsageFilter()
    run(sse, stream, [])
    assert counts(sse) == (5, 4, 9) and sse.cached_tokens is None


def test_cached_and_reasoning_tokens_are_read_from_a_stream_the_client_asked_usage_of() -> None:
    stream = sse_stream(include_usage=True, usage=DETAILED)
    rng = random.Random(5)
    for cuts in [[], *[random_cuts(stream, rng) for _ in range(200)]]:
        scanner = UsageScanner()
        assert run(scanner, stream, cuts) == stream
        assert parts(scanner) == (1920, 256)


def test_cached_and_reasoning_tokens_are_read_from_a_stream_the_gateway_asked_usage_of() -> None:
    with_usage = sse_stream(include_usage=True, usage=DETAILED)
    plain = sse_stream(include_usage=False)
    rng = random.Random(3)
    for cuts in [[], list(range(1, len(with_usage))), *[random_cuts(with_usage, rng) for _ in range(200)]]:
        sse = SseUsageFilter()
        assert run(sse, with_usage, cuts) == plain
        assert counts(sse) == (2006, 300, 2306) and parts(sse) == (1920, 256)


def test_the_filter_reads_the_parts_of_a_body_that_is_not_sse() -> None:
    body = json.dumps({"usage": DETAILED, "pad": "x" * (2 << 20)}).encode()
    sse = SseUsageFilter()
    assert run(sse, body, [1000, 1 << 20, (1 << 20) + 5]) == body
    assert parts(sse) == (1920, 256)


# --- the client sees exactly the stream it asked for -----------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"compact": False},
        {"newline": b"\r\n"},
        {"usage_first": True},
        {"usage_first": True, "compact": False},
    ],
)
def test_filter_makes_the_usage_stream_byte_identical_to_the_plain_one(variant: dict) -> None:
    with_usage = sse_stream(include_usage=True, **variant)
    plain = sse_stream(include_usage=False, **variant)
    rng = random.Random(11)
    splits = [[], [1], [len(with_usage) - 1], *[random_cuts(with_usage, rng) for _ in range(200)]]
    for cuts in splits:
        sse = SseUsageFilter()
        assert run(sse, with_usage, cuts) == plain
        assert counts(sse) == (5, 4, 9)


def test_filter_one_byte_at_a_time() -> None:
    with_usage = sse_stream(include_usage=True)
    sse = SseUsageFilter()
    assert run(sse, with_usage, list(range(1, len(with_usage)))) == sse_stream(include_usage=False)
    assert counts(sse) == (5, 4, 9)


def test_filter_forwards_whole_events_immediately() -> None:
    stream = sse_stream(include_usage=True)
    first_event_end = stream.index(b"\n\n") + 2
    sse = SseUsageFilter()
    out = sse.feed(stream[: first_event_end + 10])
    assert out == sse_stream(include_usage=False)[: len(out)]
    assert out.endswith(b"}\n\n")


def test_filter_leaves_a_usage_chunk_with_choices_alone_but_records_it() -> None:
    event = b'data: {"choices":[{"index":0,"delta":{}}],"usage":{"total_tokens":42}}\n\n'
    sse = SseUsageFilter()
    assert run(sse, event, [17]) == event
    assert sse.total_tokens == 42


def test_filter_gives_up_on_a_body_that_is_not_sse() -> None:
    body = b'{"usage": {"total_tokens": 5}, "pad": "' + b"x" * (2 << 20) + b'"}'
    sse = SseUsageFilter()
    assert run(sse, body, [1000, 1 << 20, (1 << 20) + 5]) == body
    assert sse.total_tokens == 5


def test_observer_choice_follows_rewrite_and_content_type() -> None:
    assert isinstance(usage_observer(True, True), SseUsageFilter)
    assert isinstance(usage_observer(False, True), UsageScanner)
    assert isinstance(usage_observer(True, False), UsageScanner)


# --- request rewrite ---------------------------------------------------------------------------------


def test_rewrite_adds_include_usage_without_touching_the_rest() -> None:
    body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    new = rewrite_request_for_usage(body)
    assert new is not None
    assert new.endswith(body[1:])  # spliced in, the original bytes follow unchanged
    assert json.loads(new) == {**json.loads(body), "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    ("stream_options", "expected"),
    [
        (None, {"include_usage": True}),
        ({"include_usage": False}, {"include_usage": True}),
        ({"continuous_usage_stats": True}, {"continuous_usage_stats": True, "include_usage": True}),
    ],
)
def test_rewrite_sets_include_usage_in_existing_stream_options(
    stream_options: object, expected: dict
) -> None:
    body = json.dumps({"model": "m", "stream": True, "stream_options": stream_options}).encode()
    new = rewrite_request_for_usage(body)
    assert new is not None
    assert msgspec.json.decode(new) == {"model": "m", "stream": True, "stream_options": expected}


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}',
        b'{"model": "m", "stream": false}',
        b'{"model": "m"}',
        b'{"model": "m", "stream": "yes"}',
        b'{"stream": true, "stream_options": 3}',
        b"not json",
        b"[1, 2]",
    ],
)
def test_no_rewrite_when_not_needed_or_not_ours_to_fix(body: bytes) -> None:
    assert rewrite_request_for_usage(body) is None


def test_rewrite_of_a_minimal_object() -> None:
    assert json.loads(rewrite_request_for_usage(b' {"stream":true} ') or b"") == {
        "stream_options": {"include_usage": True},
        "stream": True,
    }


def test_needs_usage_rewrite_from_decoded_fields() -> None:
    assert needs_usage_rewrite(True, None)
    assert needs_usage_rewrite(True, {"include_usage": False})
    assert not needs_usage_rewrite(True, {"include_usage": True})
    assert not needs_usage_rewrite(False, None)
