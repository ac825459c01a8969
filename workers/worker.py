"""The worker process: one uvloop event loop, its own SO_REUSEPORT listener, the overlay follower.

``worker_main`` is called in the forked child and never returns: it ends in ``os._exit``.
Exit codes: 0 after a graceful drain, 1 on an unexpected error, 3 when the listener cannot bind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

import uvloop

from gateway.config import parse_host_port
from workers.context import WorkerContext
from workers.proxy import Proxy
from workers.runtime import Runtime
from workers.server import ServerConnection, ServerSettings, ServerState
from workers.status import send_status

log = logging.getLogger("gridgate.worker")

EXIT_BIND_FAILED = 3
_HEARTBEAT_S = 1.0
_OVERLAY_POLL_S = 0.25


def bind_listener(address: str, backlog: int = 2048) -> socket.socket:
    """Our own listening socket; SO_REUSEPORT lets every worker bind the same address."""
    host, port = parse_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class Worker:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.stopping: asyncio.Event | None = None
        self.reload_requested = False

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        ctx = self.ctx
        runtime = Runtime(ctx)
        await runtime.start()
        proxy = Proxy(runtime)
        state = ServerState(ServerSettings(self.config), proxy.handle)
        state.on_reject = lambda status: runtime.metrics.request(None, status)
        try:
            sock = bind_listener(self.config.listen)
        except OSError as error:
            log.error("cannot listen on %s: %s", self.config.listen, error.strerror)
            return EXIT_BIND_FAILED
        server = await loop.create_server(lambda: ServerConnection(state), sock=sock)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        self._send_ready(runtime)
        background = loop.create_task(self._background(runtime))
        await self.stopping.wait()

        send_status(ctx.status_fd, {"kind": "draining", "slot": ctx.slot})
        state.draining = True
        server.close()
        state.close_idle(loop.time())
        deadline = loop.time() + float(self.config.timeouts.graceful_shutdown)
        while (state.in_flight > 0 or state.has_fresh_connections(loop.time())) and loop.time() < deadline:
            await asyncio.sleep(0.05)
            state.close_idle(loop.time())
        background.cancel()
        for conn in list(state.connections):
            conn.close(abort=True)
        await runtime.stop()
        return 0

    def _request_reload(self) -> None:
        self.reload_requested = True

    def _send_ready(self, runtime: Runtime) -> None:
        snapshot = runtime.snapshot
        send_status(self.ctx.status_fd, {
            "kind": "ready", "slot": self.ctx.slot, "pid": os.getpid(),
            "revision": snapshot.revision, "mode": snapshot.mode,
            "capabilities": [f"{kind}/{name}" for kind, name in snapshot.capability_keys],
        })

    async def _background(self, runtime: Runtime) -> None:
        """Heartbeats and the overlay follower: cheap periodic work off the request path."""
        next_heartbeat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_heartbeat:
                send_status(self.ctx.status_fd, {"kind": "heartbeat", "slot": self.ctx.slot, "t": time.time()})
                runtime.heartbeat()
                next_heartbeat = now + _HEARTBEAT_S
            forced, self.reload_requested = self.reload_requested, False
            try:
                changed, error = runtime.poll_overlay(now, force=forced)
            except Exception:  # never let the follower die: keep serving last-known-good
                log.exception("overlay reload failed")
                changed, error = False, None
            if error is not None:
                send_status(self.ctx.status_fd, {
                    "kind": "overlay_rejected", "slot": self.ctx.slot, "reason": error,
                    "retained_revision": runtime.snapshot.revision,
                })
            if changed:
                self._send_ready(runtime)
            await asyncio.sleep(_OVERLAY_POLL_S)


def worker_main(ctx: WorkerContext) -> None:
    """Entry point in the forked child. Never returns."""
    code = 1
    try:
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(name)s: %(message)s"
        )
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        code = loop.run_until_complete(Worker(ctx).serve())
    except BaseException:
        log.exception("worker crashed")
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)
