"""The supervisor's policy in one place: the signal table, timeouts and backoff.

Kept together so they are read and tuned together. The exit codes children end with are part of the
process protocol (gateway/process_protocol.py), which the workers import too.
"""

import signal

# Workers send a heartbeat once a second (gateway/process_protocol.py).
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

# The signal table: a handler only enqueues the action's name; the arbiter's loop then runs the
# action (the ``actions`` table of ``Arbiter._serve``, arbiter.py), one at a time.
SIGNAL_ACTIONS: dict[signal.Signals, str] = {
    signal.SIGHUP: "reload",
    signal.SIGTERM: "terminate",
    signal.SIGINT: "interrupt",
    signal.SIGTTIN: "increment",
    signal.SIGTTOU: "decrement",
    signal.SIGCHLD: "reap",
    signal.SIGUSR1: "reopen_logs",
}
WAKE = "wake"  # not a signal: a status message arrived, re-evaluate readiness now
