"""``top_level_usage`` decodes only the tail of an answer from its last ``"usage"`` key: it must find what a
decode of the whole document finds, wherever the key and look-alikes sit (gateway/request/usage.py)."""

from __future__ import annotations

import msgspec
import pytest

from gateway.request.usage import UsageScanner, _usage_document, top_level_usage

USAGE = {"prompt_tokens": 10, "completion_tokens": 16, "total_tokens": 26,
         "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2}}

DOCUMENTS = [
    {"id": "a", "choices": [{"message": {"content": "hi"}}], "usage": USAGE},  # the usual: usage last
    {"usage": USAGE, "id": "a", "choices": []},  # usage first
    {"id": "a", "usage": USAGE, "system_fingerprint": "fp"},  # members after it
    {"id": "a", "usage": USAGE, "extra": {"usage": {"total_tokens": 999}}},  # a nested look-alike after it
    {"id": "a", "choices": [{"usage": {"total_tokens": 999}}]},  # only nested: no top-level usage
    {"id": "a", "usage": USAGE, "choices": [{"usage": {"total_tokens": 999}}]},  # nested in an array after it
    {"id": "a", "usage": {"total_tokens": 5, "usage": {"total_tokens": 999}}},  # a usage inside the usage
    {"id": "a", "choices": [{"message": {"content": 'he said "usage": {"total_tokens": 999}}'}}]},  # in a string
    {"id": "a", "usage": USAGE, "kind": "usage"},  # "usage" as the last value
    {"id": "a", "usage": None},
    {"id": "a", "usage": "none"},  # not an object: not a usage
    {"id": "a", "usage": {"total_tokens": -1}},  # not a count
    {"id": "a"},
]


@pytest.mark.parametrize("document", DOCUMENTS)
@pytest.mark.parametrize("indent", [0, 2])
def test_the_tail_finds_what_the_whole_document_gives(document: dict, indent: int) -> None:
    data = msgspec.json.format(msgspec.json.encode(document), indent=indent)
    try:
        whole = _usage_document.decode(data).usage
    except msgspec.ValidationError:
        whole = None
    assert top_level_usage(data) == whole


def test_a_nested_usage_after_the_real_one_does_not_win() -> None:
    data = msgspec.json.encode(DOCUMENTS[3])
    usage = top_level_usage(data)
    assert usage is not None and usage.total_tokens == 26
    assert top_level_usage(msgspec.json.encode(DOCUMENTS[4])) is None


def test_the_scanner_counts_a_long_answer_from_its_tail() -> None:
    answer = {"id": "a", "choices": [{"message": {"content": "word " * 5000}}], "usage": USAGE}
    scanner = UsageScanner()
    scanner.feed(msgspec.json.encode(answer))
    assert (scanner.total_tokens, scanner.prompt_tokens, scanner.completion_tokens) == (26, 10, 16)
    assert (scanner.cached_tokens, scanner.reasoning_tokens) == (4, 2)


def _counts(observer: UsageScanner) -> tuple[int | None, ...]:
    return (observer.total_tokens, observer.prompt_tokens, observer.completion_tokens, observer.cached_tokens,
            observer.reasoning_tokens)


@pytest.mark.parametrize("document", DOCUMENTS)
@pytest.mark.parametrize("indent", [0, 2])
def test_the_scanner_takes_what_top_level_usage_finds(document: dict, indent: int) -> None:
    """``UsageScanner.feed`` takes ``top_level_usage`` of a whole answer in one chunk: a usage with a
    total is taken as it is; anything else goes the byte scan, as the same answer in two chunks does."""
    data = msgspec.json.format(msgspec.json.encode(document), indent=indent)
    whole = UsageScanner()
    whole.feed(data)
    whole.flush()
    usage = top_level_usage(data)
    if usage is not None and usage.total_tokens is not None:
        cached = None if usage.prompt_tokens_details is None else usage.prompt_tokens_details.cached_tokens
        reasoning = (None if usage.completion_tokens_details is None
                     else usage.completion_tokens_details.reasoning_tokens)
        assert _counts(whole) == (usage.total_tokens, usage.prompt_tokens, usage.completion_tokens, cached, reasoning)
    else:
        scanned = UsageScanner()
        scanned.feed(data[:1])  # an opening brace alone: not a whole document, so the byte scan reads on
        scanned.feed(data[1:])
        scanned.flush()
        assert _counts(whole) == _counts(scanned)
