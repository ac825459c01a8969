"""sd_notify without systemd: datagrams to $NOTIFY_SOCKET, watchdog interval, environment hygiene."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator

import pytest

from gateway.notify import Notifier, socket_address, watchdog_interval


@pytest.fixture
def listener(tmp_path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        yield path, sock


def fields(sock: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().split("\n"))


def test_ready_is_one_datagram_with_status(listener):
    path, sock = listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.ready("2/2 workers ready")
    assert fields(sock) == {"READY": "1", "STATUS": "2/2 workers ready"}


def test_reloading_carries_monotonic_usec(listener):
    path, sock = listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    received = fields(sock)
    assert received["RELOADING"] == "1"
    assert before <= int(received["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def test_stopping_watchdog_and_status(listener):
    path, sock = listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    notifier.stopping()
    notifier.watchdog()
    notifier.status("draining\nnow")
    assert fields(sock) == {"STOPPING": "1"}
    assert fields(sock) == {"WATCHDOG": "1"}
    assert fields(sock) == {"STATUS": "draining now"}  # one line: a newline would start a new field


def test_abstract_namespace_socket():
    name = f"gridgate-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert fields(sock) == {"READY": "1"}


def test_socket_address_forms():
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@abstract") == b"\0abstract"


def test_without_notify_socket_every_call_is_a_noop():
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.ready() and not notifier.watchdog() and not notifier.stopping()


def test_unreachable_socket_does_not_raise(tmp_path):
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.ready() is False


def test_takes_the_variables_out_of_the_environment_for_children():
    environ = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid()), "HOME": "/h"}
    notifier = Notifier(environ)
    assert environ == {"HOME": "/h"}
    assert notifier.watchdog_interval == 0.5


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "junk"}, None),
        ({"WATCHDOG_USEC": "20000000"}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "123"}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "456"}, None),  # meant for another process
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(environ, expected):
    assert watchdog_interval(environ, pid=123) == expected
