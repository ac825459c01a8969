"""The control plane's conformance checks: ``gridgate providers verify``'s checks, off the round, every
``conformance.recheck``; a provider that failed a required one is observed ``nonconformant`` and the
overlay publishes it excluded (gateway.control.decide).

The endpoints, TLS and credentials come from the gateway config the spec names (``gateway_config``), so
the requests are the ones a worker would send; the models are the spec's. Until the first run ends
nobody is excluded, and a run that cannot start (an unreadable config, an unset credential) keeps the
last verdicts and is logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from gateway.config import ConfigError, load_config
from gateway.conformance.runner import verify
from gateway.conformance.targets import TargetError, cluster_targets
from gateway.conformance.verdicts import ProviderVerdict, provider_verdicts
from gateway.control.spec import ControlConformance, ControlSpec

log = logging.getLogger("gridgate.control")


class ConformanceWatch:
    """The latest verdict per provider name, refreshed by a background task."""

    def __init__(self, spec: ControlSpec, settings: ControlConformance) -> None:
        self.spec = spec
        self.settings = settings
        self.failed: dict[str, tuple[str, ...]] = {}  # provider name -> required checks it failed
        self.runs = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.run_once()
            await asyncio.sleep(float(self.settings.recheck))

    async def run_once(self) -> None:
        try:
            targets = self._targets()
        except (ConfigError, TargetError) as exc:
            log.error("conformance: run not started, keeping the last verdicts: %s", exc)
            return
        reports = await verify(targets, max_tokens=self.settings.max_tokens, timeout_s=float(self.settings.timeout))
        verdicts = provider_verdicts(reports, time.time())
        self._adopt(verdicts)
        self.runs += 1

    def _targets(self) -> list:
        config = load_config(self.settings.gateway_config)
        targets = []
        for provider in self.spec.providers:
            if provider.kind != "inference_model":
                continue
            cluster = config.cluster(provider.cluster_name)
            if cluster is None:
                raise TargetError(f"conformance.gateway_config: {self.settings.gateway_config} has no cluster "
                                  f"{provider.cluster_name!r} (provider {provider.name})")
            targets += cluster_targets(config, cluster, list(dict.fromkeys(provider.models)),
                                       self.settings.surfaces, os.environ)
        return targets

    def _adopt(self, verdicts: dict[str, ProviderVerdict]) -> None:
        failed = {}
        for provider in self.spec.providers:
            verdict = verdicts.get(provider.cluster_name)
            if verdict is not None and not verdict.conformant:
                failed[provider.name] = tuple(sorted(verdict.failed_checks))
        for name in sorted(set(failed) | set(self.failed)):
            if failed.get(name) != self.failed.get(name):
                if name in failed:
                    log.warning("conformance: %s is nonconformant (failed %s): published excluded", name,
                                ", ".join(failed[name]))
                else:
                    log.info("conformance: %s is conformant again", name)
        self.failed = failed
