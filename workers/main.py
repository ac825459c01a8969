"""The worker process: its one uvloop event loop, from start to exit.

``worker_main`` runs in the forked child and never returns (it ends in ``os._exit``). ``Worker`` claims
its shared-memory row, builds its request path once (``RequestPath.build``, workers/request_path.py:
overlay follower, router, clusters, auth, quota gate, metrics, access log, proxy), serves it on the
``SO_REUSEPORT`` socket the supervisor bound for its position (or binds its own when run alone) until
SIGTERM/SIGINT, then drains (docs/operations.md, "Drains and listening sockets"). Periodic work
(heartbeats, overlay reloads) runs in one background task, off the request path.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Callable

import uvloop

from gateway.config import Config
from gateway.host_segment import create_segment, endpoint_ids
from gateway.http.tls import ReloadableServerTls
from gateway.listener import BACKLOG, bind_listener
from gateway.process_protocol import (
    EXIT_CANNOT_BIND,
    Draining,
    Heartbeat,
    OverlayRejected,
    Ready,
    WorkerContext,
    send_status,
)
from shm.counters import WorkerRow, WorkerStatus
from shm.segment import Segment
from workers.request_path import RequestPath, report_unconfigured
from workers.server import ServerConnection
from workers.server_state import ServerState

log = logging.getLogger("gridgate.worker")

_HEARTBEAT_S = 1.0
_OVERLAY_POLL_S = 0.25
_DRAIN_POLL_S = 0.05


def _private_segment(config: Config) -> Segment:
    """A segment for a worker started without a supervisor (profiling, experiments)."""
    segment = create_segment(config, 1)
    segment.directory.assign(endpoint_ids(config))
    segment.claim_worker_row(0)
    return segment


def listener_tls(config: Config) -> ReloadableServerTls | None:
    """The listener's TLS context (``server_tls``), with its client certificates when configured."""
    tls = config.server_tls
    if tls is None:
        return None
    clients = None if tls.client_auth is None else tls.client_auth.trust(config.file_path)
    return ReloadableServerTls(config.file_path(tls.cert_file), config.file_path(tls.key_file), clients)


class Worker:
    """One worker process: serves its request path (workers/request_path.py), drains, stops."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.config: Config = ctx.config
        self.reload_requested = False
        self.segment: Segment = ctx.segment if ctx.segment is not None else _private_segment(self.config)
        self.row = WorkerRow(self.segment, max(ctx.slot, 0))
        self.row.mark(WorkerStatus.RUNNING, os.getpid(), time.monotonic_ns())
        self.tls = listener_tls(self.config)

    async def serve(self, stopping: asyncio.Event | None = None, started: Callable[[], None] | None = None) -> int:
        """Serve until TERM/INT, then drain. ``stopping``: an event set by whoever runs the worker inside
        its own process (tests/inprocess.py, ``LoopbackGateway``), told by ``started`` when it serves;
        then no signal is handled here."""
        loop = asyncio.get_running_loop()
        own_process = stopping is None
        stopping = stopping or asyncio.Event()
        path = await RequestPath.build(self.ctx, self.segment, self.row)
        state = path.server_state()
        try:
            sock = self._listener()
        except OSError as error:
            log.error("cannot listen on %s: %s", self.config.listen, error.strerror)
            return EXIT_CANNOT_BIND
        # create_server listens again on the socket: give it the same backlog (its default is 100).
        server = await loop.create_server(
            lambda: ServerConnection(state), sock=sock, backlog=BACKLOG,
            ssl=None if self.tls is None else self.tls.context,
            ssl_handshake_timeout=float(self.config.timeouts.header_read) if self.tls is not None else None,
        )
        if own_process:
            self._own_signals(loop, stopping, path)
        self._send_ready(path)
        if started is not None:
            started()
        background = loop.create_task(self._background(path))
        await stopping.wait()

        send_status(self.ctx.status_fd, Draining())
        state.draining = True
        # Stop accepting. Under a supervisor this closes only our copy of the socket: the next
        # generation's worker at our position holds it too, and accepts what waits in its queue.
        server.close()
        await self._drain(state)
        background.cancel()
        await path.close()
        return 0

    def _own_signals(self, loop: asyncio.AbstractEventLoop, stopping: asyncio.Event, path: RequestPath) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        loop.add_signal_handler(signal.SIGUSR1, path.access_log.reopen)  # logrotate
        # What exists now lives as long as the worker: keep it out of the collector's generations, so a
        # full collection walks only what requests allocate (gen-2 pauses grow with the heap otherwise).
        gc.collect()
        gc.freeze()

    def _listener(self) -> socket.socket:
        """The socket the supervisor bound for this worker's position, or our own when run alone."""
        if self.ctx.listen_fd is not None:
            return socket.socket(fileno=self.ctx.listen_fd)
        return bind_listener(self.config.listen)

    async def _drain(self, state: ServerState) -> None:
        """Until every connection ended (after a `Connection: close` answer, or idle) or the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(self.config.timeouts.graceful_shutdown)
        while state.connections and loop.time() < deadline:
            state.close_idle(loop.time())
            await asyncio.sleep(_DRAIN_POLL_S)
        await state.cut_remaining()

    def _request_reload(self) -> None:
        self.reload_requested = True
        if self.tls is not None:  # new handshakes get the re-read certificate; open connections keep theirs
            problem = self.tls.reload()
            if problem is not None:
                clients = self.tls.clients
                log.error("server_tls: cannot reload %s / %s%s: %s; serving the previous certificate%s",
                          self.tls.cert_file, self.tls.key_file,
                          "" if clients is None else f" / client_auth {clients.ca_file}", problem,
                          "" if clients is None else " and client CAs")

    def _send_ready(self, path: RequestPath) -> None:
        snapshot = path.overlay.snapshot
        send_status(self.ctx.status_fd, Ready(
            revision=snapshot.revision, mode=snapshot.mode,
            capabilities=[f"{kind}/{name}" for kind, name in snapshot.capability_keys],
        ))

    def _heartbeat(self, path: RequestPath) -> None:
        """Liveness for the health process, and per-process counters into shared metrics."""
        send_status(self.ctx.status_fd, Heartbeat())
        self.row.heartbeat(time.monotonic_ns())
        path.publish_counters()
        refusals = None if self.tls is None else self.tls.refusals
        if refusals is not None:
            path.metrics.publish_client_cert_refusals(refusals.counts)
        if path.head_gate.jwt is not None:
            path.metrics.publish_jwt_counts(path.head_gate.jwt.counts)

    def _poll_overlay(self, path: RequestPath, now: float) -> None:
        forced, self.reload_requested = self.reload_requested, False
        overlay = path.overlay
        result = overlay.poll(now, force=forced, on_result=path.metrics.overlay_reload)
        if result.error is not None:
            send_status(self.ctx.status_fd, OverlayRejected(
                reason=result.error, retained_revision=overlay.snapshot.revision,
            ))
        if result.changed:
            report_unconfigured(path.router.prepare(overlay.snapshot))
            self._send_ready(path)

    async def _background(self, path: RequestPath) -> None:
        """Heartbeats and the overlay follower: cheap periodic work off the request path."""
        next_heartbeat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat(path)
                next_heartbeat = now + _HEARTBEAT_S
            try:
                self._poll_overlay(path, now)
            except Exception:  # never let the follower die: keep serving last-known-good
                log.exception("overlay reload failed")
            if path.head_gate.jwt is not None:  # the JWT issuers' key files (docs/identity.md)
                path.head_gate.jwt.poll()
            await asyncio.sleep(_OVERLAY_POLL_S)


def worker_main(ctx: WorkerContext) -> None:
    """Entry point in the forked child. Never returns."""
    code = 1
    try:
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(name)s: %(message)s"
        )
        code = uvloop.run(Worker(ctx).serve())
    except BaseException:
        log.exception("worker crashed")
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)
