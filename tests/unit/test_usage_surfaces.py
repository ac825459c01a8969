"""Usage of the Responses and Messages APIs (gateway/request/usage_surfaces.py).

The streams and bodies in tests/fixtures/surfaces are written event for event after the providers'
documented answers (OpenAI's Responses streaming events, Anthropic's Messages streaming), with the
traps a byte scanner would fall into: ``"usage": null`` on the early events, a JSON schema declaring
an ``input_tokens`` property, model text that reads ``"usage"`` or a usage object, tool input deltas,
``message_start``'s provisional output count. Each stream is fed whole, byte by byte and split at
random points; the observer must pass every byte through unchanged and read the same counts.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.pricing.cost import ModelPrice, PriceRow, request_cost
from gateway.request import surfaces, usage_surfaces
from gateway.request.usage import SseUsageFilter, UsageScanner
from gateway.request.usage_surfaces import MessagesUsage, ResponsesUsage, observer_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "surfaces"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def splits(data: bytes, seed: int) -> list[bytes]:
    """``data`` cut at random points (seed 0: whole; seed 1: byte by byte)."""
    if seed == 0:
        return [data]
    if seed == 1:
        return [data[i : i + 1] for i in range(len(data))]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def observe(observer: ResponsesUsage | MessagesUsage, chunks: list[bytes]) -> ResponsesUsage | MessagesUsage:
    relayed = b"".join(observer.feed(chunk) for chunk in chunks) + observer.flush()
    assert relayed == b"".join(chunks)  # never a byte changed, added or held back
    return observer


def counts(observer: object) -> tuple[int | None, ...]:
    return tuple(getattr(observer, name) for name in (
        "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens", "cache_write_tokens",
        "reasoning_tokens"))


SEEDS = range(12)

# --- Responses --------------------------------------------------------------------------------------

RESPONSES_FINAL = (1841, 205, 2046, 1536, None, 192)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["responses_stream.sse", "responses_stream_pydantic.sse"])
def test_responses_stream_usage_comes_from_the_completed_event(name: str, seed: int) -> None:
    observer = observe(ResponsesUsage(True), splits(fixture(name), seed))
    assert counts(observer) == RESPONSES_FINAL


@pytest.mark.parametrize("seed", SEEDS)
def test_responses_stream_cut_at_max_output_tokens_reads_the_incomplete_event(seed: int) -> None:
    observer = observe(ResponsesUsage(True), splits(fixture("responses_incomplete.sse"), seed))
    assert counts(observer) == (120, 16, 136, 0, None, 16)


def test_responses_stream_cut_before_its_last_event_reports_nothing() -> None:
    data = fixture("responses_stream.sse")
    cut = data[: data.index(b"event: response.completed")]
    assert counts(observe(ResponsesUsage(True), splits(cut, 7))) == (None,) * 6


@pytest.mark.parametrize("seed", SEEDS)
def test_responses_body_usage_whole_or_in_pieces(seed: int) -> None:
    observer = observe(ResponsesUsage(False), splits(fixture("responses_body.json"), seed))
    assert counts(observer) == RESPONSES_FINAL


def test_responses_body_without_details_leaves_them_unknown() -> None:
    body = b'{"id":"resp_1","object":"response","usage":{"input_tokens":5,"output_tokens":7,"total_tokens":12}}'
    assert counts(observe(ResponsesUsage(False), [body])) == (5, 7, 12, None, None, None)


def test_responses_cache_writes_are_read_where_reported() -> None:
    body = (b'{"object":"response","usage":{"input_tokens":5000,"input_tokens_details":{"cache_write_tokens":4096,'
            b'"cached_tokens":0,"cache_write_tokens_details":{"ttl_12h_tokens":0,"ttl_30m_tokens":4096}},'
            b'"output_tokens":7,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":5007}}')
    assert counts(observe(ResponsesUsage(False), splits(body, 3))) == (5000, 7, 5007, 0, 4096, 0)


def test_responses_error_body_reports_nothing() -> None:
    body = b'{"error":{"message":"Unknown parameter: \'stream_options.include_usage\'.","type":"invalid_request_error"}}'
    assert counts(observe(ResponsesUsage(False), [body])) == (None,) * 6


# --- Messages ---------------------------------------------------------------------------------------

# prompt = input 472 + cache read 10240 + cache creation 2048; the cache parts apart.
MESSAGES_FINAL = (472 + 10240 + 2048, 89, 472 + 10240 + 2048 + 89, 10240, 2048, None)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["messages_stream.sse", "messages_stream_cumulative.sse"])
def test_messages_stream_usage_from_message_start_and_message_delta(name: str, seed: int) -> None:
    observer = observe(MessagesUsage(True), splits(fixture(name), seed))
    assert counts(observer) == MESSAGES_FINAL


@pytest.mark.parametrize("seed", SEEDS)
def test_messages_body_usage(seed: int) -> None:
    observer = observe(MessagesUsage(False), splits(fixture("messages_body.json"), seed))
    assert counts(observer) == MESSAGES_FINAL


def test_messages_stream_cut_before_message_delta_knows_the_prompt_but_not_the_total() -> None:
    """message_start's output count (1) is provisional: charging it would bill a long answer as one
    token. Without the final usage the total stays unknown, so the request path charges what it relayed."""
    data = fixture("messages_stream.sse")
    cut = data[: data.index(b"event: message_delta")]
    observer = observe(MessagesUsage(True), splits(cut, 3))
    assert counts(observer) == (472 + 10240 + 2048, None, None, 10240, 2048, None)


def test_messages_without_cache_members() -> None:
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
              b'"role":"assistant","content":[],"model":"claude-3-5-haiku-20241022","usage":{"input_tokens":25,'
              b'"output_tokens":1}}}\n\nevent: message_delta\ndata: {"type":"message_delta","delta":'
              b'{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":15}}\n\n'
              b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert counts(observe(MessagesUsage(True), splits(stream, 5))) == (25, 15, 40, None, None, None)


def test_messages_cost_prices_cache_reads_and_writes_apart() -> None:
    """What the pricing layer computes from the observer's counts: each part at its own price."""
    price = ModelPrice.of("m", "table", [PriceRow(0, input=3000, output=15000, cached_input=300,
                                                  cache_write=3750, reasoning=15000)])
    observer = observe(MessagesUsage(True), [fixture("messages_stream.sse")])
    cost = request_cost(price, observer.prompt_tokens, observer.completion_tokens, observer.cached_tokens,
                        observer.cache_write_tokens, observer.reasoning_tokens)
    expected_femto = 472 * 3000 + 10240 * 300 + 2048 * 3750 + 89 * 15000  # tokens x nano-USD per million
    assert cost == -(-expected_femto // 1_000_000)


# --- framing edges ----------------------------------------------------------------------------------


def test_an_event_larger_than_the_cap_is_given_up_and_the_next_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage_surfaces, "MAX_HELD_BYTES", 4096)
    huge = b'event: response.output_text.done\ndata: {"type":"response.output_text.done","text":"' + \
        b"x" * 10_000 + b'"}\n\n'
    final = (b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
             b'{"input_tokens":3,"output_tokens":4,"total_tokens":7}}}\n\n')
    observer = observe(ResponsesUsage(True), splits(huge + final, 9))
    assert counts(observer) == (3, 4, 7, None, None, None)
    assert observer._held_bytes == 0


def test_a_body_larger_than_the_cap_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage_surfaces, "MAX_HELD_BYTES", 4096)
    body = b'{"output":"' + b"x" * 10_000 + b'","usage":{"input_tokens":3,"output_tokens":4,"total_tokens":7}}'
    observer = observe(ResponsesUsage(False), splits(body, 4))
    assert counts(observer) == (None,) * 6
    assert observer._held == []


def test_a_last_event_without_its_blank_line_is_read_at_flush() -> None:
    final = (b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":2,'
             b'"output_tokens":4}}')
    assert counts(observe(MessagesUsage(True), [final])) == (2, 4, 6, None, None, None)


def test_multi_line_data_is_joined() -> None:
    event = (b'event: response.completed\ndata: {"type":"response.completed",\ndata: "response":{"usage":'
             b'{"input_tokens":1,"output_tokens":2,"total_tokens":3}}}\n\n')
    assert counts(observe(ResponsesUsage(True), [event])) == (1, 2, 3, None, None, None)


def test_negative_or_non_integer_counts_are_ignored() -> None:
    bad = b'{"usage":{"input_tokens":-1,"output_tokens":"7"}}'
    assert counts(observe(ResponsesUsage(False), [bad])) == (None,) * 6
    assert counts(observe(MessagesUsage(False), [bad])) == (None,) * 6


# --- the dispatch by surface ------------------------------------------------------------------------


def test_observer_for_each_surface() -> None:
    assert type(observer_for(surfaces.RESPONSES.usage, True, False)) is ResponsesUsage
    assert type(observer_for(surfaces.MESSAGES.usage, False, False)) is MessagesUsage
    assert observer_for(surfaces.COUNT_TOKENS.usage, False, False) is None
    assert type(observer_for(surfaces.CHAT_COMPLETIONS.usage, True, True)) is SseUsageFilter
    assert type(observer_for(surfaces.CHAT_COMPLETIONS.usage, True, False)) is UsageScanner
    assert type(observer_for(surfaces.OTHER.usage, False, False)) is UsageScanner


def test_the_chat_observers_report_no_cache_writes() -> None:
    usage = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}'
    for observer, chunk in ((UsageScanner(), usage), (SseUsageFilter(), b"data: " + usage + b"\n\n")):
        observer.feed(chunk)
        observer.flush()
        assert observer.total_tokens == 7 and observer.cache_write_tokens is None


# --- error events mid-stream (the access line's upstream_error_event) --------------------------------

ANTHROPIC_ERROR = (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                   b'"message":"Overloaded"}}\n\n')
RESPONSES_ERROR = (b'event: error\ndata: {"type":"error","sequence_number":9,"code":"server_error",'
                   b'"message":"The server had an error","param":null}\n\n')


def _first_events(stream: bytes, count: int) -> bytes:
    """The first ``count`` events of a stream, as the provider sent them."""
    end = 0
    for _ in range(count):
        end = stream.index(b"\n\n", end) + 2
    return stream[:end]


@pytest.mark.parametrize("seed", SEEDS)
def test_an_error_event_mid_stream_is_seen_wherever_the_chunks_split(seed: int) -> None:
    messages = _first_events(fixture("messages_stream.sse"), 4) + ANTHROPIC_ERROR
    observer = observe(MessagesUsage(True), splits(messages, seed))
    assert observer.stream_error == usage_surfaces.STREAM_ERROR
    assert observer.prompt_tokens is not None and observer.total_tokens is None  # charged like a cut stream
    responses = _first_events(fixture("responses_stream.sse"), 5) + RESPONSES_ERROR
    assert observe(ResponsesUsage(True), splits(responses, seed)).stream_error == usage_surfaces.STREAM_ERROR


@pytest.mark.parametrize("seed", SEEDS)
def test_model_text_that_reads_like_an_error_event_is_not_one(seed: int) -> None:
    text = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
            b'{"type":"text_delta","text":"\\nevent: error\\ndata: x"}}\n\n')
    stream = _first_events(fixture("messages_stream.sse"), 3) + text
    assert observe(MessagesUsage(True), splits(stream, seed)).stream_error is None
    assert observe(MessagesUsage(True), splits(fixture("messages_stream.sse"), seed)).stream_error is None
    assert observe(ResponsesUsage(True), splits(fixture("responses_stream.sse"), seed)).stream_error is None
