"""Actual token usage from responses, and the request rewrite that makes streams report it. Pure.

Request side: a streaming request without ``stream_options.include_usage`` gets no usage from an
OpenAI-compatible provider, so the gateway sets it (``rewrite_request_for_usage``) and then hides what
that changes from the client (``SseUsageFilter``): the extra usage-only chunk (``"choices": []`` and a
``usage`` object) and the ``"usage": null`` member the provider adds to every other chunk. The
client's bytes are those it would have received without the rewrite.

Response side: ``usage_observer`` picks the observer for one response. Each ``feed(chunk)`` returns the
bytes to send to the client (the same object when nothing changes); ``flush()`` at the end returns
what is held back; ``total_tokens`` is the last ``usage.total_tokens`` seen (None if none), and
``prompt_tokens``/``completion_tokens`` the last counts of each side. ``cached_tokens`` (of the
prompt, ``prompt_tokens_details.cached_tokens``) and ``reasoning_tokens`` (of the completion,
``completion_tokens_details.reasoning_tokens``) are the parts priced apart (gateway/pricing/cost.py);
None when the provider did not report them; ``cache_write_tokens`` is always None here (OpenAI-style
usage does not report cache writes; Anthropic's does: gateway/request/usage_surfaces.py). Chunk
boundaries may fall anywhere, including inside ``"total_tokens"`` or its number.

This module serves the APIs whose usage lives where OpenAI's chat completions put it; the Responses
and Messages APIs have their own observers (gateway/request/usage_surfaces.py, ``observer_for``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Protocol

import msgspec

# --- request side -------------------------------------------------------------------------------


class _StreamFields(msgspec.Struct):
    stream: Any = False
    stream_options: Any = msgspec.UNSET


_stream_fields = msgspec.json.Decoder(_StreamFields)
_INCLUDE_USAGE_MEMBER = b'"stream_options":{"include_usage":true}'
_JSON_WS = b" \t\r\n"


def needs_usage_rewrite(stream: Any, stream_options: Any) -> bool:
    """True when a streamed response would not carry usage unless the gateway asks for it."""
    if stream is not True:
        return False
    return not (isinstance(stream_options, dict) and stream_options.get("include_usage") is True)


def rewrite_request_for_usage(body: bytes) -> bytes | None:
    """The request body with ``stream_options.include_usage`` set, or None when no rewrite is needed
    (not streaming, already asked for usage, or not a JSON object: the provider judges that).

    Call only for streaming requests (the worker has decoded ``stream`` already), so non-streaming
    requests pay nothing. When ``stream_options`` is absent (the common case) the member is spliced
    in after the opening brace without re-encoding the body; otherwise the body is re-encoded.
    The caller must send the new ``Content-Length``.
    """
    try:
        fields = _stream_fields.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if not needs_usage_rewrite(fields.stream, fields.stream_options):
        return None
    if fields.stream_options is msgspec.UNSET:
        start = _skip_ws(body, 0)
        after = _skip_ws(body, start + 1)
        separator = b"" if body[after : after + 1] == b"}" else b","
        return b"".join((body[: start + 1], _INCLUDE_USAGE_MEMBER, separator, body[start + 1 :]))
    if fields.stream_options is not None and not isinstance(fields.stream_options, dict):
        return None  # invalid stream_options: not ours to fix, the provider will say so
    try:
        document = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # nested too deeply for a full decode: the provider judges it
        return None
    document["stream_options"] = {**(fields.stream_options or {}), "include_usage": True}
    return msgspec.json.encode(document)


def _skip_ws(data: bytes, pos: int) -> int:
    while pos < len(data) and data[pos] in _JSON_WS:
        pos += 1
    return pos


# --- response side ------------------------------------------------------------------------------


class UsageObserver(Protocol):
    total_tokens: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    cache_write_tokens: int | None
    reasoning_tokens: int | None

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


def usage_observer(is_event_stream: bool, usage_rewritten: bool) -> UsageObserver:
    """The observer for one response: the SSE filter when the gateway rewrote the request and the
    provider streams, else the pass-through scanner."""
    if usage_rewritten and is_event_stream:
        return SseUsageFilter()
    return UsageScanner()


# The usage members recorded: `"<name>_tokens": N`. One search for their common tail per chunk.
# `cached_tokens` and `reasoning_tokens` are keys of the usage's details objects only.
_KEY_TAIL = b'_tokens"'
_LONGEST_KEY = len(b'"completion_tokens"')
_USAGE_VALUE = re.compile(rb'"(?:prompt|completion|total|cached|reasoning)_tokens"\s*:\s*(\d+)')
_USAGE_INCOMPLETE = re.compile(rb'"(?:prompt|completion|total|cached|reasoning)_tokens"\s*(?::\s*\d*)?')
_MAX_HELD = 256  # bytes of a split `"total_tokens": N` kept across chunks

_Count = Annotated[int, msgspec.Meta(ge=0)]


# Decoded once per metered response; none can form a cycle, so the GC need not track them.
class _PromptDetails(msgspec.Struct, gc=False):
    cached_tokens: _Count | None = None


class _CompletionDetails(msgspec.Struct, gc=False):
    reasoning_tokens: _Count | None = None


class _UsageCounts(msgspec.Struct, gc=False):
    total_tokens: _Count | None = None
    prompt_tokens: _Count | None = None
    completion_tokens: _Count | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None


class _UsageDocument(msgspec.Struct, gc=False):
    usage: _UsageCounts | None = None


_usage_document = msgspec.json.Decoder(_UsageDocument)
_USAGE_KEY = b'"usage"'
_OPEN = b"{"


def top_level_usage(document: bytes) -> _UsageCounts | None:
    """The top-level ``usage`` of a whole JSON object (None: absent, or not a usage object).

    Providers put ``usage`` last, after the choices: the object from its last ``"usage"`` key on, given
    an opening brace back (``{"usage": {...}}``, with any members after it), is decoded alone, so an
    answer of many kilobytes costs what its usage costs. That tail is valid JSON exactly when the key
    sits at the top level: one found inside a nested object or array leaves unbalanced closing brackets
    (and a raw ``"`` never occurs inside a JSON string), and the whole document is decoded instead.
    """
    at = document.rfind(_USAGE_KEY)
    if at > 0:
        try:
            return _usage_document.decode(_OPEN + document[at:]).usage
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass
    try:
        return _usage_document.decode(document).usage
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


class UsageScanner(msgspec.Struct, gc=False):
    """Finds ``"total_tokens": N`` (and the prompt/completion counts beside it) in a byte stream (JSON
    or SSE) without parsing or buffering it.

    Why a byte scan is exact enough: in JSON a raw ``"`` cannot occur inside a string (it is escaped
    as ``\\"``), so ``"total_tokens"`` followed by ``:`` is always a key; only ``usage`` objects carry
    it. The last value wins (the final usage of a stream).

    A ``msgspec.Struct`` (not for encoding): every metered response makes one, and its constructor
    runs in C.
    """

    total_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_write_tokens: int | None = None  # never reported in this shape
    _held: bytes = b""

    def feed(self, chunk: bytes) -> bytes:
        if chunk[-1:] == b"}" and chunk[:1] == b"{" and not self._held:
            # A whole JSON response in one chunk (the usual non-streamed answer): its top-level `usage`
            # decoded in C, ten times cheaper than the scan below, which takes anything else. A whole
            # document carries the whole usage: its counts are taken as they are (None where absent).
            usage = top_level_usage(chunk)
            if usage is not None and usage.total_tokens is not None:
                self.total_tokens, self.prompt_tokens, self.completion_tokens = usage.total_tokens, \
                    usage.prompt_tokens, usage.completion_tokens
                prompt_details, completion_details = usage.prompt_tokens_details, usage.completion_tokens_details
                self.cached_tokens = None if prompt_details is None else prompt_details.cached_tokens
                self.reasoning_tokens = None if completion_details is None else completion_details.reasoning_tokens
                return chunk
        data = self._held + chunk if self._held else chunk
        end = len(data)
        if _KEY_TAIL in data:
            for match in _USAGE_VALUE.finditer(data):
                if match.end() == end:
                    # The digits may go on in the next chunk: keep the member, judge it then.
                    self._held = data[match.start():]
                    return chunk
                value = int(match.group(1))
                kind = data[match.start() + 1]  # the key's first letter
                if kind == 116:  # t
                    self.total_tokens = value
                elif kind == 112:  # p
                    self.prompt_tokens = value
                elif kind == 114:  # r
                    self.reasoning_tokens = value
                elif data[match.start() + 2] == 111:  # co
                    self.completion_tokens = value
                else:  # ca
                    self.cached_tokens = value
            # The last key may be cut before its number: keep it whole for the next chunk.
            last = data.rfind(_KEY_TAIL)
            start = data.rfind(b'"', max(0, last - _LONGEST_KEY), last) if last >= 0 else -1
            if start >= 0 and end - start <= _MAX_HELD:
                incomplete = _USAGE_INCOMPLETE.match(data, start)
                if incomplete is not None and incomplete.end() == end:
                    self._held = data[start:]
                    return chunk
        # Keep what could be the start of a key split by the chunk boundary.
        self._held = data[-(_LONGEST_KEY - 1):]
        return chunk

    def flush(self) -> bytes:
        if self._held:
            # A number that ended exactly at the end of the stream.
            held, self._held = self._held, b""
            if _USAGE_VALUE.match(held) is not None:
                self.feed(held + b" ")  # the number ends here: any byte after it completes the match
        return b""


_EVENT = re.compile(rb".*?(?:\r\n\r\n|\n\n)", re.S)
# The last top-level member is `"usage": null` when it directly precedes the event's closing brace.
_TRAILING_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null(\s*\}\s*)\Z')
# Elsewhere: with its separator (group 1 is kept: the layout after the opening brace).
_ANY_USAGE_NULL = (
    re.compile(rb'(),\s*"usage"\s*:\s*null(?=\s*[,}])'),
    re.compile(rb'(\{\s*)"usage"\s*:\s*null\s*,\s*'),
    re.compile(rb'(\{\s*)"usage"\s*:\s*null\s*(?=\})'),
)
_MAX_PENDING_EVENT = 1 << 20  # an "event" larger than this is not SSE we understand: pass through


class _ChunkShape(msgspec.Struct):
    choices: Any = msgspec.UNSET
    usage: Any = msgspec.UNSET


_chunk_shape = msgspec.json.Decoder(_ChunkShape)


class SseUsageFilter:
    """Removes what ``include_usage`` added to an OpenAI-style SSE stream and records the usage.

    Whole events are forwarded as soon as their blank-line terminator arrives; only an incomplete
    trailing event is held back (the client could not act on half an event anyway). Events without
    ``"usage"`` pass untouched. ``"usage": null`` is removed from the top-level object (the provider
    puts it last; if it does not, the last such member in the event is removed).
    """

    __slots__ = ("total_tokens", "prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens",
                 "cache_write_tokens", "_pending", "_scanner")

    def __init__(self) -> None:
        self.total_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.reasoning_tokens: int | None = None
        self.cache_write_tokens: int | None = None  # never reported in this shape
        self._pending = b""
        self._scanner: UsageScanner | None = None  # set when the stream turned out not to be SSE

    def feed(self, chunk: bytes) -> bytes:
        if self._scanner is not None:
            self._scanner.feed(chunk)
            self._copy_from(self._scanner)
            return chunk
        data = self._pending + chunk if self._pending else chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end == 0:  # no complete event yet
            return self._hold(data)
        complete, self._pending = data[:end], data[end:]
        if b'"usage"' not in complete:
            return complete
        out, pos = [], 0
        for event in _EVENT.finditer(complete):
            out.append(self._filter_event(event.group()))
            pos = event.end()
        out.append(complete[pos:])  # stray blank lines between events: forwarded as they are
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        if self._scanner is None and b'"usage"' in rest:
            # A last event without its terminator: filter it the same way.
            return self._filter_event(rest)
        return rest

    def _hold(self, data: bytes) -> bytes:
        if len(data) <= _MAX_PENDING_EVENT:
            self._pending = data
            return b""
        # Not SSE as we know it: stop filtering and keep only scanning.
        self._pending = b""
        self._scanner = UsageScanner()
        self._scanner.feed(data)
        self._copy_from(self._scanner)
        return data

    def _copy_from(self, scanner: UsageScanner) -> None:
        self.total_tokens = scanner.total_tokens
        self.prompt_tokens = scanner.prompt_tokens
        self.completion_tokens = scanner.completion_tokens
        self.cached_tokens = scanner.cached_tokens
        self.reasoning_tokens = scanner.reasoning_tokens

    def _filter_event(self, event: bytes) -> bytes:
        if b'"usage"' not in event:
            return event
        body = event.rstrip(b"\r\n")
        # Search only the tail: the member sits right before the closing brace.
        trailing = _TRAILING_USAGE_NULL.search(body, max(0, len(body) - 64))
        if trailing is not None:  # the common chunk: `{..., "usage": null}` -> `{...}`
            return body[: trailing.start()] + trailing.group(1) + event[len(body) :]
        shape = _decode_data(event)
        if shape is None:
            return event
        if isinstance(shape.usage, dict):
            usage = shape.usage
            total, prompt, completion = (usage.get(k) for k in ("total_tokens", "prompt_tokens", "completion_tokens"))
            if _is_count(total):
                self.total_tokens = total
            if _is_count(prompt):
                self.prompt_tokens = prompt
            if _is_count(completion):
                self.completion_tokens = completion
            # The usage chunk carries the whole usage: a detail it lacks is unknown, not the last one seen.
            self.cached_tokens = _detail(usage, "prompt_tokens_details", "cached_tokens")
            self.reasoning_tokens = _detail(usage, "completion_tokens_details", "reasoning_tokens")
            if shape.choices == []:
                return b""  # the usage-only chunk the client did not ask for
            return event
        if shape.usage is None:
            for pattern in _ANY_USAGE_NULL:
                matches = list(pattern.finditer(event))
                if matches:
                    last = matches[-1]
                    return event[: last.start()] + last.group(1) + event[last.end() :]
        return event


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _detail(usage: dict[str, Any], details: str, name: str) -> int | None:
    """``usage[details][name]`` when it is a count, else None."""
    part = usage.get(details)
    value = part.get(name) if isinstance(part, dict) else None
    return value if _is_count(value) else None


def _decode_data(event: bytes) -> _ChunkShape | None:
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    payload = b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)
    try:
        return _chunk_shape.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # [DONE], or not JSON: forward untouched
