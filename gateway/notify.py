"""systemd service notifications (sd_notify) without the systemd package.

The protocol is one datagram of ``KEY=VALUE`` lines sent to the unix socket named
by ``$NOTIFY_SOCKET`` (a leading ``@`` means the Linux abstract namespace). When
the variable is unset every call is a cheap no-op, so the supervisor can notify
unconditionally.

The notifier takes ``NOTIFY_SOCKET``/``WATCHDOG_*`` out of the environment when it
is created: only the supervisor (the unit's main PID) talks to systemd, and
children (workers, the embedded Valkey, which understands ``NOTIFY_SOCKET`` too)
must not announce readiness on its behalf.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import MutableMapping

log = logging.getLogger("gridgate.notify")

_OWNED_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(value: str) -> str | bytes:
    """``$NOTIFY_SOCKET`` -> an address for ``sendto``; ``@name`` is the abstract ``\\0name``."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def watchdog_interval(environ: MutableMapping[str, str], pid: int) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of ``WATCHDOG_USEC``), or None when not asked for."""
    usec = environ.get("WATCHDOG_USEC", "")
    owner = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and owner != str(pid):
        return None  # the watchdog belongs to another process
    return int(usec) / 2_000_000


class Notifier:
    """Sends sd_notify messages; silently does nothing without ``$NOTIFY_SOCKET``."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.address = environ.get("NOTIFY_SOCKET") or None
        self.watchdog_interval = watchdog_interval(environ, os.getpid())
        for name in _OWNED_VARIABLES:
            environ.pop(name, None)
        self._socket: socket.socket | None = None
        self._warned = False
        if self.address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def fileno(self) -> int | None:
        return None if self._socket is None else self._socket.fileno()

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; False when disabled or the send failed."""
        if self._socket is None or self.address is None:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            self._socket.sendto(payload, socket_address(self.address))
        except OSError as exc:
            # systemd going away must never take the gateway down; say so once.
            if not self._warned:
                log.warning("sd_notify to %s failed: %s", self.address, exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send(READY=1, **_status(status))

    def reloading(self, status: str | None = None) -> bool:
        # systemd >= 253 wants MONOTONIC_USEC with RELOADING=1 to order the two events.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(RELOADING=1, MONOTONIC_USEC=usec, **_status(status))

    def stopping(self, status: str | None = None) -> bool:
        return self.send(STOPPING=1, **_status(status))

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def status(self, text: str) -> bool:
        return self.send(**_status(text))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _status(text: str | None) -> dict[str, str]:
    # STATUS is one line: a newline would start a bogus KEY=VALUE pair.
    return {} if text is None else {"STATUS": text.replace("\n", " ")}
