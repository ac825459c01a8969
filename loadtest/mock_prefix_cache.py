"""The mock provider's prompt cache (``--prefix-cache N``): an LRU of prompt prefixes, as a provider's
KV-cache prefix reuse behaves from outside (OpenAI's cached input, Anthropic's cache reads, vLLM's
automatic prefix caching).

A request's prefix is its leading prompt content: tools, the system prompt (Messages ``system``,
Responses ``instructions``) and every turn but the last. When this process saw that prefix recently, the
answer reports its tokens as cached (``prompt_tokens_details.cached_tokens``, Responses
``input_tokens_details.cached_tokens``, Messages ``cache_read_input_tokens``) and comes faster: the
delay before the first token shrinks by the cached share of the prompt (``--prefix-hit-factor``: the
delay a fully cached prompt keeps). A miss reports 0 cached tokens and stores the prefix. Each process of
``--processes N`` keeps its own cache, as each replica of a real provider does.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec

_encode = msgspec.json.encode


def _text_tokens(value: Any) -> int:
    """Four characters a token, over the text of the value (as the mock counts a prompt's tokens)."""
    if isinstance(value, str):
        return len(value) // 4 + 1
    if isinstance(value, list):
        return sum(_text_tokens(item) for item in value)
    if isinstance(value, dict):
        return sum(_text_tokens(item) for key, item in value.items() if key in ("content", "text"))
    return 0


def leading_content(endpoint: str, body: dict[str, Any]) -> list[Any]:
    """The parts of the prompt a cache can hold for the next request: all but its last turn."""
    head: list[Any] = [body.get("tools"), body.get("system"), body.get("instructions")]
    turns = body.get("messages")
    if endpoint == "responses":
        turns = body.get("input")
    if isinstance(turns, list):
        head += turns[:-1]
    return [part for part in head if part]


class PrefixCache:
    """LRU of prefix keys -> (their token counts, when stored); ``capacity`` 0 is off; an entry older than
    ``ttl`` seconds (0: none) is gone, as a provider's cache entries expire."""

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[bytes, tuple[int, float]] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def lookup(self, capacity: int, endpoint: str, body: dict[str, Any], now: float = 0.0,
               ttl: float = 0.0) -> int | None:
        """Cached prompt tokens of this request (0: a miss, now stored), or None: no cache or no prefix."""
        if capacity <= 0:
            return None
        head = leading_content(endpoint, body)
        if not head:
            return 0
        key = _encode(head)
        entries = self.entries
        found = entries.get(key)
        if found is not None and (ttl <= 0 or now - found[1] <= ttl):
            entries.move_to_end(key)
            self.hits += 1
            return found[0]
        self.misses += 1
        entries[key] = (_text_tokens(head), now)
        entries.move_to_end(key)
        while len(entries) > capacity:
            entries.popitem(last=False)
        return 0


def hit_delay(delay: float, cached: int, prompt: int, factor: float) -> float:
    """The delay before the first token when ``cached`` of ``prompt`` tokens came from the cache."""
    if cached <= 0 or prompt <= 0:
        return delay
    share = min(1.0, cached / prompt)
    return delay * (1.0 - share * (1.0 - factor))
