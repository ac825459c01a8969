"""Pure decisions of a reload (SIGHUP): what a new config needs, and when its generation is done.

The generation swap (reload.py) does the I/O around these: loading the config, binding sockets,
forking, signalling. Everything here takes data and returns data, so it is tested without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import msgspec

from gateway.config import Config, ConfigError
from gateway.supervisor.lifecycle import Child, PendingGeneration


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """How a valid new config is applied."""

    # False: only supervisor-side settings changed (worker count, admin listener); the running
    # workers stay and only re-read the overlay. True: a new generation of workers is forked.
    new_generation: bool
    workers: int  # how many workers serve the new config
    admin_moved: bool  # bind the new admin listener before anything else changes
    listen_moved: bool  # check the new data-plane port before forking


def plan_reload(new: Config, old: Config, *, target: int, max_workers: int, free_rows: int) -> ReloadPlan:
    """The plan for ``new`` replacing ``old``; raises ConfigError naming why the running config stays.

    ``target`` is the current worker count (SIGTTIN/SIGTTOU included), kept unless the config's own
    ``workers`` setting changed. ``free_rows`` are the shared-memory worker rows not held by a worker.
    """
    if new.worker_count() > max_workers:
        raise ConfigError([
            f"workers: {new.worker_count()} exceeds the {max_workers} the shared memory was sized "
            "for at start; restart the service to grow further"
        ])
    workers = new.worker_count() if new.workers != old.workers else target
    admin_moved = new.admin.listen != old.admin.listen
    # Nothing a worker cares about changed when the configs differ at most in these two fields.
    if msgspec.structs.replace(old, workers=new.workers, admin=new.admin) == new:
        return ReloadPlan(False, workers, admin_moved, listen_moved=False)
    if workers > free_rows:
        raise ConfigError([
            f"workers: {workers} new workers need shared-memory rows but only {free_rows} "
            "are free (older generations are still draining); retry when they have finished"
        ])
    return ReloadPlan(True, workers, admin_moved, listen_moved=new.listen != old.listen)


class SwapStep(Enum):
    WAIT = "wait"
    PROMOTE = "promote"  # every new worker is ready: retire the old generation
    ABANDON = "abandon"  # the deadline passed: retire the new workers, keep the old generation


def swap_step(pending: PendingGeneration, booting: Sequence[Child], now: float) -> SwapStep:
    """What to do with a pending generation, given its workers that are not being retired."""
    if len(booting) == pending.workers and all(child.ready for child in booting):
        return SwapStep.PROMOTE
    if now >= pending.deadline:
        return SwapStep.ABANDON
    return SwapStep.WAIT
