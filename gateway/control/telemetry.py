"""What the control plane tells its operator about the signals it reads: a log line when a provider's
page starts (or stops) lacking a signal the assessment needs, and Prometheus metrics on
``metrics_listen`` (docs/control-plane.md, "Metrics of the control plane").

A missing gauge no longer scores silently as nothing: the provider is published stale, the log says
which gauge and which provider, and ``gridgate_control_metric_missing{provider, signal}`` stays 1
while it lasts, so an alert can fire on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import start_http_server

from gateway.control.decide import Observation
from gateway.control.signals import SIGNAL_WORDS, SignalPlan
from gateway.net import parse_host_port

log = logging.getLogger("gridgate.control")


def missing_changes(before: Mapping[str, tuple[str, ...]], after: Mapping[str, tuple[str, ...]],
                    plans: Mapping[str, SignalPlan]) -> list[tuple[int, str]]:
    """(log level, line) per provider whose set of missing signals changed. Pure."""
    lines = []
    for provider, missing in after.items():
        was = set(before.get(provider, ()))
        now = set(missing)
        plan = plans.get(provider)
        where = f" (preset {plan.preset}{', ' + plan.describe_filters() if plan and plan.filters else ''})" if plan else ""
        for signal in sorted(now - was):
            lines.append((logging.WARNING, f"{provider}: the metrics page lacks its {SIGNAL_WORDS[signal]} gauge"
                                           f"{where}; published without it"))
        for signal in sorted(was - now):
            lines.append((logging.INFO, f"{provider}: its {SIGNAL_WORDS[signal]} gauge is readable again"))
    return lines


class ControlTelemetry:
    """The control plane's metric families and the missing-signal memory between rounds."""

    def __init__(self, plans: Mapping[str, SignalPlan]) -> None:
        self.plans = plans
        self.registry = CollectorRegistry()
        self.missing_gauge = Gauge(
            "gridgate_control_metric_missing",
            "1 while the provider's metrics page lacks a signal the scoring policy needs",
            ["provider", "signal"], registry=self.registry)
        self.rounds = Counter("gridgate_control_rounds", "Observation rounds completed", registry=self.registry)
        self.last_round = Gauge("gridgate_control_last_round_timestamp_seconds",
                                "Unix time the last observation round completed", registry=self.registry)
        self.nonconformant = Gauge(
            "gridgate_control_provider_nonconformant",
            "1 while the provider failed a required conformance check (spec conformance) and is published excluded",
            ["provider"], registry=self.registry)
        for provider, plan in plans.items():  # every series exists from the start, at 0
            for signal, _ in plan.signals:
                self.missing_gauge.labels(provider, SIGNAL_WORDS[signal]).set(0)
        self.missing: dict[str, tuple[str, ...]] = {}
        self._server: object | None = None

    def observed(self, observations: Mapping[str, Observation]) -> None:
        """Record one round: log changes of what is missing, set the gauges."""
        # An unreachable provider says nothing about its page: what was missing stays so until it answers.
        after = {name: observation.missing if observation.healthy else self.missing.get(name, ())
                 for name, observation in observations.items() if name in self.plans}
        for level, line in missing_changes(self.missing, after, self.plans):
            log.log(level, line)
        for provider, missing in after.items():
            for signal, _ in self.plans[provider].signals:
                self.missing_gauge.labels(provider, SIGNAL_WORDS[signal]).set(1 if signal in missing else 0)
        self.missing = after
        for provider, observation in observations.items():
            self.nonconformant.labels(provider).set(1 if observation.nonconformant else 0)
        self.rounds.inc()
        self.last_round.set(time.time())

    def serve(self, address: str) -> None:
        """Serve ``GET /metrics`` on ``host:port`` from a daemon thread; OSError when it cannot listen."""
        host, port = parse_host_port(address)
        server, _ = start_http_server(port, host, registry=self.registry)
        self._server = server

    def close(self) -> None:
        server = self._server
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            self._server = None
