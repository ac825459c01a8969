"""The worker's view of the routing overlay: the serving snapshot, reloads, and what derives from it.

Reloads happen off the request path (the worker's background task polls the file watcher); a request
reads ``snapshot`` once and keeps that object, so requests in flight finish on the snapshot they
started with. An invalid overlay keeps the last-known-good snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from gateway.config import Config
from gateway.models.aliases import visible_aliases
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.snapshot import Snapshot, snapshot_from_bytes
from gateway.overlay.watch import OverlayWatcher, SnapshotHolder, load_inline_overlay
from gateway.routing.tenants import Policy

log = logging.getLogger("gridgate.overlay")


class ReloadResult:
    """What one poll did: ``changed`` (a new revision serves) or ``error`` (rejected, LKG kept)."""

    __slots__ = ("changed", "error")

    def __init__(self, changed: bool = False, error: str | None = None) -> None:
        self.changed = changed
        self.error = error


_NOTHING = ReloadResult()


class OverlayFollower:
    def __init__(self, config: Config, fallback: bytes | None = None) -> None:
        routing = config.routing
        scope = routing.expected_overlay_scope
        path = config.overlay_path()
        self.watcher: OverlayWatcher | None = None
        if path is None:  # inline candidates: they change with the config, not a file
            self._holder = SnapshotHolder(None, scope, load_inline_overlay(routing.candidates or [], scope))
        else:
            self.watcher = OverlayWatcher(path, float(routing.reload_debounce))
            self._holder = self._open(path, scope, fallback)
        self._models: dict[str, bytes] = {}  # list bodies per tenant policy (allowed capabilities)
        # Aliases (docs/models.md): the listed ones, and every alias's target (a hidden one answers by name).
        self._listed_aliases = visible_aliases(config.models)
        self._alias_targets = {name: config.models.target(name) for name in config.models.aliases}

    @staticmethod
    def _open(path: str, scope: object, fallback: bytes | None) -> SnapshotHolder:
        """The overlay file; if it is invalid right now, the last good bytes the supervisor kept."""
        try:
            return SnapshotHolder.open(path, scope)
        except OverlayRejected as error:
            if not fallback:
                raise
            snapshot = snapshot_from_bytes(fallback, scope)
            log.warning("overlay file rejected at start (%s); serving last-known-good revision %s",
                        error, snapshot.revision)
            return SnapshotHolder(path, scope, snapshot)

    @property
    def snapshot(self) -> Snapshot:
        return self._holder.snapshot

    def poll(self, now: float, force: bool = False, on_result: Callable[[str], None] | None = None) -> ReloadResult:
        """Re-read the overlay when the file changed (or on SIGHUP); keep last-known-good on error.

        ``on_result`` gets ``applied``, ``unchanged`` or ``rejected`` for every re-read (metrics).
        """
        watcher = self.watcher
        if watcher is None or not (watcher.poll(now) or force):
            return _NOTHING
        changed, error = self._holder.reload()
        if force:
            watcher.mark_seen()
        if error is not None:
            if on_result is not None:
                on_result("rejected")
            log.warning("overlay rejected (%s); keeping revision %s", error, self.snapshot.revision)
            return ReloadResult(error=str(error))
        if not changed:
            if on_result is not None:
                on_result("unchanged")
            return _NOTHING
        if on_result is not None:
            on_result("applied")
        self._models: dict[str, bytes] = {}  # list bodies per tenant policy (allowed capabilities)
        log.info("serving overlay revision %s", self.snapshot.revision)
        return ReloadResult(changed=True)

    def models_body(self, policy: Policy, narrowed: Callable[[str], bool] | None = None) -> bytes:
        """``GET /v1/models``: the serving overlay's models this tenant may use (OpenAI list shape),
        memoised per tenant; ``narrowed``: a managed key's own ``models`` test, which narrows the list
        further (not memoised: few keys have one)."""
        body = self._models.get(policy.tenant) if narrowed is None else None
        if body is None:
            def allowed(name: str) -> bool:
                return policy.allows(name) and (narrowed is None or narrowed(name))

            served = self.snapshot.model_names
            aliases = self._alias_targets
            data = [_model_object(name) for name in served if name not in aliases and allowed(name)]
            # A listed alias appears when the caller may use the model it names and the overlay serves it.
            data += [_model_object(alias) for alias, target in self._listed_aliases
                     if target in served and allowed(target)]
            body = msgspec.json.encode({"object": "list", "data": data})
            if narrowed is None:
                self._models[policy.tenant] = body
        return body

    def model_body(self, model: str, allowed: Callable[[str], bool]) -> bytes | None:
        """``GET /v1/models/{id}``: one model object, or None when it is not served or ``allowed`` refuses
        it. An alias, hidden or not, answers for the model it names (it resolves first: docs/models.md)."""
        target = self._alias_targets.get(model, model)
        if target not in self.snapshot.model_names or not allowed(target):
            return None
        return msgspec.json.encode(_model_object(model))


def _model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "gridgate"}
