"""The price table shipped in the repo: it loads, it says where it comes from, and it holds the prices
of the providers' own price pages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.pricing import generate
from gateway.pricing.cost import ModelPrice, request_cost, worst_case_cost
from gateway.pricing.table import COLUMNS, PriceTableError, parse_table, shipped_table
from gateway.pricing.units import parse_usd_per_million

DATA = Path(generate.__file__).resolve().parent / "data"


def per_million(usd: str) -> int:
    return parse_usd_per_million(usd)


def price_of(model: str) -> ModelPrice:
    rows = shipped_table().get(model)
    assert rows is not None, f"{model} is not in the table"
    return ModelPrice.of(model, "table", rows)


def test_the_shipped_table_records_its_pinned_source_and_license() -> None:
    table = shipped_table()
    assert table.source_version == generate.LITELLM_VERSION
    assert table.source_sha256 == generate.LITELLM_SHA256
    assert len(table) > 1000
    notice = (DATA / "NOTICE").read_text()
    assert f"litellm {generate.LITELLM_VERSION}" in notice and generate.LITELLM_SHA256 in notice
    assert "MIT License" in notice and "Copyright (c) 2023 Berri AI" in notice


def test_gpt_4o_costs_what_openai_s_price_page_says() -> None:
    # openai.com/api/pricing: gpt-4o input $2.50, cached input $1.25, output $10.00 per 1M tokens
    price = price_of("gpt-4o")
    assert (price.base.input, price.base.cached_input, price.base.output) == (
        per_million("2.50"), per_million("1.25"), per_million("10.00"))
    # 10,000 prompt tokens of which 2,000 cached, 1,000 completion tokens:
    # 8,000 x $2.50 + 2,000 x $1.25 + 1,000 x $10 per million = $0.0325
    assert request_cost(price, 10_000, 1_000, cached_tokens=2_000) == 32_500_000


def test_claude_cache_reads_and_writes_have_their_own_prices() -> None:
    # anthropic.com/pricing: Sonnet 4.5 input $3, 5-minute cache writes $3.75, cache hits $0.30, output $15
    price = price_of("claude-sonnet-4-5")
    assert (price.base.input, price.base.cache_write, price.base.cached_input, price.base.output) == (
        per_million("3"), per_million("3.75"), per_million("0.30"), per_million("15"))


def test_gemini_2_5_pro_is_dearer_above_200k_prompt_tokens() -> None:
    # ai.google.dev/pricing: input $1.25 (prompts <= 200k tokens) / $2.50 (> 200k); output $10 / $15
    price = price_of("gemini-2.5-pro")
    assert request_cost(price, 200_000, 1_000) == 200_000 * 1_250 + 1_000 * 10_000
    assert request_cost(price, 200_001, 1_000) == 200_001 * 2_500 + 1_000 * 15_000
    assert worst_case_cost(price, 250_000, 0) >= request_cost(price, 250_000, 0)


def test_a_reasoning_price_of_its_own_is_kept() -> None:
    # Alibaba Model Studio: qwen-plus, thinking output dearer than plain output, and a tier above 256k
    price = price_of("dashscope/qwen-plus-latest")
    assert price.base.reasoning > price.base.output
    assert request_cost(price, 10, 1_000, reasoning_tokens=1_000) > request_cost(price, 10, 1_000)
    assert price.tier(256_001).input > price.tier(256_000).input


def test_embedding_models_are_priced_by_their_input() -> None:
    price = price_of("text-embedding-3-small")  # $0.02 per 1M tokens
    assert request_cost(price, 1_000_000, 0) == 20_000_000


def test_the_file_is_one_model_per_line_sorted() -> None:
    lines = (DATA / "prices.json").read_text().splitlines()
    model_lines = [line for line in lines if line.startswith("    ")]
    names = [json.loads("{" + line.rstrip(",") + "}").popitem()[0] for line in model_lines]
    assert names == sorted(names) and len(names) == len(shipped_table())


def _file(models: object, **header: object) -> bytes:
    document = {"format": 1, "source": "s", "source_version": "v", "source_sha256": "h", "license": "MIT",
                "unit": "nano-USD per million tokens", "columns": COLUMNS, "models": models} | header
    return json.dumps(document).encode()


@pytest.mark.parametrize(("data", "problem"), [
    (b"{", "price table"),
    (_file({"m": [[0, 1, 2, 3, 4]]}), "price table"),  # a column missing
    (_file({"m": [[0, -1, 2, 3, 4, 5]]}), "price table"),  # a negative price
    (_file({"m": [[0, 1.5, 2, 3, 4, 5]]}), "price table"),  # not an integer
    (_file({"m": []}), "m: the first tier must start at 0"),
    (_file({"m": [[5, 1, 2, 3, 4, 5]]}), "m: the first tier must start at 0"),
    (_file({"m": [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]}), "m: tiers must be in ascending order"),
    (_file({}, unit="USD per token"), "expected unit"),
    (_file({}, format=2), "price table"),
    (_file({}, extra=1), "price table"),
])
def test_a_damaged_table_is_refused_saying_why(data: bytes, problem: str) -> None:
    with pytest.raises(PriceTableError, match=problem):
        parse_table(data)


def test_a_table_of_tiers_loads() -> None:
    table = parse_table(_file({"m": [[0, 1, 2, 3, 4, 5], [1000, 6, 7, 8, 9, 10]]}))
    rows = table.get("m")
    assert rows is not None and [row.from_prompt_tokens for row in rows] == [0, 1000]
    assert table.get("other") is None
