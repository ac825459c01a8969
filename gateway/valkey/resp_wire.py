"""The RESP2 wire format the gateway's Valkey client speaks (gateway/valkey/resp.py): a command
encoded as one byte string, and a reply parsed from a buffer. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from valkey._parsers import BaseParser  # its error-prefix table: exactly valkey-py's exception classes
from valkey.exceptions import DataError, InvalidResponse

CommandArg = bytes | str | int

_TEMPLATES: dict[int, bytes] = {}  # argument count -> the RESP framing of a command, to %-format


def encode_command(args: Sequence[CommandArg]) -> bytes:
    """One command as a RESP array of bulk strings. Ints are formatted straight to bytes (no str
    detour); bools and other types are refused like valkey-py does (``DataError``)."""
    fields: list[int | bytes] = []
    for arg in args:
        cls = arg.__class__
        if cls is str:
            arg = arg.encode()  # type: ignore[union-attr]
        elif cls is int:
            arg = b"%d" % arg
        elif cls is not bytes:
            raise DataError(
                f"Invalid input of type: {cls.__name__!r}. Convert to a bytes, string or int first."
            )
        fields += (len(arg), arg)  # type: ignore[arg-type]
    # One %-format for the whole command (~25% faster than formatting and joining per argument).
    count = len(args)
    template = _TEMPLATES.get(count)
    if template is None:
        template = b"*%d\r\n" % count + b"$%d\r\n%b\r\n" * count
        if count <= 64:  # the commands in use have a handful of argument counts
            _TEMPLATES[count] = template
    return template % tuple(fields)


class _Incomplete:
    """Marker type: the buffer ends inside a reply."""


INCOMPLETE = _Incomplete()


def read_reply(buf: bytes, pos: int) -> tuple[Any, int]:
    """Parse the RESP2 reply starting at ``buf[pos]``: ``(value, end)``.

    Values: simple string and bulk string -> bytes, integer -> int, nil -> None, array -> list
    (nested), error -> an exception instance (valkey-py's class for its prefix, e.g.
    ``NoScriptError``), returned, not raised, so errors inside arrays and pipelines stay in place.
    If the buffer ends inside the reply: ``(INCOMPLETE, n)`` where ``n`` is a lower bound of the
    buffer length needed, so the caller can wait for that much instead of re-parsing every chunk.
    """
    nl = buf.find(b"\r\n", pos)
    if nl < 0:
        return INCOMPLETE, len(buf) + 1
    kind = buf[pos]
    if kind == 36:  # $ bulk string
        size = int(buf[pos + 1 : nl])
        if size < 0:
            return None, nl + 2
        end = nl + 2 + size
        if end + 2 > len(buf):
            return INCOMPLETE, end + 2
        return buf[nl + 2 : end], end + 2
    if kind == 58:  # : integer
        return int(buf[pos + 1 : nl]), nl + 2
    if kind == 43:  # + simple string
        return buf[pos + 1 : nl], nl + 2
    if kind == 42:  # * array
        count = int(buf[pos + 1 : nl])
        if count < 0:
            return None, nl + 2
        items = []
        pos = nl + 2
        for _ in range(count):
            item, pos = read_reply(buf, pos)
            if item is INCOMPLETE:
                return INCOMPLETE, pos
            items.append(item)
        return items, pos
    if kind == 45:  # - error
        return BaseParser.parse_error(buf[pos + 1 : nl].decode(errors="replace")), nl + 2
    raise InvalidResponse(f"Protocol error, got {chr(kind)!r} as reply type byte")
