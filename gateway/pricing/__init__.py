"""Prices and the cost of requests, in integer nano-USD (docs/pricing.md). Pure, no I/O but the
table's one read.

    units     nano-USD, prices per million tokens, exact conversions, the one rounding
    cost      ModelPrice (tiers by prompt size), request_cost, worst_case_cost
    table     the shipped price table (data/prices.json) and its loader
    period    the calendar periods of USD budgets (1d, 1w, 1mo in a time zone) and their ids
    generate  `make prices`: the table regenerated from the pinned LiteLLM release

The price book (overrides, table, unpriced policy: the lookup the request path calls) is
gateway/spend/price_book.py.
"""
