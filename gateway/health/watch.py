"""The supervisor's watch over the health process (docs/operations.md, "The health process").

The health process writes its heartbeat into shared memory every poll (0.1 s) while its loop runs.
The supervisor reads it every tick:

- older than ``VERDICT_MAX_AGE_S``: the verdicts are too old to trust. The supervisor raises the
  ``verdicts_stale`` flag (shm.counters) and every worker reads every endpoint as unknown, that is
  routable at full weight, as without health checks; passive failures still move each request to
  another endpoint. The flag drops at the first tick that sees a fresh heartbeat again.
- older than ``HUNG_AFTER_S`` (or no heartbeat of its own ``BOOT_GRACE_S`` after it was forked): the
  process is hung (stopped, deadlocked, its loop blocked). It is killed, and replaced like a dead one
  once reaped; the replacement adopts the published records, so an ejected endpoint stays ejected.

Readers stop trusting first and the killer acts later: a prober that merely stalled for a few seconds
(a swap storm, a stopped-and-continued process) gets its chance to come back before it is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

from shm.counters import HealthTable
from shm.segment import Segment

VERDICT_MAX_AGE_S = 3.0  # thirty missed beats
HUNG_AFTER_S = 6.0
BOOT_GRACE_S = 20.0  # from fork to the first heartbeat (imports, the first poll)


@dataclass(frozen=True, slots=True)
class HealthWatchVerdict:
    age_s: float | None  # seconds since the last heartbeat; None: no health process ever beat
    stale: bool  # the verdicts are not to be trusted
    hung: bool  # the watched child should be killed


def judge(writer_pid: int, beat_ns: int, now_ns: int, child_pid: int | None = None,
          child_started_ns: int = 0) -> HealthWatchVerdict:
    """What the supervisor makes of the health header (pure). ``child_pid``: the live health child, if
    any; a heartbeat written by an earlier process does not count as the child's own."""
    age = (now_ns - beat_ns) / 1e9 if writer_pid else None
    stale = age is not None and age > VERDICT_MAX_AGE_S
    hung = False
    if child_pid is not None:
        if writer_pid == child_pid:
            hung = age is not None and age > HUNG_AFTER_S
        else:
            hung = (now_ns - child_started_ns) / 1e9 > BOOT_GRACE_S
    return HealthWatchVerdict(age, stale, hung)


class HealthWatch:
    """The supervisor's side: reads the heartbeat, keeps the stale flag, counts the hangs it found."""

    def __init__(self, segment: Segment) -> None:
        self._table = HealthTable(segment)
        self.hangs_total = 0
        self._judged_hung: int | None = None  # the pid last found hung (it is killed once)

    def check(self, now_ns: int, child_pid: int | None = None, child_started_ns: int = 0) -> HealthWatchVerdict:
        """Judge the heartbeat, keep the stale flag in step; ``hung`` is True once per hung child."""
        writer_pid, beat_ns = self._table.writer()
        verdict = judge(writer_pid, beat_ns, now_ns, child_pid, child_started_ns)
        if verdict.stale != self._table.stale():
            self._table.mark_stale(verdict.stale)
        if verdict.hung:
            if child_pid == self._judged_hung:
                return HealthWatchVerdict(verdict.age_s, verdict.stale, False)
            self._judged_hung = child_pid
            self.hangs_total += 1
        return verdict

    def stale(self) -> bool:
        return self._table.stale()

    def writer_pid(self) -> int:
        return self._table.writer()[0]

    def age(self, now_ns: int) -> float | None:
        """Seconds since the health process last beat (None: none ever did)."""
        writer_pid, beat_ns = self._table.writer()
        return (now_ns - beat_ns) / 1e9 if writer_pid else None
