"""Runs the checks against targets: one check at a time per target, each within its own deadline.

Bounded on purpose: the requests of one check share ``timeout_s``, each asks for at most
``max_tokens`` output tokens, and the tokens each answer reports (or, without usage, the estimate)
are added up so the operator sees what the run cost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from gateway.conformance.checks import CHECKS, Check
from gateway.conformance.client import send
from gateway.conformance.judging import Problem, usage_tokens
from gateway.conformance.probe import FAIL, PASS, SKIPPED, Answer, Probe, Result, Target
from gateway.conformance.sse import parse_stream


@dataclass(slots=True)
class TargetReport:
    target: Target
    results: list[Result] = field(default_factory=list)

    @property
    def conformant(self) -> bool:
        """Every required check passed or did not apply."""
        return all(r.status != FAIL for r in self.results if r.required)

    @property
    def failed(self) -> list[str]:
        return [r.check for r in self.results if r.required and r.status == FAIL]


def answer_tokens(probe: Probe, answer: Answer) -> int:
    """Tokens one answer cost: its usage, else the probe's estimate; a refusal costs nothing."""
    if answer.status != 200:
        return 0
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        found = [usage_tokens(_json(event.data)) for event in parse_stream(answer.body).events]
        counted = [n for n in found if n is not None]
        return max(counted) if counted else probe.estimated_tokens
    counted = usage_tokens(_json(answer.body))
    return probe.estimated_tokens if counted is None else counted


def _json(data: bytes | str) -> object:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None


async def run_check(check: Check, target: Target, max_tokens: int, timeout_s: float) -> Result:
    reason = check.skip(target)
    if reason is not None:
        return Result(check.name, SKIPPED, reason, check.required)
    deadline = time.monotonic() + timeout_s
    answers, tokens = [], 0
    for probe in check.probes(target, max_tokens):
        answer = await send(target, probe, max(0.01, deadline - time.monotonic()))
        if answer.error is not None:
            return Result(check.name, FAIL, f"{probe.method} {probe.path}: {answer.error}", check.required, tokens)
        tokens += answer_tokens(probe, answer)
        answers.append(answer)
    try:
        reason, details = check.judge(target, answers)
    except Problem as exc:
        return Result(check.name, FAIL, str(exc), check.required, tokens)
    return Result(check.name, PASS, reason, check.required, tokens, details)


async def verify_target(target: Target, *, max_tokens: int, timeout_s: float,
                        checks: Sequence[Check] = CHECKS) -> TargetReport:
    report = TargetReport(target)
    for check in checks:
        report.results.append(await run_check(check, target, max_tokens, timeout_s))
    return report


async def verify(targets: Sequence[Target], *, max_tokens: int, timeout_s: float,
                 checks: Sequence[Check] = CHECKS) -> list[TargetReport]:
    """Every target, side by side (each target's checks in order: a provider sees one request at a time)."""
    return list(await asyncio.gather(*(verify_target(t, max_tokens=max_tokens, timeout_s=timeout_s, checks=checks)
                                       for t in targets)))
