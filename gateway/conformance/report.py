"""The verify report: a table a person reads, or JSON for scripts; and the exit decision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.conformance.probe import FAIL, PASS
from gateway.conformance.runner import TargetReport

_MARK = {PASS: "pass", FAIL: "FAIL", "skipped": "skip"}


def total_tokens(reports: Sequence[TargetReport]) -> int:
    return sum(r.tokens for report in reports for r in report.results)


def all_conformant(reports: Sequence[TargetReport]) -> bool:
    return all(report.conformant for report in reports)


def table(reports: Sequence[TargetReport]) -> str:
    lines = []
    width = max((len(r.check) for report in reports for r in report.results), default=8)
    for report in reports:
        t = report.target
        verdict = "conformant" if report.conformant else "NOT conformant: " + ", ".join(report.failed)
        lines.append(f"{t.cluster} {t.address} model {t.model}: {verdict}")
        for r in report.results:
            optional = "" if r.required else " (informational)"
            lines.append(f"  {_MARK[r.status]:4}  {r.check:{width}}  {r.reason}{optional}")
    ok = sum(report.conformant for report in reports)
    lines.append(f"{ok} of {len(reports)} endpoints conformant; tokens spent: {total_tokens(reports)}")
    return "\n".join(lines)


def as_json(reports: Sequence[TargetReport]) -> dict[str, Any]:
    return {
        "conformant": all_conformant(reports),
        "tokens": total_tokens(reports),
        "endpoints": [{"cluster": r.target.cluster, "endpoint": r.target.address, "model": r.target.model,
                       "conformant": r.conformant, "checks": [x.as_dict() for x in r.results]} for r in reports],
    }
