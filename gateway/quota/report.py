"""``/admin/quota?tenant=T``: what the ledger holds for a tenant, read for the admin page.

Per rule that can apply to the tenant, and per key of the tenant with its own limits: request limits
(slots left now, seconds until every slot is back) beside token budgets (used, reserved, remaining, seconds
to the window's end), USD budgets (limit, spent and reserved this period in nano-USD, when it resets) and
requests in flight. One ledger call reads all of them (one hash slot).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from gateway.identity.limits import Scope
from gateway.quota.ledger import QuotaLedger
from gateway.quota.ledger_report import ScopeReport
from gateway.quota.rules import KeyLike, RuleSet, key_matches
from gateway.valkey.client import BACKEND_ERRORS, describe_error


class QuotaBackendUnavailable(Exception):
    """Valkey could not answer in time, or answered what the ledger cannot have written (503)."""


def _entries(items: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Dataclass rows as dicts; ``shadow`` only where a limit is one (the page shows enforced limits plainly)."""
    rows = []
    for item in items:
        row = asdict(item)
        if not row.pop("shadow"):
            rows.append(row)
        else:
            rows.append({**row, "shadow": True})
    return rows


def _scope_entry(report: ScopeReport) -> dict[str, Any]:
    name = {"rule": report.name} if report.kind == "rule" else {"key": report.name}
    entry = {**name, "in_flight": report.in_flight, "max_in_flight": report.max_in_flight,
             "requests": _entries(report.requests), "windows": _entries(report.windows)}
    if report.spend:
        entry["spend"] = [asdict(spend) for spend in report.spend]
    return entry


def spend_of(report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every USD budget of a ``quota_report``, each naming its owner (``key``, ``rule team-a``): the
    ``spend`` of ``GET /v1/gridgate/key``; None when none applies."""
    spend = [{"scope": "key" if "key" in entry else f"rule {entry['rule']}", **item}
             for entry in (*report["keys"], *report["rules"]) for item in entry.get("spend", ())]
    return spend or None


async def quota_report(ledger: QuotaLedger, rules: RuleSet, tenant: str, timeout_s: float = 1.0,
                       key_scopes: tuple[Scope, ...] = (), key: KeyLike | None = None) -> dict[str, Any]:
    """The tenant's rules (``rules``; with ``key``, only those that can apply to that key) and keys
    (``key_scopes``: the tenant's keys with limits). Raises ``QuotaBackendUnavailable`` if Valkey cannot
    answer within ``timeout_s``."""
    scopes = (*key_scopes, *(rule.scope for rule in rules.rules_for_tenant(tenant)
                             if key is None or rule.match_key is None or key_matches(rule.match_key, key)))
    try:
        async with asyncio.timeout(timeout_s):
            open_reservations, reports = await ledger.report(tenant, scopes)
    except BACKEND_ERRORS as exc:
        raise QuotaBackendUnavailable(describe_error(exc)) from None
    except ValueError as exc:
        raise QuotaBackendUnavailable(str(exc)) from None
    return {
        "tenant": tenant,
        "open_reservations": open_reservations,
        "rules": [_scope_entry(r) for r in reports if r.kind == "rule"],
        "keys": [_scope_entry(r) for r in reports if r.kind == "key"],
    }


def key_scopes_by_tenant(auth: Any) -> dict[str, tuple[Scope, ...]]:
    """The scopes of the configured keys that have limits, per tenant (``auth``: the config's, duck-typed)."""
    from gateway.identity.auth import Authenticator  # the one place a key's limits are read from the config
    from gateway.quota.ledger import scopes_of

    by_tenant: dict[str, tuple[Scope, ...]] = {}
    if auth is not None:
        for key in Authenticator.from_config(auth).identities():
            by_tenant[key.tenant] = by_tenant.get(key.tenant, ()) + scopes_of(None, key)
    return by_tenant
