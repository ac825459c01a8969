"""Prefix affinity's pure parts: the prompt prefix hash (gateway/request/prefix.py) and the per-worker
placements (gateway/routing/prefix.py): spill under a hot prefix, misses that re-place it."""

from __future__ import annotations

import json

import pytest

from gateway.config import ConfigError, PrefixAffinity, parse_config
from gateway.request.prefix import has_prompt, prompt_prefix
from gateway.request.surfaces import CHAT_COMPLETIONS, COUNT_TOKENS, EMBEDDINGS, MESSAGES, RESPONSES
from gateway.routing.prefix import HIT, MOVED, PrefixTable

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 30}


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_the_last_turn_and_other_fields_do_not_change_the_prefix():
    one = prompt_prefix(body(model="m", max_tokens=5, messages=[SYSTEM, {"role": "user", "content": "a"}]), 4096)
    two = prompt_prefix(body(messages=[SYSTEM, {"role": "user", "content": "b"}], stream=True, user="x"), 4096)
    assert one is not None and one == two
    other = prompt_prefix(body(messages=[{"role": "system", "content": "else"}, {"role": "user", "content": "a"}]),
                          4096)
    assert other != one


def test_tools_system_and_instructions_are_part_of_it():
    turn = [{"role": "user", "content": "q"}]
    plain = prompt_prefix(body(system="rules", messages=turn), 4096)  # Messages: system + messages
    assert plain == prompt_prefix(body(system="rules", messages=[{"role": "user", "content": "other"}]), 4096)
    assert plain != prompt_prefix(body(system="rules", tools=[{"name": "f"}], messages=turn), 4096)
    responses = prompt_prefix(body(instructions="be brief", input="what is it"), 4096)
    assert responses == prompt_prefix(body(instructions="be brief", input="something else"), 4096)
    assert responses != prompt_prefix(body(instructions="be long", input="what is it"), 4096)


def test_only_the_leading_bytes_count():
    long_a = {"role": "system", "content": "x" * 5000 + "a"}
    long_b = {"role": "system", "content": "x" * 5000 + "b"}
    turn = {"role": "user", "content": "q"}
    assert prompt_prefix(body(messages=[long_a, turn]), 1024) == prompt_prefix(body(messages=[long_b, turn]), 1024)
    assert prompt_prefix(body(messages=[long_a, turn]), 8192) != prompt_prefix(body(messages=[long_b, turn]), 8192)


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"{", b'{"messages": "text"}', b'{"model": "m"}', b"\xff"])
def test_no_prompt_no_prefix(raw):
    assert prompt_prefix(raw, 4096) is None


def test_a_lone_prompt_is_its_own_prefix():
    assert prompt_prefix(body(prompt="Once upon a time"), 4096) == prompt_prefix(body(prompt="Once upon a time"), 4096)
    assert prompt_prefix(body(messages=[{"role": "user", "content": "hi"}]), 4096) is not None
    assert prompt_prefix(body(input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]), 99) == (
        prompt_prefix(body(input=[{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]), 99))


def test_which_apis_have_a_prompt():
    assert [has_prompt(s) for s in (CHAT_COMPLETIONS, RESPONSES, MESSAGES, EMBEDDINGS, COUNT_TOKENS)] == [
        True, True, True, False, False]


class Ranked:
    def __init__(self, provider: int) -> None:
        self.provider = provider


RING = [Ranked(2), Ranked(0), Ranked(1)]


def test_a_hot_prefix_spills_to_the_next_provider_only_past_its_share():
    table = PrefixTable(size=16, spill_limit=2, miss_limit=3, slow_first_token_s=None)
    entry = table.entry(b"k" * 8)
    picks = [RING[table.place(entry, RING)].provider for _ in range(6)]
    assert picks == [2, 2, 0, 0, 1, 1]  # two each, in ring order
    assert [RING[table.place(entry, RING)].provider for _ in range(2)] == [2, 0]  # all full: the least loaded
    table.ended(table.placed, 0, 10, None)
    assert RING[table.place(entry, RING)].provider == 0


def test_misses_on_its_place_move_the_prefix_and_a_hit_keeps_it():
    table = PrefixTable(size=16, spill_limit=8, miss_limit=2, slow_first_token_s=None)
    entry = table.entry(b"k" * 8)

    def once(cached: int | None) -> int:
        provider = RING[table.place(entry, RING)].provider
        table.ended(table.placed, provider, cached, 0.01)
        return provider

    assert [once(0), once(100), once(0), once(None), once(100)] == [2, 2, 2, 2, 2]  # never two misses in a row
    assert [once(0), once(0), once(0)] == [2, 2, 0]  # two misses: the next provider
    assert table.moved == 1 and entry.offset == 1


def test_a_prefix_that_misses_everywhere_stops_moving():
    table = PrefixTable(size=16, spill_limit=8, miss_limit=1, slow_first_token_s=None)
    entry = table.entry(b"k" * 8)
    seen = []
    for _ in range(8):
        provider = RING[table.place(entry, RING)].provider
        table.ended(table.placed, provider, 0, None)
        seen.append(provider)
    assert seen == [2, 0, 1, 2, 2, 2, 2, 2]


def test_a_slow_first_token_moves_it_and_an_answer_from_elsewhere_says_nothing():
    table = PrefixTable(size=16, spill_limit=8, miss_limit=5, slow_first_token_s=0.5)
    entry = table.entry(b"k" * 8)
    table.place(entry, RING)
    table.ended(table.placed, 1, 0, 9.0)  # failed over to provider 1: not the place's fault
    assert entry.offset == 0 and entry.inflight == {}
    table.place(entry, RING)
    assert table.ended(table.placed, 2, 50, 0.9) == (MOVED, True)
    assert entry.offset == 1
    table.place(entry, RING)
    assert table.ended(table.placed, 0, 50, 0.1) == (HIT, False)
    table.place(entry, RING)
    assert table.ended(table.placed, 0, None, 0.1) is None  # the provider says nothing of its cache


def test_the_table_forgets_the_least_recently_placed():
    table = PrefixTable(size=16, spill_limit=1, miss_limit=1, slow_first_token_s=None)
    first = table.entry(b"first...")
    for n in range(15):
        table.entry(b"%08d" % n)
    assert table.entry(b"first...") is first  # used again: now the most recent
    table.entry(b"new.....")
    assert len(table) == 16 and table.entry(b"first...") is first


def test_config_ranges_name_the_field():
    with pytest.raises(ValueError, match="spill_at: must be <= 1"):
        PrefixAffinity(spill_at=2.0)
    assert PrefixAffinity().prefix_tokens == 1024 and not PrefixAffinity().enabled


def test_gridgate_check_names_the_prefix_affinity_field():
    base = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\n'
    with pytest.raises(ConfigError) as info:
        parse_config(base + "routing: {overlay_file: o.json, prefix_affinity: {enabled: true, spill_at: 0}}\n")
    assert info.value.problems == ["routing.prefix_affinity.spill_at: must be >= 0.01"]
    with pytest.raises(ConfigError) as info:
        parse_config(base + "routing: {overlay_file: o.json, prefix_affinity: {enable: true}}\n")
    assert info.value.problems[0].startswith("routing.prefix_affinity.enable: unknown key")
    config = parse_config(base + "routing: {overlay_file: o.json, prefix_affinity: {enabled: true, "
                                 "slow_first_token: 2s}}\n")
    assert config.routing.prefix_affinity.slow_first_token == 2
