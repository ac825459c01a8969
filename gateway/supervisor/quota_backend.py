"""The quota backend as the supervisor sees it: the bundled Valkey it runs, or the URL the config names."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

from gateway.config import Config
from gateway.supervisor.startup import StartupError

log = logging.getLogger("gridgate.supervisor")


class EmbeddedQuotaBackend:
    """Starts the bundled Valkey for ``quota.backend.kind: embedded``; stops it at exit."""

    def __init__(self) -> None:
        self._server: Any = None
        self._data_dir: str | None = None
        self._owns_data_dir = False
        self.url: str | None = None
        self._next_restart = 0.0
        self._restart_delay = 1.0

    def ensure_started(self, data_dir: str | None) -> str:
        if self.url is not None:
            return self.url
        from gateway.quota.embedded import EmbeddedValkey

        # quota.backend.data_dir, else systemd's StateDirectory=, else a private temp dir (not persistent).
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        if data_dir is None and state:
            data_dir = os.path.join(state, "valkey")
        if data_dir is None:
            self._data_dir, self._owns_data_dir = tempfile.mkdtemp(prefix="gridgate-valkey-"), True
        else:
            self._data_dir = data_dir
        try:
            self._server = EmbeddedValkey(self._data_dir)
            self.url = self._server.start()
        except Exception as exc:
            self.stop()
            raise StartupError(f"quota.backend: cannot start the embedded Valkey in {self._data_dir}: {exc}") from None
        log.info("embedded Valkey started at %s", self.url)
        return self.url

    def watch(self, now: float) -> None:
        """Restart the bundled Valkey if it died: the workers keep their URL and reconnect by themselves."""
        server = self._server
        if server is None or not server.exited() or now < self._next_restart:
            return
        log.error("embedded Valkey exited unexpectedly; restarting it")
        try:
            server.restart()
            log.info("embedded Valkey restarted at %s", self.url)
            self._restart_delay = 1.0
        except Exception as exc:
            log.error("embedded Valkey restart failed (%s); retrying in %.0fs", exc, self._restart_delay)
            self._next_restart = now + self._restart_delay
            self._restart_delay = min(self._restart_delay * 2, 30.0)

    def stop(self) -> None:
        if self._server is not None:
            try:
                self._server.stop()
            except Exception:
                log.exception("stopping the embedded Valkey failed")
            self._server = None
        if self._owns_data_dir and self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self.url = None


def quota_url_for(config: Config, embedded: EmbeddedQuotaBackend) -> str | None:
    if config.quota is None:
        return None
    backend = config.quota.backend
    if backend.kind == "embedded":
        data_dir = None if backend.data_dir is None else os.path.join(config.base_dir, backend.data_dir)
        return embedded.ensure_started(data_dir)
    return config.quota.backend.url
