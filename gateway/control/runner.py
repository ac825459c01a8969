"""The control loop: observe -> decide -> publish, every ``interval``, until stopped.

``control_main(path)`` is the ``gridgate control -c FILE`` entry point: a spec
problem at start is exit 1 with one ``field: message`` line per problem on stderr;
SIGTERM/SIGINT stop the loop and exit 0. Providers that cannot be reached are
published as ``none``; they never stop the loop. A publish that fails (the disk,
or a render the validator refuses) is logged and retried next round while the
last good file stays in place.

Stopping interrupts only the observation phase (awaiting probes); deciding and
writing are synchronous, so a stop never leaves a round half-published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from gateway.config import ConfigError
from gateway.control.decide import Assessment, Hold, decide, describe_changes
from gateway.control.observe import observe_all
from gateway.control.publish import Publisher, PublishResult
from gateway.control.spec import ControlSpec, check_spec, load_spec
from gateway.overlay.contract import OverlayRejected

log = logging.getLogger("gridgate.control")

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


class ControlLoop:
    """The state carried between rounds: stabilization holds and the published assessments."""

    def __init__(self, spec: ControlSpec, clock: Clock = utc_now) -> None:
        self.spec = spec
        self.clock = clock
        self.publisher = Publisher(spec)
        self.holds: dict[str, Hold] = {}
        self.published: dict[str, Assessment] = {}
        self.unpublished_changes: list[str] = []  # state changes not yet on disk (a publish failed)

    async def round(self) -> PublishResult | None:
        observations = await observe_all(
            self.spec.providers, self.spec.probe_timeout, self.spec.scoring_policy.uses_metrics()
        )
        decision = decide(self.spec, observations, self.holds)
        first_round = not self.published
        changes = describe_changes(self.published, decision.published)
        for line in changes:
            log.info("state %s", line)
        for name, hold in decision.holds.items():
            if hold.pending is not None:
                log.debug("%s: observed %s (%d/%d), holding %s", name, hold.pending.describe(), hold.streak,
                          self.spec.admission.observations, hold.published.describe())
        self.holds, self.published = decision.holds, decision.published
        self.unpublished_changes += [line.split(" (", 1)[0] for line in changes]
        try:
            result = self.publisher.publish(decision.document, self.clock())
        except (OverlayRejected, OSError) as exc:
            log.error("publish to %s failed, keeping the previous file and retrying next round: %s",
                      self.spec.output, exc)
            return None
        if result is not None:
            log.info("published revision %s generation %d to %s (%s)", result.revision, result.generation,
                     self.spec.output, _publish_reason(result, first_round, self.unpublished_changes))
        self.unpublished_changes = []
        return result


def _publish_reason(result: PublishResult, first_round: bool, changes: list[str]) -> str:
    if result.previous_revision is None:
        return "no valid overlay was there"
    if first_round:
        return "startup: the file held another revision or envelope"
    if changes:
        return "; ".join(changes)
    return "the file was changed by someone else"


async def _unless_stopped(work: Coroutine[Any, Any, Any], stop_event: asyncio.Event) -> bool:
    """Run ``work`` unless ``stop_event`` fires first (then cancel it); True if it completed."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop_event.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        task.result()  # re-raise a bug rather than loop on it
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def run_control(spec_path: str, stop_event: asyncio.Event, *, clock: Clock = utc_now) -> None:
    """Run rounds every ``interval`` until ``stop_event`` is set. Raises ConfigError for a bad spec."""
    spec = load_spec(spec_path)
    loop = ControlLoop(spec, clock)
    log.info("control plane started: %d providers, interval %gs, %s/%s/%s admission, output %s "
             "(on disk: generation %d, revision %s)", len(spec.providers), spec.interval, spec.routing_policy,
             spec.scoring_policy.strategy, spec.admission.mode, spec.output, loop.publisher.generation,
             loop.publisher.revision or "none")
    while not stop_event.is_set():
        started = time.monotonic()
        if not await _unless_stopped(loop.round(), stop_event):
            break
        # Fixed rate: the next round starts one interval after this one started.
        remaining = spec.interval - (time.monotonic() - started)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), max(0.0, remaining))
    log.info("control plane stopped")


def _ensure_logging() -> None:
    """INFO lines from this logger reach stderr whether or not the CLI configured logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def control_main(path: str) -> int:
    """``gridgate control -c PATH``: 0 after SIGTERM/SIGINT, 1 for an invalid spec."""
    problems = check_spec(path)
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1
    _ensure_logging()

    async def main() -> None:
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop_event.set)
        try:
            await run_control(path, stop_event)
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    try:
        asyncio.run(main())
    except ConfigError as exc:  # the file changed between the check and the load
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    return 0


__all__ = ["ControlLoop", "check_spec", "control_main", "run_control"]
