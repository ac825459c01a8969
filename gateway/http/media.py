"""Media-type rules, one place each: which bodies are JSON, which responses are event streams."""

from __future__ import annotations

_OWS = b" \t"


def _media_type(content_type: bytes) -> bytes:
    return content_type.split(b";", 1)[0].strip(_OWS).lower()


def is_json_content_type(content_type: bytes | str | None) -> bool:
    """Absent, ``application/json`` or any ``*+json`` (case-insensitive, parameters ignored)."""
    if content_type is None:
        return True
    if isinstance(content_type, str):
        content_type = content_type.encode("latin-1", "replace")
    media = _media_type(content_type)
    return not media or media == b"application/json" or media.endswith(b"+json")


def is_event_stream(content_type: bytes | None) -> bool:
    """``text/event-stream`` (case-insensitive, parameters ignored): a server-sent event stream."""
    return content_type is not None and _media_type(content_type) == b"text/event-stream"
