"""The spend rollups on a real 3-node Valkey Cluster: one script per day (its keys share the day's hash
tag), applied once per flush id, and a report that reads days living on different nodes."""

from __future__ import annotations

import asyncio

from gateway.spend.report import parse_query, spend_report
from gateway.spend.rollups import RollupBatch, day_number, tenant_hash
from gateway.spend.store import read_rows, write_batch
from gateway.valkey.client import create_client
from tests.integration.test_quota_cluster import cluster_url  # noqa: F401 - the module's cluster fixture

DAYS = [day_number(f"2026-0{month}-1{index}") for month in (1, 3) for index in range(5)]


def test_rollups_are_written_once_and_read_back_across_the_cluster(cluster_url: str) -> None:  # noqa: F811
    assert len({tenant_hash(day, "t").split("}")[0] for day in DAYS}) == len(DAYS)  # ten hash tags

    async def scenario() -> dict:
        client = create_client(cluster_url, timeout_s=2.0)
        try:
            batch = RollupBatch()
            for day in DAYS:
                batch.add((day, "team-a", "ci", "gpt-4o"), 10, 2, 5, 1, 1000)
                batch.add((day, "team-b", "-", "m"), 1, 0, 1, 0, 7)
            await write_batch(client, batch, "cluster-1")
            await write_batch(client, batch, "cluster-1")  # a retry: applied once
            query = parse_query({"from": ["2026-01-01"], "to": ["2026-03-31"], "group_by": ["tenant"]}, DAYS[-1])
            by_tenant = spend_report(query, await read_rows(client, query))
            one = parse_query({"from": ["2026-01-01"], "to": ["2026-03-31"], "tenant": ["team-a"]}, DAYS[-1])
            by_day = spend_report(one, await read_rows(client, one))
            return {"tenant": by_tenant, "day": by_day}
        finally:
            await client.aclose()

    reports = asyncio.run(scenario())
    assert [(row["tenant"], row["requests"], row["cost_nusd"]) for row in reports["tenant"]["data"]] == [
        ("team-a", 10, 10_000), ("team-b", 10, 70)]
    assert len(reports["day"]["data"]) == 10 and reports["day"]["totals"]["tokens_cached"] == 20
