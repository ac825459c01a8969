"""The supervisor: owns the lifecycle of the worker processes (DESIGN "Process model").

Modelled on gunicorn's arbiter. Before forking it validates the config and the
overlay, starts the embedded Valkey when configured, creates the shared-memory
segment and binds the admin listener. Then one asyncio loop does all the work:

- signal handlers only enqueue an action name (``SIGNAL_ACTIONS``); the loop
  takes one action at a time, then runs ``_tick`` (reap, replace, retire, notify);
- workers report over a status pipe each (``workers/status.py``), read with
  ``loop.add_reader``; that is how readiness, serving revisions and heartbeats
  are known;
- the admin HTTP listener (``workers/admin.py``) runs on the same loop.

Generations: every config reload that needs new workers forks a new generation
next to the old one (``SO_REUSEPORT`` sockets overlap, so no connection is
refused), waits until all of it reports ``ready``, then retires the old one with
SIGTERM (drain) and SIGKILL after ``graceful_shutdown``. Shared-memory rows are
allocated for two full generations so both fit during the swap.

The supervisor does no request work.

Modules, each one concern, imports flowing downward (top to bottom here):

    arbiter         ``Supervisor``: start-up, the loop and its signal actions, stopping
    reload          ``ReloadMixin``: SIGHUP by generation swap
    readiness       ``ReadinessMixin``: status pipes, readiness, heartbeats, sd_notify
    processes       ``ProcessMixin``: spawning, reaping, backoff, retiring, signalling children
    observability   worker counters, admin sources, the supervisor's metric families
    children        the child side of fork and the default entry points
    quota_backend   the embedded Valkey and the quota URL
    startup         pre-fork checks, ``StartupError``, ``RunOverrides``
    lifecycle       pure bookkeeping: ``CrashBackoff``, ``SlotPool``, ``Child``, ``PendingGeneration``
    policy          the signal table, exit codes, timeouts, backoff
"""

from gateway.supervisor.arbiter import Supervisor
from gateway.supervisor.children import become_child, needs_health_process, run_child
from gateway.supervisor.lifecycle import Child, CrashBackoff, PendingGeneration, SlotPool
from gateway.supervisor.observability import SupervisorAdminSources, SupervisorCollector, WorkerCounters
from gateway.supervisor.policy import (
    BOOT_TIMEOUT,
    EXIT_CANNOT_BIND,
    HEARTBEAT_STALE_AFTER,
    HUNG_AFTER,
    KILL_GRACE,
    RELOAD_TIMEOUT,
    RESTART_BACKOFF_BASE,
    RESTART_BACKOFF_CAP,
    SIGNAL_ACTIONS,
    STABLE_AFTER,
    STARTUP_FAILURE_LIMIT,
    TICK,
    WAKE,
)
from gateway.supervisor.quota_backend import EmbeddedQuotaBackend, quota_url_for
from gateway.supervisor.startup import (
    RunOverrides,
    StartupError,
    bind_admin_socket,
    check_listen_address,
    validate_deployment,
)

__all__ = [
    "BOOT_TIMEOUT",
    "EXIT_CANNOT_BIND",
    "HEARTBEAT_STALE_AFTER",
    "HUNG_AFTER",
    "KILL_GRACE",
    "RELOAD_TIMEOUT",
    "RESTART_BACKOFF_BASE",
    "RESTART_BACKOFF_CAP",
    "SIGNAL_ACTIONS",
    "STABLE_AFTER",
    "STARTUP_FAILURE_LIMIT",
    "TICK",
    "WAKE",
    "Child",
    "CrashBackoff",
    "EmbeddedQuotaBackend",
    "PendingGeneration",
    "RunOverrides",
    "SlotPool",
    "StartupError",
    "Supervisor",
    "SupervisorAdminSources",
    "SupervisorCollector",
    "WorkerCounters",
    "become_child",
    "bind_admin_socket",
    "check_listen_address",
    "needs_health_process",
    "quota_url_for",
    "run_child",
    "validate_deployment",
]

