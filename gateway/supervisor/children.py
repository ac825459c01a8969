"""The child side of fork: shedding the supervisor's state, running an entry point, ending the process."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from gateway.cluster.spec import cluster_specs_from_config
from gateway.config import Config
from gateway.process_protocol import EXIT_CRASHED, EXIT_OK, WorkerContext
from gateway.supervisor.policy import SIGNAL_ACTIONS

log = logging.getLogger("gridgate.supervisor")

_PR_SET_PDEATHSIG = 1



def loop_internal_fds(loop: asyncio.AbstractEventLoop) -> list[int]:
    """The epoll fd and self-pipe of the parent's loop: useless in a child, so closed there."""
    fds = []
    for attribute in ("_selector", "_ssock", "_csock"):
        try:
            fds.append(getattr(loop, attribute).fileno())
        except (AttributeError, OSError, ValueError):
            pass
    return fds


def _die_with_supervisor(supervisor_pid: int) -> None:
    """SIGTERM this child (a graceful drain) if the supervisor dies without stopping it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own shutdown still applies
        return
    if os.getppid() != supervisor_pid:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def become_child(close_fds: list[int], supervisor_pid: int) -> None:
    """First thing after fork in the child: shed everything that belongs to the supervisor."""
    # Signals are blocked across fork (see fork_child); make them default before unblocking.
    signal.set_wakeup_fd(-1)
    for sig in SIGNAL_ACTIONS:
        signal.signal(sig, signal.SIG_DFL)
    # Ctrl-C reaches the whole process group; the supervisor turns it into SIGTERM per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A reload forwarded while the worker is still booting must not kill it (the default action):
    # the worker installs its own SIGHUP handler once it serves, and reads the overlay at start anyway.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # likewise a log reopen (the worker opens its log at start)
    # Forget the parent's running loop so the child can start its own (uvloop in workers).
    asyncio._set_running_loop(None)
    asyncio.set_event_loop_policy(None)
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _die_with_supervisor(supervisor_pid)  # an orphan at birth gets a pending SIGTERM: default action, gone
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def run_child(entry: Callable[[WorkerContext], object], ctx: WorkerContext) -> NoReturn:
    """Run a child's entry point; whatever happens, end the process here (never return into the parent's code)."""
    code = EXIT_CRASHED
    try:
        entry(ctx)
        code = EXIT_OK
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else EXIT_CRASHED
    except BaseException:
        try:
            log.exception("%s process (slot %d) crashed", getattr(entry, "__name__", "child"), ctx.slot)
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def fork_child(entry: Callable[[WorkerContext], object], ctx: WorkerContext, close_in_child: list[int]) -> int:
    """Fork a child that runs ``entry(ctx)``; returns its pid in the parent."""
    # Blocked across fork: a signal landing in the child before it resets its handlers would
    # otherwise run the parent's handler there (and write into the parent's wakeup pipe).
    supervisor_pid = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, set(SIGNAL_ACTIONS))
    try:
        pid = os.fork()
        if pid == 0:
            try:
                become_child(close_in_child, supervisor_pid)
            except BaseException:
                os._exit(EXIT_CRASHED)  # never fall back into the parent's code
            run_child(entry, ctx)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(SIGNAL_ACTIONS))
    return pid


# The default entry points (private: their names show in the crash log line above). Each imports its
# process's code only in the child, so the supervisor never loads the data plane (uvloop, the proxy).
def _default_worker_entry(ctx: WorkerContext) -> None:
    from workers.main import worker_main

    worker_main(ctx)


def needs_health_process(config: Config) -> bool:
    return any(c.health_check is not None or c.outlier_detection is not None for c in config.clusters)


def _default_health_entry(ctx: WorkerContext) -> None:
    from gateway.health.writer import health_process_main

    health_process_main(cluster_specs_from_config(ctx.config), ctx.segment)


def describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
