"""W3C Trace Context (https://www.w3.org/TR/trace-context/): reading a client's ``traceparent``,
writing ours, and the sampling rule (docs/tracing.md, "Sampling").

Pure: ids come from the caller's random source, so tests can pin them.

The rule is the OpenTelemetry SDK's default, parent-based with a trace-id ratio at the root:

- a client ``traceparent`` with the *sampled* flag: the request is traced, in the client's trace;
- one without the flag: the request is not traced (the client decided; its header is forwarded as it
  came, so the trace stays whole downstream);
- none (or a malformed one, which the W3C rule says to ignore): traced with probability ``sample``, in
  a new trace (the draw is the tracer's: workers/tracing.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple

_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL).fullmatch
_INVALID_TRACE = b"0" * 32
_INVALID_SPAN = b"0" * 16
SAMPLED = 0x01


class Parent(NamedTuple):
    """A valid client ``traceparent``: its trace id and span id (lowercase hex) and whether it is sampled."""

    trace_id: str
    span_id: str
    sampled: bool


def parse_traceparent(value: bytes | None) -> Parent | None:
    """The client's parent, or None when the header is absent or not a valid traceparent: version 00
    exactly ``00-<32 hex>-<16 hex>-<2 hex>``; a later version (not ``ff``) may append ``-`` fields, read
    as 00; lowercase hex, ids not all zero."""
    if value is None:
        return None
    match = _TRACEPARENT(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == b"ff" or (version == b"00" and rest) or trace_id == _INVALID_TRACE or span_id == _INVALID_SPAN:
        return None
    return Parent(trace_id.decode(), span_id.decode(), bool(int(flags, 16) & SAMPLED))


def traceparent(trace_id: str, span_id: str) -> bytes:
    """Our ``traceparent`` for a sampled span (the provider continues the trace under it)."""
    return b"00-%s-%s-01" % (trace_id.encode(), span_id.encode())


def trace_id_hex(trace_id: int) -> str:
    return f"{trace_id:032x}"


def span_id_hex(span_id: int) -> str:
    return f"{span_id:016x}"
