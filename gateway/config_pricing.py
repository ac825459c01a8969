"""The pricing part of the gateway configuration: ``pricing`` (docs/configuration.md, docs/pricing.md).

Split from :mod:`gateway.config` (which re-exports every name here) so each schema module stays
small. Prices are written in USD per million tokens, as providers' price pages do, and converted
to integer nano-USD per million tokens by gateway.pricing.units (the same function here, to judge
them, and when the price book is built).
"""

from __future__ import annotations

from typing import Literal

from gateway.pricing.units import parse_usd_per_million
from gateway.yaml_config import StrictStruct

# A decimal string ("0.075") or a YAML number (0.075, 3): USD per million tokens.
UsdPerMillion = str | int | float

MAX_GLOB = 256  # characters of a model glob


class PriceOverride(StrictStruct):
    """The prices of the models one glob matches, USD per million tokens; 0 is free."""

    input: UsdPerMillion
    output: UsdPerMillion
    cached_input: UsdPerMillion | None = None  # default: the input price
    cache_write: UsdPerMillion | None = None  # default: the input price
    reasoning: UsdPerMillion | None = None  # default: the output price

    def __post_init__(self) -> None:
        for name in ("input", "output", "cached_input", "cache_write", "reasoning"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                parse_usd_per_million(value)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None


class Pricing(StrictStruct):
    # Model glob -> prices; the first glob (in file order) matching the served model wins over the table.
    overrides: dict[str, PriceOverride] = {}
    # A model neither the overrides nor the table price: reject it, charge it nothing, or price it as
    # its nearest relative in the table.
    unpriced: Literal["reject", "zero", "estimate"] = "zero"

    def __post_init__(self) -> None:
        for glob in self.overrides:
            if not glob.strip():
                raise ValueError("overrides: a model glob must not be empty")
            if len(glob) > MAX_GLOB:
                raise ValueError(f"overrides: a model glob must be at most {MAX_GLOB} characters")
