"""The supervisor: owns the lifecycle of the worker processes (docs/architecture.md#the-processes).

Modelled on gunicorn's arbiter. Before forking it validates the config and the overlay, starts the
embedded Valkey when configured, creates the shared-memory segment and binds the admin listener.
Then one asyncio loop does all the work:

- signal handlers only enqueue an action name (``SIGNAL_ACTIONS``); the loop takes one action at a
  time, then runs the tick (reap, replace, retire, advance a reload, notify);
- workers report over a status pipe each (typed messages, gateway/process_protocol.py), read with
  ``loop.add_reader``; that is how readiness, serving revisions and heartbeats are known;
- the admin HTTP listener (gateway/admin/) runs on the same loop.

Generations: every config reload that needs new workers forks a new generation next to the old one,
waits until all of it reports ``ready``, then retires the old one with SIGTERM (drain) and SIGKILL
after ``graceful_shutdown``. Shared-memory rows are allocated for two full generations so both fit
during the swap. The supervisor binds the data-plane ``SO_REUSEPORT`` sockets, one per worker
position, and each generation's worker at a position inherits the same one, so neither a reload nor a
crashed worker's replacement closes a listener (closing one resets its accept queue).

The supervisor does no request work and never imports the data plane: children are forked into
entry points that import their code only once they run (children.py). This package itself exports
only light pieces; ``gridgate run`` imports ``gateway.supervisor.arbiter``. The config checks made
before forking and on every reload are ``gateway.check``'s, the ones ``gridgate check`` makes.

Modules, each one concern, imports flowing downward (top to bottom here):

    arbiter         ``Arbiter``: start-up, the loop and its signal table, stopping; composes the parts
                    below and routes child exits and status messages between them
    reload          ``GenerationSwap``: the running config, SIGHUP by generation swap
    readiness       ``Readiness``: what workers reported, /readyz, sd_notify and the watchdog
    worker_set      ``WorkerSet``: forking, status pipes, reaping, backoff, retiring, the prober
    listeners       the listening sockets by (listen address, worker position)
    observability   worker counters, admin sources, the supervisor's metric families
    children        the child side of fork and the default entry points
    quota_backend   the embedded Valkey and the quota URL
    overlay_keeper  the last-known-good overlay for workers that start later
    startup         pre-fork checks, ``StartupError``, ``RunOverrides``
    generations     pure: ``plan_reload``, ``swap_step``
    lifecycle       pure: ``CrashBackoff``, ``StartupGuard``, ``SlotPool``, ``Child``, ``PendingGeneration``
    policy          the signal table, timeouts, backoff
"""

from gateway.supervisor.lifecycle import CrashBackoff, SlotPool
from gateway.supervisor.startup import RunOverrides, StartupError

__all__ = [
    "CrashBackoff",
    "RunOverrides",
    "SlotPool",
    "StartupError",
]
