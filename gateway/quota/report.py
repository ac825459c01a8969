"""``/admin/quota?tenant=T``: what the ledger holds for a tenant, read for the admin page."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from gateway.quota.backend import BACKEND_ERRORS, describe_error
from gateway.quota.ledger import QuotaLedger
from gateway.quota.rules import RuleSet


class QuotaBackendUnavailable(Exception):
    """Valkey could not answer in time (the admin page answers 503)."""


async def quota_report(ledger: QuotaLedger, rules: RuleSet, tenant: str, timeout_s: float = 1.0) -> dict[str, Any]:
    """Per rule that can apply to ``tenant``, per window: used, reserved, remaining, reset (seconds).
    Raises ``QuotaBackendUnavailable`` if Valkey cannot answer within ``timeout_s``."""
    reports = []
    try:
        async with asyncio.timeout(timeout_s):
            for rule in rules.rules_for_tenant(tenant):
                report = await ledger.report(rule, tenant)
                reports.append({"rule": report.rule, "in_flight": report.in_flight,
                                "max_in_flight": report.max_in_flight,
                                "windows": [asdict(window) for window in report.windows]})
    except BACKEND_ERRORS as exc:
        raise QuotaBackendUnavailable(describe_error(exc)) from None
    return {"tenant": tenant, "rules": reports}
