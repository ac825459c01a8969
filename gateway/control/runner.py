"""The control loop: observe -> decide -> publish, every ``interval``, until stopped.

``control_main(path)`` is the ``gridgate control -c FILE`` entry point: a spec
problem at start is exit 1 with one ``field: message`` line per problem on stderr;
SIGTERM/SIGINT stop the loop and exit 0. Providers that cannot be reached are
published as ``none``; they never stop the loop. A publish that fails (the disk,
Valkey, or a render the validator refuses) is logged and retried next round while
the last good overlay stays in place.

Destinations: the ``output`` file and/or ``publish.valkey`` (a key, guarded by a lease so
that one instance of several publishes; :mod:`gateway.control.valkey_publish`).

Stopping interrupts only the observation phase (awaiting probes); deciding and
publishing run to the end (Valkey commands are bounded by their timeout), so a stop
never leaves a round half-published. A clean stop releases the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, TypeVar

from gateway.config import ConfigError
from gateway.control.conformance import ConformanceWatch
from gateway.control.decide import Assessment, Hold, Observation, decide, describe_changes
from gateway.control.observe import observe_all, signal_plans
from gateway.control.publish import Publisher, PublishResult
from gateway.control.spec import ControlSpec, check_spec, load_spec
from gateway.control.telemetry import ControlTelemetry
from gateway.control.valkey_publish import ValkeyPublisher, ValkeyUnavailable
from gateway.overlay.contract import OverlayRejected

log = logging.getLogger("gridgate.control")

Clock = Callable[[], datetime]
T = TypeVar("T")


def utc_now() -> datetime:
    return datetime.now(UTC)


class ControlLoop:
    """The state carried between rounds: stabilization holds, the published assessments, the destinations."""

    def __init__(self, spec: ControlSpec, clock: Clock = utc_now) -> None:
        self.spec = spec
        self.clock = clock
        self.publisher = Publisher(spec) if spec.output is not None else None
        target = spec.publish.valkey
        self.valkey = ValkeyPublisher(spec, target) if target is not None else None
        self.holds: dict[str, Hold] = {}
        self.published: dict[str, Assessment] = {}
        # Per destination: state changes not published there yet (a publish failed), for the next publish's log.
        self.unpublished: dict[str, list[str]] = {"file": [], "valkey": []}
        self._leading = False  # the Valkey lease was held at the last round
        self.plans = signal_plans(spec)  # where each provider's signals are on its metrics page
        self.telemetry = ControlTelemetry(self.plans)
        # The conformance checks run beside the rounds (each run takes seconds); rounds read the verdicts.
        self.conformance = ConformanceWatch(spec, spec.conformance) if spec.conformance is not None else None

    async def observe(self) -> dict[str, Observation]:
        observed = await observe_all(self.spec.providers, self.spec.probe_timeout, self.plans)
        if self.conformance is not None:
            for name, checks in self.conformance.failed.items():
                if name in observed:
                    observed[name] = dataclasses.replace(observed[name], nonconformant=checks)
        return observed

    async def apply(self, observations: dict[str, Observation]) -> None:
        """Decide from one round's observations and publish to every destination."""
        self.telemetry.observed(observations)
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
        summary = [line.split(" (", 1)[0] for line in changes]
        now = self.clock()
        if self.publisher is not None:
            self.unpublished["file"] += summary
            try:
                result = self.publisher.publish(decision.document, now)
            except (OverlayRejected, OSError) as exc:
                log.error("publish to %s failed, keeping the previous file and retrying next round: %s",
                          self.spec.output, exc)
            else:
                self._report(result, "file", self.spec.output or "", first_round, "file")
        if self.valkey is not None:
            self.unpublished["valkey"] += summary
            took_over = not self._leading
            try:
                result = await self.valkey.publish(decision.document, now)
            except (OverlayRejected, ValkeyUnavailable) as exc:
                log.error("publish to %s failed, retrying next round: %s", self.valkey.where, exc)
                return
            self._leading = self.valkey.lease.held
            if self._leading:
                self._report(result, "valkey", self.valkey.where, took_over, "key")
            else:
                self.unpublished["valkey"] = []  # the lease holder publishes, and reports, its own

    def _report(self, result: PublishResult | None, destination: str, where: str, first: bool, noun: str) -> None:
        if result is not None:
            log.info("published revision %s generation %d to %s (%s)", result.revision, result.generation, where,
                     _publish_reason(result, first, self.unpublished[destination], noun))
        self.unpublished[destination] = []

    async def close(self) -> None:
        if self.conformance is not None:
            await self.conformance.stop()
        self.telemetry.close()
        if self.valkey is not None:
            await self.valkey.close()


def _publish_reason(result: PublishResult, first: bool, changes: list[str], noun: str) -> str:
    if result.previous_revision is None:
        return "no valid overlay was there"
    if first:
        return f"startup: the {noun} held another revision or envelope"
    if changes:
        return "; ".join(changes)
    return f"the {noun} was changed by someone else, or its refresh was due"


async def _unless_stopped(work: Coroutine[Any, Any, T], stop_event: asyncio.Event) -> T | None:
    """Run ``work`` unless ``stop_event`` fires first (then cancel it); its result, None if stopped."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop_event.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return task.result()  # re-raises a bug rather than loop on it
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def run_control(spec_path: str, stop_event: asyncio.Event, *, clock: Clock = utc_now) -> None:
    """Run rounds every ``interval`` until ``stop_event`` is set. Raises ConfigError for a bad spec."""
    spec = load_spec(spec_path)
    loop = ControlLoop(spec, clock)
    if spec.metrics_listen is not None:
        try:
            loop.telemetry.serve(spec.metrics_listen)
        except OSError as exc:
            await loop.close()
            raise ConfigError([f"metrics_listen: cannot listen on {spec.metrics_listen}: {exc.strerror or exc}"]) from exc
    destinations = []
    if loop.publisher is not None:
        destinations.append(f"output {spec.output} (on disk: generation {loop.publisher.generation}, "
                            f"revision {loop.publisher.revision or 'none'})")
    if loop.valkey is not None:
        destinations.append(f"{loop.valkey.where} (lease {loop.valkey.lease.key} as {loop.valkey.lease.owner})")
    if spec.metrics_listen is not None:
        destinations.append(f"metrics on http://{spec.metrics_listen}/metrics")
    if loop.conformance is not None:
        loop.conformance.start()
        destinations.append(f"conformance checks every {float(spec.conformance.recheck):g}s")  # type: ignore[union-attr]
    log.info("control plane started: %d providers, interval %gs, %s/%s/%s admission, %s", len(spec.providers),
             spec.interval, spec.routing_policy, spec.scoring_policy.strategy, spec.admission.mode,
             "; ".join(destinations))
    try:
        while not stop_event.is_set():
            started = time.monotonic()
            observed = await _unless_stopped(loop.observe(), stop_event)
            if observed is None:
                break
            await loop.apply(observed)
            # Fixed rate: the next round starts one interval after this one started.
            remaining = spec.interval - (time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), max(0.0, remaining))
    finally:
        await loop.close()
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
