"""The worker -> supervisor status channel: one JSON object per line on a pipe.

Messages (all carry ``"slot"``):
- ``{"kind": "ready", "revision": str, "mode": str, "capabilities": [str], "pid": int}``: serving a snapshot
  (sent at start and after every overlay change);
- ``{"kind": "heartbeat", "t": float}``: once a second while the event loop is responsive;
- ``{"kind": "overlay_rejected", "reason": str, "retained_revision": str}``: a reload kept last-known-good;
- ``{"kind": "draining"}``: stopped accepting, finishing in-flight requests.
Writes are small (< PIPE_BUF) so each one is atomic; a full pipe drops the message rather than block.
"""

from __future__ import annotations

import os

import msgspec

_encoder = msgspec.json.Encoder()


def send_status(fd: int, message: dict) -> None:
    data = _encoder.encode(message) + b"\n"
    if len(data) > 4096:
        # Keep each write atomic on the pipe: drop the optional bulky field.
        message = {k: v for k, v in message.items() if k != "capabilities"}
        data = _encoder.encode(message) + b"\n"
    try:
        os.write(fd, data)
    except (BlockingIOError, BrokenPipeError, OSError):
        pass


class StatusReader:
    """Splits the bytes read from a status pipe into decoded messages."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[dict]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        messages = []
        for line in lines:
            try:
                message = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            if isinstance(message, dict):
                messages.append(message)
        return messages
