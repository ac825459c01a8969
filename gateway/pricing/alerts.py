"""Spend alerts, each threshold of a USD budget once per period (docs/limits.md). ``publish_alert`` must
never block; this body only keeps them: the reporting side replaces it with the webhook sender."""

from __future__ import annotations

import msgspec


class SpendAlert(msgspec.Struct, frozen=True):
    tenant: str
    scope: str  # "rule team-a" | "key <kid or alias>"
    budget: str  # "$5.00/1d"
    period_start: str  # RFC 3339
    threshold: float
    spent_nusd: int
    limit_nusd: int


published: list[SpendAlert] = []


def publish_alert(alert: SpendAlert) -> None:
    published.append(alert)
