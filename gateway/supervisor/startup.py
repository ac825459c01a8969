"""Checks before anything is forked, beside the config checks (gateway.check): the ports, ``RunOverrides``.

Each failure is a ``StartupError`` whose message is one line naming the cause.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.config import Config
from gateway.net import parse_host_port


class StartupError(Exception):
    """The gateway cannot start; the message is one line naming the cause."""


@dataclass(frozen=True, slots=True)
class RunOverrides:
    """Command-line values that win over the config file, at start and on every reload."""

    workers: int | str | None = None
    listen: str | None = None

    def apply(self, config: Config) -> Config:
        changes: dict[str, Any] = {}
        if self.workers is not None:
            changes["workers"] = self.workers
        if self.listen is not None:
            changes["listen"] = self.listen
        return msgspec.structs.replace(config, **changes) if changes else config


def _resolve(address: str) -> tuple[int, tuple[Any, ...]]:
    host, port = parse_host_port(address)
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, sockaddr


def bind_error(field_name: str, address: str, exc: OSError) -> StartupError:
    reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return StartupError(f"{field_name}: cannot bind {address}: {reason}")


def check_listen_address(address: str) -> None:
    """Fail fast, with one line, when the data-plane port is taken.

    Bound without SO_REUSEPORT on purpose: that also detects another gateway
    (whose workers do use SO_REUSEPORT) instead of silently sharing its port.
    """
    try:
        family, sockaddr = _resolve(address)
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as exc:
        raise bind_error("listen", address, exc) from None


def bind_admin_socket(address: str) -> socket.socket:
    try:
        family, sockaddr = _resolve(address)
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise bind_error("admin.listen", address, exc) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise bind_error("admin.listen", address, exc) from None
    return sock

