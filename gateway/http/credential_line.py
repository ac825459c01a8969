"""A long ``Authorization`` line set aside before the wire parser sees a request head.

A JWT bearer token is 300..1,500 bytes, and h11 matches its header-field regex over every byte of a
value (about 5 ns a byte in sre: 700 bytes cost 3-5 µs a request, as much as the rest of the head). The
codec (gateway/http/codec.py) therefore hands h11 the head with that one value replaced by a short
stand-in and, once h11 has parsed the head, puts the real value back in the stand-in's place.

Only a value h11 would accept as it is takes this way, so the outcome is h11's, byte for byte:

- the line is ``Authorization:`` or ``authorization:`` (other spellings go to h11 unchanged) and its
  value is at least ``min_bytes`` long;
- no line of the head is an obs-fold continuation (h11 would join it to the line before, moving every
  later field's index, or growing this very value);
- the value, stripped of one CR (h11 strips one per line) and of OWS (SP / HTAB) at both ends, holds
  none of the bytes h11's ``field-vchar`` excludes besides SP / HTAB: NUL, CR, VT, FF (``[^\\x00\\s]``);
  a LF cannot be in it, being the line's end.

Anything else (a bad byte, a fold, a short value) is h11's alone, with h11's own error. What h11 does
not check (control bytes it tolerates, duplicates, size and count limits) is checked afterwards by the
same code as before, which never sees the stand-in. Pure: bytes in, bytes out.
"""

from __future__ import annotations

# The shortest value worth setting aside: measured break-even near 300 bytes (the set-aside costs ~1.7 µs).
MIN_SET_ASIDE_BYTES = 256
# A valid field value h11 parses in one regex step, never a credential: it lives only between the codec's
# two calls and is never seen by the gateway.
STAND_IN = b"-"
_NAMES = (b"\nAuthorization:", b"\nauthorization:")
_NAME_LENGTH = len(_NAMES[0])
_OWS = b" \t"
_FOLDS = (b"\n ", b"\n\t")


class SetAside:
    """The head h11 should parse, and the field (its index among the head's fields) to restore."""

    __slots__ = ("head", "index", "value")

    def __init__(self, head: bytes, index: int, value: bytes) -> None:
        self.head = head
        self.index = index  # among the field lines (the request line is not one)
        self.value = value  # as h11 would have delivered it: OWS stripped


def set_aside(head: bytearray, min_bytes: int = MIN_SET_ASIDE_BYTES) -> SetAside | None:
    """``head`` (a complete request head, up to and including its empty line) with its long
    Authorization value replaced by ``STAND_IN``, or None when the head should go to h11 as it is."""
    start = head.find(_NAMES[0])
    if start < 0:
        start = head.find(_NAMES[1])
        if start < 0:
            return None
    value_start = start + _NAME_LENGTH
    stop = head.find(b"\n", value_start)  # always found: an empty line ends the head
    if stop - value_start < min_bytes or _FOLDS[0] in head or _FOLDS[1] in head:
        return None
    line_end = stop - 1 if head[stop - 1] == 13 else stop  # h11 drops one CR before each LF
    value = bytes(head[value_start:line_end]).strip(_OWS)
    if b"\r" in value or b"\x00" in value or b"\x0b" in value or b"\x0c" in value:
        return None  # h11 refuses it: its own error, its own words
    index = head.count(b"\n", 0, start + 1) - 1  # field lines before this one (the request line is not one)
    if index < 0:
        return None  # no request line before it: h11 refuses the head
    return SetAside(b"".join((head[:value_start], STAND_IN, head[line_end:])), index, value)
