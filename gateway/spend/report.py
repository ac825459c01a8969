"""``GET /admin/spend`` (docs/keys.md, docs/pricing.md): the query, checked, and the rows it reads,
grouped. Pure; the reads are ``gateway.spend.store.read_rows`` (the supervisor's ``SpendReporter``
calls both).

Query: ``tenant``, ``kid`` (the key column: a kid, an alias or ``-``), ``model``, ``from`` and ``to``
(UTC dates ``YYYY-MM-DD``, both included; default the last 30 days up to today; at most
``RETENTION_DAYS`` days; ``to`` >= ``from``), ``group_by`` (``day``, ``model``, ``key``, ``tenant`` or
``subject``; default ``day``). ``subject`` groups by the identity a JWT or a client certificate proved
(its ``identity`` and subject: ``alice`` of ``jwt:okta`` is not ``alice`` of ``jwt:corp``, nor a YAML
key's alias ``alice``); the requests of API keys and without auth are one row, subject ``-``. A bad value is a ``QueryProblem`` naming the parameter (400).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway.pricing.units import format_usd
from gateway.query_params import QueryProblem, single_params
from gateway.spend.rollups import COLUMNS, NO_KEY, RETENTION_DAYS, RollupRow, day_number, day_text

GROUPS = ("day", "model", "key", "tenant", "subject")
DEFAULT_DAYS = 30
PARAMETERS = ("tenant", "kid", "model", "from", "to", "group_by")
MAX_NAME = 256


@dataclass(frozen=True, slots=True)
class SpendQuery:
    first_day: int
    last_day: int
    group_by: str = "day"
    tenant: str | None = None
    key: str | None = None
    model: str | None = None

    @property
    def days(self) -> range:
        return range(self.first_day, self.last_day + 1)

    def keeps(self, row: RollupRow) -> bool:
        return ((self.tenant is None or row.tenant == self.tenant) and (self.key is None or row.key == self.key)
                and (self.model is None or row.model == self.model))


def parse_query(query: dict[str, list[str]], today: int) -> SpendQuery:
    """The page's query string (``parse_qs`` form) -> a ``SpendQuery``; ``today``: days since the epoch."""
    params = single_params(query, PARAMETERS)
    for name in ("tenant", "kid", "model"):
        value = params.get(name)
        if value is not None and not 0 < len(value) <= MAX_NAME:
            raise QueryProblem(f"{name}: must be 1..{MAX_NAME} characters")
    last = _date(params, "to", today)
    first = _date(params, "from", last - DEFAULT_DAYS + 1)
    if last < first:
        raise QueryProblem(f"to: {day_text(last)} is before from {day_text(first)}")
    if last - first + 1 > RETENTION_DAYS:
        raise QueryProblem(f"from: the range spans {last - first + 1} days; at most {RETENTION_DAYS} "
                           "(rollups are kept that long)")
    group_by = params.get("group_by", "day")
    if group_by not in GROUPS:
        raise QueryProblem(f"group_by: must be one of {', '.join(GROUPS)}")
    return SpendQuery(first, last, group_by, params.get("tenant"), params.get("kid"), params.get("model"))


def _date(params: dict[str, str], name: str, default: int) -> int:
    text = params.get(name)
    if text is None:
        return default
    try:
        return day_number(text)
    except ValueError:
        raise QueryProblem(f"{name}: must be a date YYYY-MM-DD, not {text!r}") from None


def _group_value(row: RollupRow, group_by: str) -> tuple[str, str]:
    """The group a row counts in: its name, and (``subject``) the identity that names it."""
    if group_by == "day":
        return day_text(row.day), ""
    if group_by == "model":
        return row.model, ""
    if group_by == "key":
        return row.key, ""
    if group_by == "subject":
        return (row.key, row.identity) if row.identity else (NO_KEY, "")
    return row.tenant, ""


def _group_fields(group_by: str, name: str, identity: str) -> dict[str, Any]:
    if group_by == "subject":
        return {"subject": name, "identity": identity or None}
    return {group_by: name}


def spend_report(query: SpendQuery, rows: Iterable[RollupRow]) -> dict[str, Any]:
    """The page's JSON: one row per group (sorted by it), each with the ``COLUMNS`` and ``cost_usd``
    (the exact decimal of ``cost_nusd``), then the totals."""
    groups: dict[tuple[str, str], list[int]] = {}
    totals = [0] * len(COLUMNS)
    for row in rows:
        if not query.keeps(row):
            continue
        counts = groups.setdefault(_group_value(row, query.group_by), [0] * len(COLUMNS))
        for index, value in enumerate(row.counts):
            counts[index] += value
            totals[index] += value
    return {
        "object": "gridgate.spend",
        "from": day_text(query.first_day),
        "to": day_text(query.last_day),
        "group_by": query.group_by,
        "filters": {"tenant": query.tenant, "kid": query.key, "model": query.model},
        "data": [{**_group_fields(query.group_by, *group), **_columns(counts)} for group, counts in sorted(groups.items())],
        "totals": _columns(totals),
    }


def _columns(counts: list[int]) -> dict[str, Any]:
    values: dict[str, Any] = dict(zip(COLUMNS, counts, strict=True))
    values["cost_usd"] = format_usd(counts[COLUMNS.index("cost_nusd")])
    values["saved_usd"] = format_usd(counts[COLUMNS.index("saved_nusd")])  # by response cache hits
    return values


TABLE_COLUMNS = (("requests", "requests"), ("prompt", "tokens_prompt"), ("cached", "tokens_cached"),
                 ("completion", "tokens_completion"), ("reasoning", "tokens_reasoning"), ("cost_usd", "cost_usd"),
                 ("hits", "cache_hits"), ("saved", "saved_usd"))


def spend_table(report: dict[str, Any]) -> str:
    """The report as an aligned table (``gridgate spend``): one line per group, the totals last; the
    group column (with ``subject``: and the identity's) left-aligned, the numbers right-aligned."""
    group = report["group_by"]
    named = [group, "identity"] if group == "subject" else [group]  # a subject beside the identity it is of
    lines = [[*named, *(title for title, _ in TABLE_COLUMNS)]]
    lines += [[*(str(row[name] or "-") for name in named), *(str(row[name]) for _, name in TABLE_COLUMNS)]
              for row in report["data"]]
    lines.append(["total", *([""] * (len(named) - 1)), *(str(report["totals"][name]) for _, name in TABLE_COLUMNS)])
    widths = [max(len(line[index]) for line in lines) for index in range(len(lines[0]))]
    rule = "  ".join("-" * width for width in widths)
    text = ["  ".join(cell.ljust(width) if index < len(named) else cell.rjust(width)
                      for index, (cell, width) in enumerate(zip(line, widths, strict=True))).rstrip()
            for line in lines]
    return "\n".join([*text[:-1], rule, text[-1]])
