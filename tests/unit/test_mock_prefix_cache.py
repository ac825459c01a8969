"""The mock provider's prompt cache (loadtest/mock_prefix_cache.py): what the prefix benchmark measures."""

from __future__ import annotations

from loadtest.mock_prefix_cache import PrefixCache, hit_delay, leading_content

SYSTEM = {"role": "system", "content": "x" * 400}


def chat(question: str) -> dict:
    return {"model": "m", "messages": [SYSTEM, {"role": "user", "content": question}]}


def test_a_seen_prefix_is_a_hit_with_its_tokens_and_the_last_turn_does_not_matter():
    cache = PrefixCache()
    assert cache.lookup(8, "chat", chat("a")) == 0
    assert cache.lookup(8, "chat", chat("b")) == 101
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.lookup(0, "chat", chat("a")) is None  # no cache


def test_least_recently_used_goes_first_and_entries_expire():
    cache = PrefixCache()
    bodies = [{"messages": [{"role": "system", "content": f"s{n}"}, {"role": "user", "content": "q"}]}
              for n in range(3)]
    for body in bodies[:2]:
        cache.lookup(2, "chat", body)
    cache.lookup(2, "chat", bodies[0])  # used again
    cache.lookup(2, "chat", bodies[2])  # evicts bodies[1]
    assert cache.lookup(2, "chat", bodies[0]) > 0 and cache.lookup(2, "chat", bodies[1]) == 0
    timed = PrefixCache()
    timed.lookup(8, "chat", chat("a"), now=10.0, ttl=1.0)
    assert timed.lookup(8, "chat", chat("b"), now=10.5, ttl=1.0) > 0
    assert timed.lookup(8, "chat", chat("c"), now=12.0, ttl=1.0) == 0


def test_each_api_has_its_leading_content():
    assert leading_content("messages", {"system": "s", "tools": [{"name": "f"}], "messages": [{"content": "q"}]}) == [
        [{"name": "f"}], "s"]
    assert leading_content("responses", {"instructions": "i", "input": [{"content": "a"}, {"content": "b"}]}) == [
        "i", {"content": "a"}]
    assert leading_content("responses", {"instructions": "i", "input": "text"}) == ["i"]


def test_a_hit_answers_sooner_by_its_cached_share():
    assert hit_delay(1.0, 0, 100, 0.3) == 1.0
    assert abs(hit_delay(1.0, 100, 100, 0.3) - 0.3) < 1e-9
    assert abs(hit_delay(1.0, 50, 100, 0.3) - 0.65) < 1e-9
