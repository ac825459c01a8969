"""The status pipe between a worker and the supervisor: typed messages, atomic writes, never blocking."""

from __future__ import annotations

import os
import time

import pytest

from gateway.process_protocol import (
    PIPE_BUF,
    Draining,
    Heartbeat,
    OverlayRejected,
    Ready,
    StatusReader,
    encode_status,
    send_status,
)


@pytest.fixture
def pipe():
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    yield read_fd, write_fd
    os.close(read_fd)
    os.close(write_fd)


def test_every_message_kind_crosses_the_pipe_typed(pipe):
    read_fd, write_fd = pipe
    sent = [
        Ready(revision="a" * 64, mode="roundRobin", capabilities=["inference_model/m"]),
        Heartbeat(),
        OverlayRejected(reason="digest_mismatch: content_digest differs", retained_revision="a" * 64),
        Draining(),
    ]
    for message in sent:
        send_status(write_fd, message)
    assert StatusReader().feed(os.read(read_fd, 65536)) == sent


def test_the_wire_is_one_json_line_tagged_by_kind():
    assert encode_status(Heartbeat()) == b'{"kind":"heartbeat"}\n'
    assert encode_status(Ready(revision="r", mode="random")) == b'{"kind":"ready","revision":"r","mode":"random"}\n'


def test_a_message_split_across_reads_is_decoded_once_complete():
    data = encode_status(Ready(revision="r", mode="deterministic", capabilities=["inference_model/m"]))
    assert data is not None
    reader = StatusReader()
    assert reader.feed(data[:10]) == []
    assert reader.feed(data[10:] + b'{"kind":"heart') == [
        Ready(revision="r", mode="deterministic", capabilities=["inference_model/m"])
    ]
    assert reader.feed(b'beat"}\n') == [Heartbeat()]


def test_garbage_and_unknown_kinds_are_skipped_not_fatal():
    reader = StatusReader()
    lines = b'not json\n{"kind":"reboot"}\n{"kind":"ready"}\n["a"]\n{"kind":"draining"}\n'
    assert reader.feed(lines) == [Draining()]


def test_ready_too_big_for_one_atomic_write_drops_only_the_capability_list():
    many = [f"inference_model/model-{i:05d}" for i in range(500)]
    data = encode_status(Ready(revision="r" * 64, mode="roundRobin", capabilities=many))
    assert data is not None and len(data) <= PIPE_BUF
    # None means "not sent": the supervisor keeps the list it had rather than emptying it.
    assert StatusReader().feed(data) == [Ready(revision="r" * 64, mode="roundRobin", capabilities=None)]


def test_a_long_rejection_reason_is_cut_to_fit_one_atomic_write():
    data = encode_status(OverlayRejected(reason="x" * 10_000, retained_revision="r" * 64))
    assert data is not None and len(data) <= PIPE_BUF
    (message,) = StatusReader().feed(data)
    assert isinstance(message, OverlayRejected)
    assert message.reason.startswith("x" * 1000) and message.reason.endswith("...")
    assert message.retained_revision == "r" * 64


def test_a_full_pipe_drops_messages_instead_of_blocking(pipe):
    read_fd, write_fd = pipe
    started = time.monotonic()
    for _ in range(100_000):  # far more than a pipe buffer holds (64 KiB by default)
        send_status(write_fd, Heartbeat())
    assert time.monotonic() - started < 5.0
    received = b""
    while True:
        try:
            chunk = os.read(read_fd, 1 << 20)
        except BlockingIOError:
            break
        received += chunk
    messages = StatusReader().feed(received)
    assert 0 < len(messages) < 100_000  # some went through, the rest were dropped
    assert received.endswith(b"\n")  # and no write was cut in half


def test_a_closed_pipe_is_silently_ignored():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    send_status(write_fd, Heartbeat())  # EPIPE (SIGPIPE is ignored by Python): no exception
    os.close(write_fd)
    send_status(write_fd, Heartbeat())  # EBADF: no exception either
