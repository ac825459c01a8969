"""A response cache hit's record closes through ``HitEnds`` (workers/outcomes.py), its request counted with
the hit (``WorkerMetrics.hit_answered``), its savings rolled up by ``SpendTracker.count_hit``. Together
they must leave what ``Outcomes.close`` leaves for the same record, plus the hit's own cells: the metrics
row (its request under the gateway's 200s), the spend rollup (what it saved, in a new cell and in one the
batch holds), the line the access log keeps and the console's ring."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import Cooling
from gateway.identity.auth import KeyIdentity
from gateway.metrics.catalogue import CACHE_TENANT, COUNTERS, OTHER_TENANT
from gateway.metrics.writer import WorkerMetrics
from workers.outcomes import HitEnds, Outcomes
from workers.recent_requests import RequestRing
from workers.request_record import RequestRecord
from workers.spend_tracker import SpendTracker


class World:
    def __init__(self, store: str | None, traced: bool) -> None:
        self.row = [0] * COUNTERS
        self.metrics = WorkerMetrics(self.row, ["c"], ["acme"])
        self.lines: list[RequestRecord] = []
        self.traced: list[tuple[str | None, Any]] = []
        self.spend = SpendTracker(None, None, store)
        self.outcomes = Outcomes(None, self.metrics, SimpleNamespace(record=self.lines.append),  # type: ignore[arg-type]
                                 None, Cooling(), True, None, self.spend)  # type: ignore[arg-type]
        self.outcomes.recent = RequestRing()
        self.is_traced = traced

    def record(self, tenant: str, saved_tokens: int | None, saved_nusd: int | None) -> RequestRecord:
        exchange = SimpleNamespace(admitted=SimpleNamespace(key=KeyIdentity(tenant, "ops")), client_gone=False,
                                   t_start=1.0, t_first_byte=1.001, method=b"POST", target=b"/v1/chat/completions",
                                   body=b"{}", bytes_out=321, record=None)
        trace = SimpleNamespace(end=lambda record, result: self.traced.append((record.cache, result)))
        return RequestRecord(exchange=exchange, ends=self.outcomes, request_id=b"r-1", tenant=tenant,
                             capability="m", status=200, cost_nusd=0, cache="hit", saved_tokens=saved_tokens,
                             saved_nusd=saved_nusd, trace=trace if self.is_traced else None)

    def state(self) -> dict[str, Any]:
        return {"rollups": dict(self.spend.batch.cells), "dropped": self.spend.cells_dropped,
                "lines": [(line.cache, line.status, line.saved_tokens, line.saved_nusd, line.bytes_out)
                          for line in self.lines],
                "traced": self.traced, "recent": len(self.outcomes.recent.pending())}  # type: ignore[union-attr]


@pytest.mark.parametrize("tenant", ["acme", "unknown-tenant"])
@pytest.mark.parametrize("saved", [(12, 3400), (None, None), (5, 0)])
@pytest.mark.parametrize("store", ["redis://127.0.0.1:1", None])
@pytest.mark.parametrize("traced", [False, True])
def test_hit_ends_leaves_what_outcomes_close_leaves(tenant: str, saved: tuple[Any, Any], store: str | None,
                                                    traced: bool) -> None:
    general, hit = World(store, traced), World(store, traced)
    for _ in range(2):  # a new rollup cell, then one the batch holds
        general.record(tenant, *saved).close()  # the general path: Outcomes.close
        record = hit.record(tenant, *saved)
        hit.metrics.hit_answered(tenant, saved[1])
        record.ends = HitEnds(hit.outcomes)
        record.close()
    assert hit.state() == general.state()
    at = CACHE_TENANT + hit.metrics.tenant_index.get(tenant, OTHER_TENANT) * 3  # the tenant's hits cell
    expected = {at: (0, 2), **({at + 2: (0, 2 * saved[1])} if saved[1] else {})}
    differing = {index: (general.row[index], hit.row[index]) for index in range(COUNTERS)
                 if general.row[index] != hit.row[index]}
    assert differing == expected  # the hit's own cells, and nothing else (its request counted the same)
