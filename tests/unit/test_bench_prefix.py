"""loadtest/bench_prefix.py's arithmetic: the request sequence, a request's cost, the summary."""

from __future__ import annotations

import json

from gateway.request.prefix import prompt_prefix
from loadtest.bench_prefix import request_body, sequence, summary, usd


def test_the_sequence_is_the_same_for_every_picker_and_users_keep_their_prompt():
    first, again = sequence(50, 40, 20), sequence(50, 40, 20)
    assert first == again and all(prompt == user % 20 for prompt, user in first)


def test_requests_of_one_prompt_share_a_prefix_and_prompts_differ_inside_the_hashed_bytes():
    assert prompt_prefix(request_body(3, 3, 0), 4096) == prompt_prefix(request_body(3, 23, 1), 4096)
    assert len({prompt_prefix(request_body(p, p, 0), 4096) for p in range(20)}) == 20
    assert len(json.loads(request_body(0, 0, 0))["messages"][0]["content"]) > 6000  # about 1,500 tokens


def test_cost_at_gpt_4o_prices():
    assert usd({"prompt": 1_000_000, "cached": 0, "completion": 0}) == 2.5
    assert usd({"prompt": 1_000_000, "cached": 1_000_000, "completion": 100_000}) == 1.25 + 1.0


def test_summary_counts_the_served_ones():
    results = [{"status": 200, "provider": "a", "mode": "prefix", "seconds": 0.1, "prompt": 100, "cached": 50,
                "completion": 10},
               {"status": 503, "provider": None, "mode": None, "seconds": 0.2, "prompt": 0, "cached": 0,
                "completion": 0}]
    row = summary("x", results, [], 1.0)
    assert (row["errors"], row["cached_share"], row["per_provider"], row["gateway_usd_per_1000"]) == (
        1, 0.5, {"a": 1}, None)
