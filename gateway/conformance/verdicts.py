"""From endpoint reports to one verdict per provider: the unit the pool keeps in or out (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.conformance.probe import FAIL
from gateway.conformance.runner import TargetReport


@dataclass(frozen=True, slots=True)
class ProviderVerdict:
    """A provider is conformant when every required check passed (or did not apply) on every endpoint
    and for every model: one endpoint that breaks a promise breaks it for the requests sent there."""

    cluster: str
    conformant: bool
    checked_at: float  # wall-clock seconds of the run
    failures: tuple[str, ...] = ()  # "check (endpoint, model): reason"
    tokens: int = 0
    failed_checks: frozenset[str] = field(default_factory=frozenset)

    def as_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "status": "conformant" if self.conformant else "nonconformant",
                "failed_checks": sorted(self.failed_checks), "failures": list(self.failures),
                "tokens": self.tokens}


def provider_verdicts(reports: Sequence[TargetReport], checked_at: float) -> dict[str, ProviderVerdict]:
    by_cluster: dict[str, list[TargetReport]] = {}
    for report in reports:
        by_cluster.setdefault(report.target.cluster, []).append(report)
    verdicts = {}
    for cluster, group in by_cluster.items():
        failures = tuple(f"{r.check} ({report.target.address}, {report.target.model}): {r.reason}"
                         for report in group for r in report.results if r.required and r.status == FAIL)
        checks = frozenset(r.check for report in group for r in report.results if r.required and r.status == FAIL)
        tokens = sum(r.tokens for report in group for r in report.results)
        verdicts[cluster] = ProviderVerdict(cluster, not failures, checked_at, failures, tokens, checks)
    return verdicts
