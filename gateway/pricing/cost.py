"""The prices of one model and what a request costs at them, in integer nano-USD. Pure.

Usage is counted the OpenAI way: ``prompt_tokens`` are all the input tokens, the cached ones
(read from the provider's prompt cache) and the cache-written ones included; ``completion_tokens``
are all the output tokens, reasoning included. A surface that reports them apart (Anthropic's
``input_tokens`` excludes its cache reads and writes) adds them up before calling here.

A request is charged (docs/pricing.md):

    (prompt - cached - cache_write) x input  +  cached x cached_input  +  cache_write x cache_write
    + (completion - reasoning) x output      +  reasoning x reasoning

at the prices of the tier its prompt size falls in, summed exactly in 1e-15 USD (tokens x nano-USD
per million tokens) and rounded up to whole nano-USD once (``units.nusd_of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from gateway.pricing.units import MAX_NUSD_PER_MILLION, nusd_of

_Price = Annotated[int, msgspec.Meta(ge=0, le=MAX_NUSD_PER_MILLION)]
_Tokens = Annotated[int, msgspec.Meta(ge=0)]


class PriceRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The prices of one tier of one model, in nano-USD per million tokens: they apply to a request
    whose prompt has at least ``from_prompt_tokens`` tokens (and fewer than the next tier's). Stored
    as a JSON array, in this order (gateway/pricing/data/prices.json)."""

    from_prompt_tokens: _Tokens
    input: _Price
    output: _Price
    cached_input: _Price
    cache_write: _Price
    reasoning: _Price


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """What a model costs: its tiers by prompt size, ascending (the first from 0 tokens).

    ``name`` is the table entry or override glob that priced the model, ``source`` where that came
    from: ``override`` (``pricing.overrides``), ``table`` (the shipped table) or ``estimate`` (the
    table entry of its nearest relative, ``pricing.unpriced: estimate``).
    """

    name: str
    source: str
    base: PriceRow
    above: tuple[PriceRow, ...] = ()
    # Per tier (base first): the dearest prompt-side and output-side price of this tier and every
    # cheaper-prompt tier, so a worst case holds whatever tier the real prompt lands in.
    worst: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, name: str, source: str, rows: tuple[PriceRow, ...] | list[PriceRow]) -> ModelPrice:
        """From rows sorted by ``from_prompt_tokens``, the first from 0 (the table's form)."""
        worst, prompt_side, output_side = [], 0, 0
        for row in rows:
            prompt_side = max(prompt_side, row.input, row.cached_input, row.cache_write)
            output_side = max(output_side, row.output, row.reasoning)
            worst.append((prompt_side, output_side))
        return cls(name, source, rows[0], tuple(rows[1:]), tuple(worst))

    def tier(self, prompt_tokens: int) -> PriceRow:
        """The prices for a request with this many prompt tokens (the tier its prompt size reaches)."""
        row = self.base
        for candidate in self.above:
            if prompt_tokens < candidate.from_prompt_tokens:
                break
            row = candidate
        return row

    def _tier_index(self, prompt_tokens: int) -> int:
        index = 0
        for candidate in self.above:
            if prompt_tokens < candidate.from_prompt_tokens:
                break
            index += 1
        return index


def request_cost(
    price: ModelPrice,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    cached_tokens: int | None = 0,
    cache_write_tokens: int | None = 0,
    reasoning_tokens: int | None = 0,
) -> int:
    """What one request cost, in nano-USD, from the usage the provider reported (integer counts;
    None, a count the provider did not report, is 0: a usage observer's attributes pass as they are).

    Inconsistent parts never make a cost negative or larger than the whole: a negative count counts
    as 0, cached and cache-written tokens beyond the prompt are capped at it (cached first), and
    reasoning beyond the completion at the completion.
    """
    prompt = prompt_tokens if prompt_tokens and prompt_tokens > 0 else 0
    completion = completion_tokens if completion_tokens and completion_tokens > 0 else 0
    cached = min(cached_tokens, prompt) if cached_tokens and cached_tokens > 0 else 0
    written = min(cache_write_tokens, prompt - cached) if cache_write_tokens and cache_write_tokens > 0 else 0
    reasoning = min(reasoning_tokens, completion) if reasoning_tokens and reasoning_tokens > 0 else 0
    row = price.tier(prompt)
    return nusd_of(
        (prompt - cached - written) * row.input
        + cached * row.cached_input
        + written * row.cache_write
        + (completion - reasoning) * row.output
        + reasoning * row.reasoning
    )


def worst_case_cost(price: ModelPrice, prompt_tokens: int, completion_tokens: int) -> int:
    """The most a request of at most ``prompt_tokens`` prompt and ``completion_tokens`` completion
    tokens can cost, in nano-USD: what a hard budget reserves at admission.

    Every prompt token at the dearest prompt-side price (input, cached input or cache write) and
    every completion token at the dearer of output and reasoning, of the prompt's tier or any
    cheaper-prompt tier. So ``request_cost(price, p, c, ...) <= worst_case_cost(price, P, C)``
    whenever ``p <= P`` and ``c <= C``, whatever the cache and reasoning parts.
    """
    prompt = prompt_tokens if prompt_tokens > 0 else 0
    completion = completion_tokens if completion_tokens > 0 else 0
    prompt_side, output_side = price.worst[price._tier_index(prompt)]
    return nusd_of(prompt * prompt_side + completion * output_side)


def total_only_cost(price: ModelPrice, total_tokens: int) -> int:
    """The cost of a usage that gives only ``total_tokens`` (no prompt/completion split): every token
    at the dearest price of the tier that many prompt tokens reach, so it is never under-charged."""
    total = total_tokens if total_tokens > 0 else 0
    return nusd_of(total * max(price.worst[price._tier_index(total)]))
