"""The supervisor's policy in one place: the signal table, the exit-code contract, timeouts and backoff.

Kept together (as they were at the top of the single module) so they are read and tuned together.
"""

import signal

from workers.main import EXIT_BIND_FAILED

# A worker exits with this code when its listening socket cannot be bound (one name for both sides).
EXIT_CANNOT_BIND = EXIT_BIND_FAILED

# Workers send a heartbeat once a second (workers/status.py).
HEARTBEAT_STALE_AFTER = 5.0  # readyz and the systemd watchdog stop vouching for it
# The worker's loop is stuck: SIGKILL and replace it. Well inside the unit's WatchdogSec (30s), which
# stops being fed once a heartbeat is HEARTBEAT_STALE_AFTER old: the replacement must be up first.
HUNG_AFTER = 10.0
BOOT_TIMEOUT = 60.0  # a worker that never reports ready is killed
RELOAD_TIMEOUT = 60.0  # a new generation that is not ready by then is abandoned
KILL_GRACE = 1.0  # after graceful_shutdown, before SIGKILL: lets a worker finish its own deadline

# Crash-loop protection: the first crash is replaced at once, then the delay doubles.
RESTART_BACKOFF_BASE = 0.5
RESTART_BACKOFF_CAP = 30.0
STABLE_AFTER = 10.0  # a worker that lived this long resets the backoff
STARTUP_FAILURE_LIMIT = 5  # consecutive boot failures before any worker was ever ready: give up

TICK = 0.25

# The signal table: a handler only enqueues the action's name; the loop then runs
# ``Supervisor.handle_<action>`` (arbiter.py), one action at a time.
SIGNAL_ACTIONS: dict[signal.Signals, str] = {
    signal.SIGHUP: "reload",
    signal.SIGTERM: "terminate",
    signal.SIGINT: "interrupt",
    signal.SIGTTIN: "increment",
    signal.SIGTTOU: "decrement",
    signal.SIGCHLD: "reap",
}
WAKE = "wake"  # not a signal: a status message arrived, re-evaluate readiness now
