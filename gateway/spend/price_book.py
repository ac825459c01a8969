"""Which price a model has: the config's overrides, then the shipped table, then the unpriced policy.

One ``PriceBook`` per process, built from the config (``PriceBook.from_config``) when it is loaded.
The request path calls it at most twice per request: ``worst_case_cost`` at admission (what a hard
USD budget reserves) and ``usage_cost`` (``cost`` of a usage observer's counts) once at the end, with
the usage the provider reported and the model that actually served. A model's price is looked up once and
memoised (a bounded map: model names come from clients).

Lookup order for a model name (docs/pricing.md):
1. ``pricing.overrides``: the first glob, in the order written, that matches the whole name;
2. the table entry of that exact name;
3. for ``provider/name``, the table entry of ``name``;
4. with ``pricing.unpriced: estimate``, its nearest relative in the table: the longest name that is
   the model's name cut at a ``-``, ``.``, ``:``, ``@``, ``_`` or ``/`` (``gpt-4o-2099-01-01``
   is priced as ``gpt-4o``; ``ft:gpt-4o-mini-2024-07-18:acme::x1`` as
   ``ft:gpt-4o-mini-2024-07-18``);
5. else the model is unpriced: ``zero`` and ``estimate`` charge it nothing, ``reject`` refuses it
   at admission (``admits``). Each such request is counted in ``counts``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gateway.pricing.cost import ModelPrice, PriceRow, request_cost, total_only_cost, worst_case_cost
from gateway.pricing.table import PriceTable
from gateway.pricing.units import TOKENS_PER_PRICE_UNIT, parse_usd_per_million

if TYPE_CHECKING:
    from gateway.config import Pricing

Unpriced = Literal["reject", "zero", "estimate"]

MEMO_SIZE = 4096  # distinct model names remembered; past it the memo starts over
MAX_MODEL_NAME = 256  # longer names are looked up (overrides, exact) but neither memoised nor estimated
_SEPARATORS = re.compile(r"[-.:@_/]")
_UNKNOWN: Any = object()  # a memo miss (None in the memo is a model known to be unpriced)


@dataclass(slots=True)
class UnpricedCounts:
    """Requests of models without a price of their own, per outcome (for the metrics):
    ``zero`` charged nothing, ``estimated`` priced as a relative, ``rejected`` refused."""

    zero: int = 0
    estimated: int = 0
    rejected: int = 0


@dataclass(frozen=True, slots=True)
class Override:
    """One ``pricing.overrides`` entry, converted: a glob and its (flat) prices."""

    glob: str
    pattern: re.Pattern[str]
    price: ModelPrice


def override_price(glob: str, entry: Any) -> Override:
    """A ``pricing.overrides`` entry (an object with ``input``, ``output`` and the optional
    ``cached_input``, ``cache_write``, ``reasoning`` in USD per million tokens) converted to integers:
    a cached-input or cache-write price not given is the input price, a reasoning price the output's."""
    input_ = parse_usd_per_million(entry.input)
    output = parse_usd_per_million(entry.output)

    def optional(value: object, default: int) -> int:
        return default if value is None else parse_usd_per_million(value)

    row = PriceRow(0, input_, output, optional(entry.cached_input, input_), optional(entry.cache_write, input_),
                   optional(entry.reasoning, output))
    return Override(glob, re.compile(fnmatch.translate(glob)), ModelPrice.of(glob, "override", (row,)))


@dataclass(slots=True)
class PriceBook:
    table: PriceTable
    overrides: tuple[Override, ...] = ()
    unpriced: Unpriced = "zero"
    counts: UnpricedCounts = field(default_factory=UnpricedCounts)
    _memo: dict[str, ModelPrice | None] = field(default_factory=dict)

    @classmethod
    def from_config(cls, pricing: Pricing, table: PriceTable) -> PriceBook:
        overrides = tuple(override_price(glob, entry) for glob, entry in pricing.overrides.items())
        return cls(table, overrides, pricing.unpriced)

    def price(self, model: str) -> ModelPrice | None:
        """The price ``model`` is charged at (None: unpriced); memoised."""
        try:
            return self._memo[model]
        except KeyError:
            pass
        found = self._resolve(model)
        if len(model) <= MAX_MODEL_NAME:
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()  # rare: cheaper than keeping an order, and stays bounded
            self._memo[model] = found
        return found

    def admits(self, model: str) -> bool:
        """False when ``model`` has no price and ``pricing.unpriced`` is ``reject`` (counted)."""
        if self.unpriced != "reject" or self.price(model) is not None:
            return True
        self.counts.rejected += 1
        return False

    def cost(
        self,
        model: str,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        cached_tokens: int | None = 0,
        cache_write_tokens: int | None = 0,
        reasoning_tokens: int | None = 0,
        total_tokens: int | None = None,
    ) -> int:
        """What a request served by ``model`` cost, in nano-USD (``cost.request_cost``; a usage that
        gives only ``total_tokens`` is priced by ``cost.total_only_cost``); 0 for an unpriced model.
        Call once per request: it counts unpriced and estimated requests."""
        price = self.price(model)
        if price is None:
            self.counts.zero += 1
            return 0
        if price.source == "estimate":
            self.counts.estimated += 1
        if prompt_tokens is None and completion_tokens is None and total_tokens is not None:
            return total_only_cost(price, total_tokens)
        return request_cost(price, prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens,
                            reasoning_tokens)

    def usage_cost(self, model: str, usage: Any, checked: bool = False) -> int | None:
        """``cost`` of a provider's reported usage (an object with ``total_tokens``, ``prompt_tokens``,
        ``completion_tokens``, ``cached_tokens``, ``cache_write_tokens``, ``reasoning_tokens``), checked
        and priced in one call: None, counting nothing, when a count is not a plain non-negative
        integer (it cannot be a provider's count). Same result and counts as ``cost``. ``checked``: the
        usage's counts are known to be such integers or None (``request_cost.CHECKED_OBSERVERS``), so
        they are not checked again, and a model known to be unpriced does not read them at all.

        The request path's (``workers/outcomes.py``, directly or through ``request_cost.attempts_cost``,
        once per request that reached a provider), so its steps are written out: the memo read
        directly, and ``cost.request_cost`` inline for counts known to be non-negative integers
        (tests/unit/test_pricing_fast.py holds it equal to ``cost``)."""
        price = self._memo.get(model, _UNKNOWN)
        if price is None and checked:  # unpriced (memoised), and no count to check: it costs nothing
            self.counts.zero += 1
            return 0
        total = usage.total_tokens
        prompt = usage.prompt_tokens
        completion = usage.completion_tokens
        cached = usage.cached_tokens
        written = usage.cache_write_tokens
        reasoning = usage.reasoning_tokens
        # Each count None or a plain int >= 0 (a bool or a float is no provider's count); one condition
        # rather than a loop over a tuple of the six: a third of the time.
        if not (checked
                or (total is None or total.__class__ is int and total >= 0)
                and (prompt is None or prompt.__class__ is int and prompt >= 0)
                and (completion is None or completion.__class__ is int and completion >= 0)
                and (cached is None or cached.__class__ is int and cached >= 0)
                and (written is None or written.__class__ is int and written >= 0)
                and (reasoning is None or reasoning.__class__ is int and reasoning >= 0)):
            return None
        if price is _UNKNOWN:
            price = self.price(model)
        if price is None:
            self.counts.zero += 1
            return 0
        if price.source == "estimate":
            self.counts.estimated += 1
        if prompt is None and completion is None:
            return 0 if total is None else total_only_cost(price, total)
        # cost.request_cost's parts, each count already an int >= 0 or None (not reported: 0)
        if prompt is None:
            prompt = 0
        if completion is None:
            completion = 0
        if cached is None:
            cached = 0
        elif cached > prompt:
            cached = prompt
        if written is None:
            written = 0
        elif written > prompt - cached:
            written = prompt - cached
        if reasoning is None:
            reasoning = 0
        elif reasoning > completion:
            reasoning = completion
        row = price.tier(prompt) if price.above else price.base
        femto_usd = ((prompt - cached - written) * row.input + cached * row.cached_input + written * row.cache_write
                     + (completion - reasoning) * row.output + reasoning * row.reasoning)
        return -(-femto_usd // TOKENS_PER_PRICE_UNIT)  # units.nusd_of: rounded up to whole nano-USD

    def worst_case_cost(self, model: str, prompt_tokens: int, completion_tokens: int) -> int:
        """The most a request for ``model`` of this size can cost (``cost.worst_case_cost``); 0 for an
        unpriced model (``admits`` decides whether it may run at all). Counts nothing."""
        price = self.price(model)
        return 0 if price is None else worst_case_cost(price, prompt_tokens, completion_tokens)

    def _resolve(self, model: str) -> ModelPrice | None:
        for override in self.overrides:
            if override.pattern.match(model):
                return override.price
        rows = self.table.get(model)
        if rows is not None:
            return ModelPrice.of(model, "table", rows)
        _, slash, bare = model.partition("/")
        if slash and (rows := self.table.get(bare)) is not None:
            return ModelPrice.of(bare, "table", rows)
        if self.unpriced == "estimate" and len(model) <= MAX_MODEL_NAME:
            return self._relative(model) or (self._relative(bare) if slash else None)
        return None

    def _relative(self, model: str) -> ModelPrice | None:
        """The table entry of the longest proper prefix of ``model`` that ends before a separator."""
        cuts = [match.start() for match in _SEPARATORS.finditer(model)]
        for cut in reversed(cuts):
            name = model[:cut]
            rows = self.table.get(name)
            if rows is not None:
                return ModelPrice.of(name, "estimate", rows)
        return None


def override_warnings(overrides: Mapping[str, Any], known_models: Iterable[str]) -> list[str]:
    """One line per ``pricing.overrides`` glob that matches none of ``known_models`` (the table's and
    the overlay's): a warning, not an error, since pricing a model nothing knows yet (a private one)
    is what overrides are for; but a typo in a glob would leave the model at the table's price."""
    names = list(known_models)
    warnings = []
    for glob in overrides:
        pattern = re.compile(fnmatch.translate(glob))
        if not any(pattern.match(name) for name in names):
            warnings.append(f'pricing.overrides["{glob}"]: matches no model of the price table or the overlay')
    return warnings
