"""Server-sent events as the checks read them: strict framing, every problem named.

A provider's stream is judged, not merely consumed: an event must end with a blank line, and each
line must be a field the SSE format defines (``data``, ``event``, ``id``, ``retry``) or a comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_FIELDS = (b"data", b"event", b"id", b"retry")


@dataclass(frozen=True, slots=True)
class Event:
    name: str | None  # the ``event:`` field, None when absent
    data: str  # the ``data:`` lines joined with newlines


@dataclass(slots=True)
class Stream:
    events: list[Event] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def data(self) -> list[str]:
        return [event.data for event in self.events]


def parse_stream(body: bytes) -> Stream:
    """Split a whole ``text/event-stream`` body into events, noting every framing problem."""
    stream = Stream()
    text = body.replace(b"\r\n", b"\n")
    blocks = text.split(b"\n\n")
    if blocks and blocks[-1].strip():
        stream.problems.append("the stream ended inside an event (no blank line after the last one)")
    for block in blocks:
        if block.strip():
            _add_event(stream, block)
    return stream


def _add_event(stream: Stream, block: bytes) -> None:
    name: str | None = None
    data: list[str] = []
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue  # a comment (a keep-alive ping)
        key, _, value = line.partition(b":")
        if key not in _FIELDS:
            stream.problems.append(f"line {line[:40]!r} is not an SSE field")
            continue
        value = value[1:] if value.startswith(b" ") else value
        if key == b"data":
            data.append(value.decode("utf-8", "replace"))
        elif key == b"event":
            name = value.decode("utf-8", "replace")
    if data or name is not None:
        stream.events.append(Event(name, "\n".join(data)))
