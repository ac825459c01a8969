"""Usage of the Responses and Messages APIs, read from their answers (docs/api-surfaces.md). Pure.

Both APIs report usage in every answer, streamed or not, so their requests are never rewritten and
these observers never change a byte: ``feed`` returns the chunk it was given. They fill the same
attributes as the chat parsers (gateway/request/usage.py), counted the OpenAI way (what
gateway/pricing/cost.py expects): ``prompt_tokens`` all input tokens, cached and cache-written ones
included; ``completion_tokens`` all output tokens, reasoning included.

- Responses (``/v1/responses``): ``usage.input_tokens``, ``output_tokens``, ``total_tokens``,
  ``input_tokens_details.cached_tokens`` (and ``cache_write_tokens`` where reported),
  ``output_tokens_details.reasoning_tokens``; streamed, in
  ``response.usage`` of the last event (``response.completed``, ``response.incomplete`` or
  ``response.failed``; the earlier events carry ``"usage": null``).
- Messages (``/v1/messages``): ``usage.input_tokens`` excludes the cache: prompt = input +
  ``cache_read_input_tokens`` (``cached_tokens``) + ``cache_creation_input_tokens``
  (``cache_write_tokens``). Streamed: ``message_start`` carries ``message.usage`` (input side, and an
  output count that is not final); ``message_delta`` carries the final, cumulative ``usage`` (its
  members override). ``total_tokens`` is set only once the final usage arrived: a stream cut before
  ``message_delta`` leaves it None, so the request path charges what it relayed, not 1 output token.

Only events whose bytes hold ``"usage"`` are decoded (two or three per stream); every other chunk
costs a search for the event terminator. A non-streamed body is decoded once, whole: at once when it
comes in one chunk, else at ``flush`` from the chunks held (at most ``MAX_HELD_BYTES``; beyond that the
usage is unknown and the request is charged as the request path decides for a missing usage).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.request.surfaces import MESSAGES_USAGE, NO_USAGE, RESPONSES_USAGE
from gateway.request.usage import UsageObserver, usage_observer

MAX_HELD_BYTES = 8 * 1024 * 1024  # one whole answer, or one SSE event (the last repeats the output)
_USAGE_KEY = b'"usage"'
# An `error` event (both APIs end a stream that failed upstream with one). Looked for as the event's
# name: a chunk holding these bytes is read event by event, and only a real `event:` line counts.
_ERROR_NAME = b"event: error"
_ERROR_LINES = (b"event: error", b"event:error")
# The access line's error code of a stream the provider ended with an error event (docs/api-surfaces.md).
STREAM_ERROR = "upstream_error_event"

_Count = Annotated[int, msgspec.Meta(ge=0)]


# --- the fields decoded (everything else is skipped by the decoder) --------------------------------


class _InputDetails(msgspec.Struct, gc=False):
    cached_tokens: _Count | None = None
    cache_write_tokens: _Count | None = None


class _OutputDetails(msgspec.Struct, gc=False):
    reasoning_tokens: _Count | None = None


class _ResponsesUsage(msgspec.Struct, gc=False):
    input_tokens: _Count | None = None
    output_tokens: _Count | None = None
    total_tokens: _Count | None = None
    input_tokens_details: _InputDetails | None = None
    output_tokens_details: _OutputDetails | None = None


class _ResponseObject(msgspec.Struct, gc=False):
    usage: _ResponsesUsage | None = None


class _ResponsesEvent(msgspec.Struct, gc=False):
    """An answer (``usage`` at the top) or an event (``usage`` inside ``response``): one decoder for both."""

    usage: _ResponsesUsage | None = None
    response: _ResponseObject | None = None


class _MessagesUsage(msgspec.Struct, gc=False):
    input_tokens: _Count | None = None
    output_tokens: _Count | None = None
    cache_read_input_tokens: _Count | None = None
    cache_creation_input_tokens: _Count | None = None


class _MessageObject(msgspec.Struct, gc=False):
    usage: _MessagesUsage | None = None


class _MessagesEvent(msgspec.Struct, gc=False):
    """A message (``usage`` at the top), ``message_delta`` (likewise) or ``message_start`` (inside ``message``)."""

    type: str | None = None
    usage: _MessagesUsage | None = None
    message: _MessageObject | None = None


_decode_responses = msgspec.json.Decoder(_ResponsesEvent).decode
_decode_messages = msgspec.json.Decoder(_MessagesEvent).decode
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


# --- the observers ----------------------------------------------------------------------------------


class AnswerUsage:
    """Collects whole JSON documents from an answer (the body, or each SSE event's data that holds
    ``"usage"``) and hands them to ``_take``; never changes a byte."""

    __slots__ = ("total_tokens", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_write_tokens",
                 "reasoning_tokens", "stream_error", "_sse", "_held", "_held_bytes", "_done")

    def __init__(self, is_event_stream: bool) -> None:
        self.total_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.cache_write_tokens: int | None = None
        self.reasoning_tokens: int | None = None
        # ``STREAM_ERROR`` once the stream carried an `error` event: the provider failed mid-stream.
        self.stream_error: str | None = None
        self._sse = is_event_stream
        self._held: list[bytes] = []  # the answer so far (JSON), or the incomplete event (SSE)
        self._held_bytes = 0
        self._done = False  # JSON: the document was read (or given up on)

    def feed(self, chunk: bytes) -> bytes:
        if self._sse:
            # The usual chunk: whole events, none with usage (every delta): nothing to hold or read.
            if self._held or chunk[-2:] != b"\n\n" or _USAGE_KEY in chunk or _ERROR_NAME in chunk:
                self._feed_events(chunk)
        elif not self._done:
            if not self._held and chunk[:1] == b"{" and chunk[-1:] == b"}" and self._take_document(chunk):
                self._done = True  # the usual answer: whole in one chunk
            else:
                self._hold(chunk)
        return chunk

    def flush(self) -> bytes:
        held, self._held, self._held_bytes = b"".join(self._held), [], 0
        if held:
            if self._sse:
                self._take_event(held)  # a last event without its blank line
                self._check_error(held)
            elif not self._done:
                self._take_document(held)
        self._done = True
        return b""

    def _hold(self, chunk: bytes) -> None:
        self._held_bytes += len(chunk)
        if self._held_bytes > MAX_HELD_BYTES:  # not an answer we can read: give up, hold nothing
            self._held, self._held_bytes = [], 0
            if not self._sse:
                self._done = True
            return
        self._held.append(chunk)

    def _feed_events(self, chunk: bytes) -> None:
        held = self._held
        if held:
            # The incomplete event had no terminator, so one can only end in the new bytes.
            start = max(0, self._held_bytes - 3)
            data = b"".join(held) + chunk
        else:
            start, data = 0, chunk
        end = _last_event_end(data, start)
        if end < 0:  # still inside one event
            if held:
                self._held, self._held_bytes = [], 0
            self._hold(data)
            return
        if held:
            self._held, self._held_bytes = [], 0
        if _USAGE_KEY in data or _ERROR_NAME in data:  # the common event holds neither: nothing to decode
            complete = data[:end] if end < len(data) else data
            if _USAGE_KEY in complete or _ERROR_NAME in complete:
                for event in _events(complete):
                    if _USAGE_KEY in event:
                        self._take_event(event)
                    if _ERROR_NAME in event:
                        self._check_error(event)
        if end < len(data):
            self._hold(data[end:])

    def _check_error(self, event: bytes) -> None:
        """An `error` event: the provider ended the stream with an error (its `event:` line says so;
        the same bytes inside a JSON string would sit on a `data:` line)."""
        for line in event.replace(b"\r\n", b"\n").split(b"\n"):
            if line.rstrip() in _ERROR_LINES:
                self.stream_error = STREAM_ERROR
                return

    def _take_event(self, event: bytes) -> None:
        payload = _event_data(event)
        if payload is not None:
            self._take_document(payload)

    def _take_document(self, document: bytes) -> bool:
        """Read one JSON document; False when it is not one (yet)."""
        raise NotImplementedError


class ResponsesUsage(AnswerUsage):
    """The usage of a Responses API answer (see the module docstring)."""

    __slots__ = ()

    def _take_document(self, document: bytes) -> bool:
        try:
            event = _decode_responses(document)
        except _DECODE_ERRORS:
            return False
        usage = event.usage if event.response is None else event.response.usage
        if usage is None:
            return True
        prompt, completion = usage.input_tokens, usage.output_tokens
        total = usage.total_tokens
        if total is None and prompt is not None and completion is not None:
            total = prompt + completion
        self.prompt_tokens, self.completion_tokens, self.total_tokens = prompt, completion, total
        details = usage.input_tokens_details
        self.cached_tokens = None if details is None else details.cached_tokens
        self.cache_write_tokens = None if details is None else details.cache_write_tokens
        output_details = usage.output_tokens_details
        self.reasoning_tokens = None if output_details is None else output_details.reasoning_tokens
        return True


class MessagesUsage(AnswerUsage):
    """The usage of an Anthropic Messages API answer (see the module docstring)."""

    __slots__ = ("_input", "_output", "_read", "_written")

    def __init__(self, is_event_stream: bool) -> None:
        super().__init__(is_event_stream)
        self._input: int | None = None
        self._output: int | None = None
        self._read: int | None = None
        self._written: int | None = None

    def _take_document(self, document: bytes) -> bool:
        try:
            event = _decode_messages(document)
        except _DECODE_ERRORS:
            return False
        if event.type == "message_start":
            usage = event.message.usage if event.message is not None else None
            final = False
        else:  # a whole message, or message_delta: the final (cumulative) counts
            usage = event.usage
            final = True
        if usage is None:
            return True
        if usage.input_tokens is not None:
            self._input = usage.input_tokens
        if usage.output_tokens is not None:
            self._output = usage.output_tokens
        if usage.cache_read_input_tokens is not None:
            self._read = usage.cache_read_input_tokens
        if usage.cache_creation_input_tokens is not None:
            self._written = usage.cache_creation_input_tokens
        self._count(final)
        return True

    def _count(self, final: bool) -> None:
        if self._input is not None:
            self.prompt_tokens = self._input + (self._read or 0) + (self._written or 0)
            self.cached_tokens, self.cache_write_tokens = self._read, self._written
        if final:
            self.completion_tokens = self._output
            if self.prompt_tokens is not None and self._output is not None:
                self.total_tokens = self.prompt_tokens + self._output


def observer_for(usage: int, is_event_stream: bool, usage_rewritten: bool) -> UsageObserver | None:
    """The usage observer for one answer of a surface whose usage lives where ``usage`` says
    (``route.surface.usage``); None when the answer reports none (count_tokens: nothing to read)."""
    if usage == RESPONSES_USAGE:
        return ResponsesUsage(is_event_stream)
    if usage == MESSAGES_USAGE:
        return MessagesUsage(is_event_stream)
    if usage == NO_USAGE:
        return None
    return usage_observer(is_event_stream, usage_rewritten)


# --- SSE framing --------------------------------------------------------------------------------------


def _last_event_end(data: bytes, start: int) -> int:
    """The offset just past the last event terminator (a blank line) at or after ``start``; -1 if none."""
    lf = data.rfind(b"\n\n", start)
    crlf = data.rfind(b"\n\r\n", start)
    if lf < 0 and crlf < 0:
        return -1
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _events(data: bytes) -> list[bytes]:
    """The events of complete SSE text (each without its blank line), CRLF or LF."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    return [event for event in data.split(b"\n\n") if event]


def _event_data(event: bytes) -> bytes | None:
    """The ``data`` of one event: its ``data:`` lines joined (one optional space after the colon)."""
    lines = [line[5:] for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    if len(lines) == 1:
        line = lines[0]
        return line[1:] if line[:1] == b" " else line
    return b"\n".join(line[1:] if line[:1] == b" " else line for line in lines)
