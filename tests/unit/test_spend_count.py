"""``SpendTracker.count`` (once per request) writes out ``RollupBatch.add`` for the cells its batch holds:
its rollups must be those of the general path (every request through ``RollupBatch.add``), cell for
cell and column for column, with or without a store, and with the batch full."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import Pricing
from gateway.identity.auth import KeyIdentity
from gateway.pricing.table import shipped_table
from gateway.spend import rollups
from gateway.spend.alerts import install_outbox
from gateway.spend.price_book import PriceBook
from gateway.spend.rollups import DAY_S, NO_KEY, RollupBatch
from workers import spend_tracker
from workers.request_record import RequestRecord
from workers.spend_tracker import SpendTracker

NOW = 1_780_000_000.5


def general_count(batch: RollupBatch, record: RequestRecord, with_store: bool) -> bool:
    """The general path: what ``SpendTracker.count`` did through ``RollupBatch.add`` (False: dropped)."""
    model = record.served
    reached_provider = record.reached or record.attempt is not None  # workers/request_record.py
    if model is None or not reached_provider or (not with_store and not record.cost_nusd):
        return True
    exchange = record.exchange
    admitted = None if exchange is None else exchange.admitted
    identity = None if admitted is None else admitted.key
    key = (identity.kid or identity.alias or NO_KEY) if identity is not None else NO_KEY
    if identity is not None and identity.via in ("jwt:okta", "mtls"):  # a subject: its identity's name with it
        key = f"{identity.via}\x1e{key}"
    cell = (int(NOW // DAY_S), record.tenant or NO_KEY, key, model)
    return batch.add(cell, record.tokens_prompt or 0, record.tokens_cached or 0, record.tokens_completion or 0,
                     record.tokens_reasoning or 0, record.cost_nusd or 0)


def exchange(kid: str | None, alias: str | None, via: str | None = None) -> Any:
    if kid is None and alias is None:
        return SimpleNamespace(admitted=None)
    return SimpleNamespace(admitted=SimpleNamespace(key=KeyIdentity("acme", alias, kid, via=via)))


def records(count: int) -> list[RequestRecord]:
    pick = random.Random(7)
    tokens = (None, 0, 1, 250, 10_000)
    made = []
    for _ in range(count):
        made.append(RequestRecord(
            tenant=pick.choice((None, "acme", "globex")),
            capability=pick.choice((None, "gpt-4o", "m")),
            served_model=pick.choice((None, None, "fallback")),
            reached=pick.random() < 0.3,
            attempt=pick.choice((None, object(), object())),
            exchange=pick.choice((None, exchange("k1", None), exchange(None, "ops"), exchange(None, None),
                                  exchange(None, "alice", "jwt:okta"), exchange(None, "spiffe://a", "mtls"),
                                  exchange("k2", None, "previous_secret"))),
            tokens_prompt=pick.choice(tokens), tokens_cached=pick.choice(tokens),
            tokens_completion=pick.choice(tokens), tokens_reasoning=pick.choice(tokens),
            cost_nusd=pick.choice((None, 0, 0, 17, 350_000)),
        ))
    return made


@pytest.mark.parametrize(("store", "max_cells"), [("redis://127.0.0.1:1", 20_000), (None, 20_000),
                                                  ("redis://127.0.0.1:1", 5)])
def test_counted_rollups_are_those_of_the_general_path(monkeypatch: pytest.MonkeyPatch, store: str | None,
                                                       max_cells: int) -> None:
    monkeypatch.setattr(spend_tracker, "_time", lambda: NOW)
    monkeypatch.setattr(rollups, "MAX_CELLS", max_cells)
    tracker = SpendTracker(PriceBook.from_config(Pricing(), shipped_table()),
                           None, store)
    try:
        general, dropped = RollupBatch(), 0
        for record in records(5_000):
            tracker.count(record)
            dropped += not general_count(general, record, store is not None)
        assert tracker.batch.cells == general.cells
        assert tracker.cells_dropped == dropped
        assert len(general.cells) >= min(max_cells, 10)  # many cells, several rows each
        assert dropped if max_cells == 5 else not dropped
    finally:
        install_outbox(None)
