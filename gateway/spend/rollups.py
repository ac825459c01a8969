"""Daily spend rollups (docs/pricing.md, "Spend reports"): the Valkey key layout, the in-memory batch a
worker accumulates between flushes, and the commands one flush sends. Pure: no I/O, no clock.

Layout, in the quota backend's Valkey (or the ``auth.store`` one without a quota block):

    gridgate:spend:{YYYY-MM-DD}:<tenant>     hash, one per UTC day and tenant
        field  "<counter>\\x1f<key>\\x1f<model>"  ->  integer
    gridgate:spend:{YYYY-MM-DD}:tenants      set: the tenants that have a hash that day

``<counter>`` is one letter per column (``COUNTERS``); ``<key>`` is a managed key's kid, a YAML key's
alias, ``-`` (a YAML key without alias, or no auth), or for a subject (docs/identity.md) its identity and
the subject joined by ``\x1e`` (``jwt:okta\x1ealice``, ``mtls\x1espiffe://...``); ``<model>`` the model that served, last so
that any character it holds splits nothing. The day in braces is a Cluster hash tag: one day's hashes
live in one slot, so a report reads a day in one pipeline batch. A report over N days reads the N
``tenants`` sets (one pipelined round trip), then one hash per (day, tenant) it needs (a second
one): two round trips whatever the range, and with a tenant filter the first is skipped.

Every key expires ``RETENTION_DAYS`` + ``SLACK_DAYS`` after the start of its day (``EXPIREAT``, set
again by each flush that touches it: the same instant every time). A flush is one script per day it
covers, applied once per flush id, so retrying a flush whose reply was lost never counts it twice.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from gateway.identity.auth import SUBJECT_SEPARATOR

PREFIX = "gridgate:spend:"
RETENTION_DAYS = 400
SLACK_DAYS = 2  # a key outlives its 400 days by this much, so a report of the 400th day still finds it
DAY_S = 86_400
SEPARATOR = "\x1f"  # between the parts of a hash field: no tenant, kid or alias holds it
NO_KEY = "-"
# The columns of a rollup row, in order, and the one-letter counter of each in the hash fields.
# The last three: response cache hits (docs/cache.md; not among ``requests``, which reached a provider), and
# the tokens and nano-USD they saved.
COLUMNS = ("requests", "tokens_prompt", "tokens_cached", "tokens_completion", "tokens_reasoning", "cost_nusd",
           "cache_hits", "saved_tokens", "saved_nusd")
COUNTERS = ("r", "p", "c", "o", "x", "n", "h", "s", "v")
_COLUMN_OF = {letter: index for index, letter in enumerate(COUNTERS)}
MAX_CELLS = 20_000  # distinct (day, tenant, key, model) cells a worker holds between flushes, at most


def day_text(day: int) -> str:
    """Days since the epoch -> ``YYYY-MM-DD`` (UTC)."""
    return (dt.date(1970, 1, 1) + dt.timedelta(days=day)).isoformat()


def day_number(text: str) -> int:
    """``YYYY-MM-DD`` -> days since the epoch; ValueError when it is no such date."""
    return (dt.date.fromisoformat(text) - dt.date(1970, 1, 1)).days if len(text) == 10 else _invalid(text)


def _invalid(text: str) -> int:
    raise ValueError(f"{text!r} is not a date YYYY-MM-DD")


def tenant_hash(day: int, tenant: str) -> str:
    return f"{PREFIX}{{{day_text(day)}}}:{tenant}"


def tenants_set(day: int) -> str:
    return f"{PREFIX}{{{day_text(day)}}}:tenants"


def expires_at(day: int) -> int:
    """The epoch second a day's keys expire at."""
    return (day + RETENTION_DAYS + SLACK_DAYS) * DAY_S


Cell = tuple[int, str, str, str]  # (day, tenant, key, model)


class RollupBatch:
    """What a worker accumulated since its last flush: per cell, the ``COLUMNS``."""

    __slots__ = ("cells",)

    def __init__(self) -> None:
        self.cells: dict[Cell, list[int]] = {}

    def __len__(self) -> int:
        return len(self.cells)

    def add(self, cell: Cell, prompt: int, cached: int, completion: int, reasoning: int, cost: int) -> bool:
        """Count one request; False when the cell is new and the batch is full (``MAX_CELLS``: the store
        has been down a while), and the request is not rolled up. ``SpendTracker.count`` (per request)
        writes out the known-cell half of it: change both together."""
        counts = self.cells.get(cell)
        if counts is None:
            if len(self.cells) >= MAX_CELLS:
                return False
            self.cells[cell] = [1, prompt, cached, completion, reasoning, cost, 0, 0, 0]
            return True
        counts[0] += 1
        counts[1] += prompt
        counts[2] += cached
        counts[3] += completion
        counts[4] += reasoning
        counts[5] += cost
        return True

    def add_hit(self, cell: Cell, saved_tokens: int, saved_nusd: int) -> bool:
        """Count one response cache hit and what it saved (False: a new cell, and the batch is full)."""
        counts = self.cells.get(cell)
        if counts is None:
            if len(self.cells) >= MAX_CELLS:
                return False
            counts = self.cells[cell] = [0] * len(COLUMNS)
        counts[6] += 1
        counts[7] += saved_tokens
        counts[8] += saved_nusd
        return True

    def scripts(self, flush_id: str) -> list[tuple[str | int, ...]]:
        """The flush: per day, one EVAL of ``APPLY_SCRIPT`` (its keys share the day's slot) that adds
        every non-zero counter with HINCRBY, sets each touched key's EXPIREAT and the day's tenants
        set, once: a ``flush_id`` it already applied (a retry after a lost reply) changes nothing."""
        days: dict[int, dict[str, list[str | int]]] = {}
        for (day, tenant, key, model), counts in self.cells.items():
            fields = days.setdefault(day, {}).setdefault(tenant, [])
            suffix = f"{SEPARATOR}{key}{SEPARATOR}{model}"
            for letter, value in zip(COUNTERS, counts, strict=True):
                if value:
                    fields += (letter + suffix, value)
        commands: list[tuple[str | int, ...]] = []
        for day, tenants in days.items():
            keys = [flush_marker(day, flush_id), tenants_set(day), *(tenant_hash(day, tenant) for tenant in tenants)]
            args: list[str | int] = [expires_at(day)]
            for tenant, fields in tenants.items():
                args += (tenant, len(fields) // 2, *fields)
            commands.append(("EVAL", APPLY_SCRIPT, len(keys), *keys, *args))
        return commands


# KEYS: the flush's marker, the day's tenants set, then one hash per tenant; ARGV: the EXPIREAT second,
# then per hash: its tenant, its number of fields, and the (field, increment) pairs.
APPLY_SCRIPT = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', 86400) then return 0 end
local expire_at = ARGV[1]
local at = 2
for index = 3, #KEYS do
  local tenant, count = ARGV[at], tonumber(ARGV[at + 1])
  at = at + 2
  for _ = 1, count do
    redis.call('HINCRBY', KEYS[index], ARGV[at], ARGV[at + 1])
    at = at + 2
  end
  redis.call('EXPIREAT', KEYS[index], expire_at)
  redis.call('SADD', KEYS[2], tenant)
end
redis.call('EXPIREAT', KEYS[2], expire_at)
return 1
"""


def flush_marker(day: int, flush_id: str) -> str:
    """The key that says a flush was applied (kept a day: retries come within seconds)."""
    return f"{PREFIX}{{{day_text(day)}}}:flush:{flush_id}"


@dataclass(frozen=True, slots=True)
class RollupRow:
    """One stored cell of one day, read back."""

    day: int
    tenant: str
    key: str
    model: str
    counts: tuple[int, ...]  # COLUMNS
    identity: str = ""  # a subject's identity (``jwt:<issuer>``, ``mtls``; its subject is ``key``); "" for a key


def parse_hash(day: int, tenant: str, fields: dict[bytes, bytes]) -> list[RollupRow]:
    """A tenant hash's fields -> one row per (key, model); unknown fields are skipped."""
    rows: dict[tuple[str, str], list[int]] = {}
    for raw_field, raw_value in fields.items():
        text = raw_field.decode("utf-8", "replace")
        parts = text.split(SEPARATOR, 2)
        if len(parts) != 3 or parts[0] not in _COLUMN_OF:
            continue
        try:
            value = int(raw_value)
        except ValueError:
            continue
        counts = rows.setdefault((parts[1], parts[2]), [0] * len(COLUMNS))
        counts[_COLUMN_OF[parts[0]]] += value
    return [_row(day, tenant, key, model, counts) for (key, model), counts in rows.items()]


def _row(day: int, tenant: str, key: str, model: str, counts: list[int]) -> RollupRow:
    identity, separator, subject = key.partition(SUBJECT_SEPARATOR)
    if separator:
        return RollupRow(day, tenant, subject, model, tuple(counts), identity)
    return RollupRow(day, tenant, key, model, tuple(counts))
