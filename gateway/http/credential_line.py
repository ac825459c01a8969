"""A long ``Authorization`` line set aside before the wire parser sees a request head.

Only for the heads h11 parses: a plainly valid head (almost all) is parsed by gateway/http/request_head.py
and never comes here.

A JWT bearer token is 300..1,500 bytes, and h11 matches its header-field regex over every byte of a
value (about 5 ns a byte in sre: 700 bytes cost 3-5 µs a request, as much as the rest of the head). The
codec (gateway/http/codec.py) therefore hands h11 the head with that one value replaced by a short
stand-in and, once h11 has parsed the head, puts the real value back in the stand-in's place.

Only a value h11 would accept as it is takes this way, so the outcome is h11's, byte for byte:

- the line is ``Authorization:`` or ``authorization:`` (other spellings go to h11 unchanged) and its
  value is at least ``min_bytes`` long;
- h11 returns one field per field line of the head (the codec checks it, ``field_lines``): an obs-fold
  continuation, which h11 joins to the line before (moving every later field's index, or growing this
  very value), makes one fewer, and the head is then parsed again as it came (so is a head whose
  identical Content-Length lines h11 merged: rare, and only slower);
- the value, stripped of one CR (h11 strips one per line) and of OWS (SP / HTAB) at both ends, holds
  none of the bytes h11's ``field-vchar`` excludes besides SP / HTAB: NUL, CR, VT, FF (``[^\\x00\\s]``);
  a LF cannot be in it, being the line's end.

Anything else (a bad byte, a fold, a short value) is h11's alone, with h11's own error. What h11 does
not check (control bytes it tolerates, duplicates, size and count limits) is checked afterwards by the
same code as before, which never sees the stand-in. Pure: bytes in, bytes out.
"""

from __future__ import annotations

# The shortest value worth setting aside: measured break-even near 300 bytes (the set-aside costs ~1.3 µs).
MIN_SET_ASIDE_BYTES = 256
# A valid field value h11 parses in one regex step, never a credential: it lives only between the codec's
# two calls and is never seen by the gateway.
STAND_IN = b"-"
_NAME = b"\nAuthorization:"
_NAME_LOWER = b"\nauthorization:"
_NAME_LENGTH = len(_NAME)

# (the head h11 should parse, the field's index among the head's field lines, the value as h11 would have
# delivered it: OWS stripped). A plain tuple: it is made once per long-credential request.
SetAside = tuple[bytes, int, bytes]


def set_aside(head: bytes | bytearray, min_bytes: int = MIN_SET_ASIDE_BYTES) -> SetAside | None:
    """``head`` (a complete request head, up to and including its empty line) with its long
    Authorization value replaced by ``STAND_IN``, or None when the head should go to h11 as it is."""
    start = head.find(_NAME)
    if start < 0:
        start = head.find(_NAME_LOWER)
        if start < 0:
            return None
    value_start = start + _NAME_LENGTH
    line_end = head.find(b"\n", value_start)  # always found: an empty line ends the head
    if line_end - value_start < min_bytes:
        return None
    if head[line_end - 1] == 13:  # h11 drops one CR before each LF
        line_end -= 1
    value = bytes(head[value_start:line_end]).strip(b" \t")
    if b"\r" in value or b"\x00" in value or b"\x0b" in value or b"\x0c" in value:
        return None  # h11 refuses it: its own error, its own words
    # The lines before this one, less the request line: its index among the field lines.
    return b"".join((head[:value_start], STAND_IN, head[line_end:])), head.count(b"\n", 0, start), value
