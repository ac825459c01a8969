"""The rollups' reads and writes over a quota-backend client (``gateway.valkey.client.create_client``:
the lean single-node client or valkey-py's Cluster client; both take ``pipeline(transaction=False)``).

Commands go in pipelined batches of at most ``BATCH`` (the single-node client bounds what may be
outstanding), so a flush is one round trip (one script per day it covers) and a report of any range two (``gateway.spend.rollups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.spend.report import SpendQuery
from gateway.spend.rollups import RollupBatch, RollupRow, parse_hash, tenant_hash, tenants_set

BATCH = 4096


async def _pipelined(client: Any, commands: Sequence[tuple[str | int, ...]]) -> list[Any]:
    replies: list[Any] = []
    for start in range(0, len(commands), BATCH):
        pipe = client.pipeline(transaction=False)
        for command in commands[start:start + BATCH]:
            pipe.execute_command(*command)
        replies += await pipe.execute()
    return replies


async def write_batch(client: Any, batch: RollupBatch, flush_id: str) -> None:
    """One flush (applied once per ``flush_id``); raises the client's errors: the caller tries the same
    batch with the same id again later."""
    await _pipelined(client, batch.scripts(flush_id))


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _as_dict(reply: Any) -> dict[bytes, bytes]:
    """HGETALL's reply: a flat list (single-node client) or a dict (Cluster client)."""
    if isinstance(reply, dict):
        return reply
    if not reply:
        return {}
    return dict(zip(reply[0::2], reply[1::2], strict=True))


async def read_rows(client: Any, query: SpendQuery) -> list[RollupRow]:
    """The stored rows of the query's days (and tenant, when it names one); the other filters are the
    report's (``SpendQuery.keeps``)."""
    days = list(query.days)
    if query.tenant is not None:
        wanted = [(day, query.tenant) for day in days]
    else:
        members = await _pipelined(client, [("SMEMBERS", tenants_set(day)) for day in days])
        wanted = [(day, _text(tenant)) for day, tenants in zip(days, members, strict=True)
                  for tenant in sorted(tenants or ())]
    replies = await _pipelined(client, [("HGETALL", tenant_hash(day, tenant)) for day, tenant in wanted])
    rows: list[RollupRow] = []
    for (day, tenant), reply in zip(wanted, replies, strict=True):
        rows += parse_hash(day, tenant, _as_dict(reply))
    return rows
