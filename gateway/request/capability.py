"""Capability lookup: which ``(kind, name)`` a request asks for (docs/routing.md#the-steps,
docs/overlay.md#session-affinity).

Pure and fast: one msgspec decode of a JSON body into a small Struct that names only
the fields the gateway uses; every other field is skipped by the decoder, not built.

Rules, in order:

1. A JSON-RPC 2.0 body (``"jsonrpc": "2.0"``) is MCP:
   - ``tools/call`` routes to the ``mcp_tool`` capability named by ``params.name``
     (it wins over the model header: the body names the tool being called);
   - every other message (``initialize``, ``notifications/*``, ``tools/list``, ``ping``,
     ``resources/*``, ``prompts/*``, a client's response to a server request) names no
     tool and returns ``("mcp_tool", "")``, the *MCP session route*: the first admissible
     ``mcp_tool`` candidate in overlay file order (see
     ``gateway.overlay.snapshot.MCP_SESSION_CAPABILITY``). Reasons: those methods must
     reach a real MCP server that answers them (the gateway cannot synthesise a
     ``tools/list`` answer: the overlay has no tool schemas); one deterministic target
     keeps ``initialize`` and the session's follow-ups on the same server; and with
     session affinity enabled the session route keeps any live ``mcp_tool`` binding of
     the session (e.g. the server its last ``tools/call`` went to).
2. Else the model header (trimmed of OWS; 1..256 visible ASCII, else 400
   ``invalid_model_header``) names an ``inference_model``.
3. Else the body's ``"model"`` string (1..256 bytes, not blank, else 400 ``invalid_model``).
4. Else 400 ``missing_capability``.

Which body fields the features come from depends on the API (``gateway.request.surfaces``,
docs/api-surfaces.md): chat's ``messages`` parts and ``response_format``; the Responses API's
``input`` items and ``text.format``; Anthropic's ``messages`` blocks; ``tools`` on all three.

A body is decoded when it is non-empty and its content type is JSON (``application/json``
or ``*+json``) or absent. Undecodable JSON (invalid UTF-8, nested too deeply for the decoder)
is 400 ``invalid_json``; a known field of the wrong type (``"stream": "yes"``) or out of range
(``"max_tokens": 1e400``) is 400 ``invalid_request``.
"""

from __future__ import annotations

import re

import msgspec

from gateway.http.errors import ErrorReply
from gateway.http.media import is_json_content_type
from gateway.request.estimate import MAX_ALLOWANCE, completion_allowance
from gateway.request.features import AUDIO, EMBEDDINGS, JSON_SCHEMA, TOOLS, VISION
from gateway.request.headers import MAX_TOKEN_BYTES, OWS, VISIBLE_ASCII
from gateway.request.surfaces import (
    API_SURFACES,
    EMBEDDINGS_BODY,
    MESSAGES_BODY,
    OTHER_BODY,
    RESPONSES_BODY,
)

MAX_NAME_BYTES = MAX_TOKEN_BYTES
MCP_SESSION_NAME = ""  # see gateway.overlay.snapshot.MCP_SESSION_CAPABILITY


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ToolParams(msgspec.Struct):
    name: str | None = None


class BodyFields(msgspec.Struct):
    """The request-body fields the gateway reads (quota estimate, usage, routing)."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None  # the Responses API's completion allowance
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    jsonrpc: str | None = None
    method: str | None = None
    params: ToolParams | None = None

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        return bool(options is not None and options.include_usage)

    @property
    def completion_allowance(self) -> int | None:
        """The largest completion allowance the body names (``gateway.request.estimate``)."""
        max_tokens, max_completion_tokens, max_output_tokens = \
            self.max_tokens, self.max_completion_tokens, self.max_output_tokens
        # The usual body names max_tokens alone, a plain count (or nothing): answered without the call.
        if max_completion_tokens is None and max_output_tokens is None:
            if max_tokens is None:
                return None
            if max_tokens.__class__ is int and 0 <= max_tokens <= MAX_ALLOWANCE:
                return max_tokens
        return completion_allowance(max_tokens, max_completion_tokens, max_output_tokens)


_ABSENT = msgspec.Raw()  # raw fields default to empty bytes: absent


class MessageContent(msgspec.Struct):
    content: msgspec.Raw = _ABSENT  # kept raw: only a list of parts is looked into


class ResponseFormat(msgspec.Struct):
    type: str | None = None


class FactFields(BodyFields):
    """``BodyFields`` plus what request-aware eligibility needs (decoded only when it is configured)."""

    tools: msgspec.Raw = _ABSENT
    tool_choice: msgspec.Raw = _ABSENT
    functions: msgspec.Raw = _ABSENT
    response_format: ResponseFormat | None = None
    messages: list[MessageContent] | None = None
    input: msgspec.Raw = _ABSENT  # the Responses API's input (a string or a list of items)
    modalities: list[str] | None = None
    text: msgspec.Raw = _ABSENT  # the Responses API's output config; kept raw: other APIs may use the name


class _TextConfig(msgspec.Struct):
    format: ResponseFormat | None = None


_text_config = msgspec.json.Decoder(_TextConfig)

# Content-part types in a JSON body. A raw `"` cannot occur inside a JSON string (it is escaped), so
# finding the quoted type name finds a real part type, never user text.
_IMAGE_PARTS = (b'"image_url"', b'"input_image"')
_AUDIO_PARTS = (b'"input_audio"',)
_EMPTY = (b"", b"[]", b"null", b'"none"')
# An Anthropic image block: `"image"` alone could be a text's whole value; as the value of a `"type"`
# key (a quoted string followed by `:` is always a key) it is a block type.
_ANTHROPIC_IMAGE = b'"image"'
_ANTHROPIC_IMAGE_BLOCK = re.compile(rb'"type"\s*:\s*"image"')

_BODY_BY_PATH = {surface.path.encode(): surface.body for surface in API_SURFACES}  # type: ignore[union-attr]


def _has_part(raw: bytes, kinds: tuple[bytes, ...]) -> bool:
    return raw[:1] == b"[" and any(kind in raw for kind in kinds)


def request_features(fields: BodyFields | None, target: bytes) -> int:
    """``body_features`` for the API at ``target``'s path (a caller holding the request's route should
    pass ``route.surface.body`` to ``body_features`` instead: no lookup)."""
    query = target.find(b"?")
    return body_features(fields, _BODY_BY_PATH.get(target if query < 0 else target[:query], OTHER_BODY))


def body_features(fields: BodyFields | None, body: int) -> int:
    """The features a request uses (``gateway.routing.eligibility`` bits): tools, image parts, JSON
    schema output, audio, embeddings; read where the API (``body``: a ``gateway.request.surfaces``
    family) puts them."""
    features = EMBEDDINGS if body == EMBEDDINGS_BODY else 0
    if type(fields) is not FactFields:
        return features
    if body == MESSAGES_BODY:
        return features | _messages_features(fields)
    for raw in (fields.tools, fields.tool_choice, fields.functions):
        if bytes(raw).strip() not in _EMPTY:
            features |= TOOLS
            break
    if fields.response_format is not None and fields.response_format.type == "json_schema":
        features |= JSON_SCHEMA
    elif body == RESPONSES_BODY and _text_format(bytes(fields.text)) == "json_schema":
        features |= JSON_SCHEMA
    if fields.modalities and "audio" in fields.modalities:
        features |= AUDIO
    contents = [bytes(m.content) for m in fields.messages or ()]
    contents.append(bytes(fields.input))
    for raw in contents:
        if _has_part(raw, _IMAGE_PARTS):
            features |= VISION
        if _has_part(raw, _AUDIO_PARTS):
            features |= AUDIO
    return features


def _messages_features(fields: FactFields) -> int:
    """Anthropic Messages: ``tools`` (``tool_choice`` needs them), image blocks in ``messages`` (also
    inside a ``tool_result``'s content)."""
    features = TOOLS if bytes(fields.tools).strip() not in _EMPTY else 0
    for message in fields.messages or ():
        raw = bytes(message.content)
        if raw[:1] == b"[" and _ANTHROPIC_IMAGE in raw and _ANTHROPIC_IMAGE_BLOCK.search(raw):
            return features | VISION
    return features


def _text_format(raw: bytes) -> str | None:
    """The Responses API's ``text.format.type`` (None when absent or not that shape)."""
    if raw[:1] != b"{":
        return None
    try:
        config = _text_config.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return None if config.format is None else config.format.type


class CapabilityRequest(msgspec.Struct, frozen=True):
    """The capability to route and the decoded body fields (None when no JSON body was read)."""

    kind: str
    name: str
    body: BodyFields | None


_DECODER = msgspec.json.Decoder(BodyFields)
_FACTS_DECODER = msgspec.json.Decoder(FactFields)


def header_token(raw: bytes | str | None, max_bytes: int = MAX_NAME_BYTES) -> bytes | None:
    """Trim OWS; return the value if it is 1..max_bytes visible ASCII, else None."""
    if raw.__class__ is not bytes:  # the request path passes bytes: one test for it
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = raw.encode("latin-1")
            except UnicodeEncodeError:
                return None
    value = raw.strip(OWS)  # type: ignore[union-attr]
    if not value or len(value) > max_bytes or value.translate(None, VISIBLE_ASCII):  # not visible ASCII
        return None
    return value


def decode_body(body: bytes | bytearray | memoryview, facts: bool = False) -> BodyFields | ErrorReply:
    try:
        return (_FACTS_DECODER if facts else _DECODER).decode(body)
    except msgspec.ValidationError as exc:
        return ErrorReply(400, "invalid_request", f"Invalid request body: {exc}")
    except msgspec.DecodeError as exc:
        return ErrorReply(400, "invalid_json", f"Request body is not valid JSON: {exc}")
    except RecursionError:
        # msgspec recurses per nesting level, even to skip a field: ~1,000 levels exhaust the stack.
        return ErrorReply(400, "invalid_json", "Request body is not valid JSON: nested too deeply")


def _valid_body_name(name: str) -> bool:
    return bool(name.strip()) and len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES


def lookup_capability(
    header_value: bytes | str | None,
    body: bytes | bytearray | memoryview,
    content_type: bytes | str | None,
    facts: bool = False,
) -> CapabilityRequest | ErrorReply:
    """Which capability a request asks for, plus its body fields (``FactFields`` when ``facts``)."""
    fields: BodyFields | None = None
    if body and is_json_content_type(content_type):
        decoded = decode_body(body, facts)
        if type(decoded) is ErrorReply:
            return decoded
        fields = decoded
        if fields.jsonrpc == "2.0":
            # Any JSON-RPC message but tools/call (other methods, or a client's response
            # to a server request) belongs to the MCP session, not to one tool.
            if fields.method != "tools/call":
                return CapabilityRequest("mcp_tool", MCP_SESSION_NAME, fields)
            tool = fields.params.name if fields.params is not None else None
            if tool is None or not _valid_body_name(tool):
                return ErrorReply(
                    400, "invalid_request", "tools/call needs params.name: the tool to call (1..256 bytes)."
                )
            return CapabilityRequest("mcp_tool", tool, fields)

    if header_value is not None:
        name = header_token(header_value)
        if name is None:
            return ErrorReply(
                400, "invalid_model_header", "The model header must be 1..256 visible ASCII characters."
            )
        return CapabilityRequest("inference_model", name.decode("ascii"), fields)

    model = fields.model if fields is not None else None
    if model is not None:
        if not _valid_body_name(model):
            return ErrorReply(
                400, "invalid_model", 'The body "model" must be 1..256 bytes and not blank.'
            )
        return CapabilityRequest("inference_model", model, fields)
    return ErrorReply(
        400,
        "missing_capability",
        'No capability: send the model header or a JSON body with a "model" string.',
    )


def _cookie_value(cookie_header: bytes, name: bytes) -> bytes | None:
    """First value of cookie ``name`` in a ``Cookie`` header (RFC 6265 ``a=b; c=d``)."""
    for pair in cookie_header.split(b";"):
        key, sep, value = pair.partition(b"=")
        if sep and key.strip(OWS) == name:
            value = value.strip(OWS)
            if len(value) >= 2 and value[0] == 0x22 and value[-1] == 0x22:
                value = value[1:-1]
            return value
    return None


def session_key(
    header_value: bytes | str | None,
    cookie_header: bytes | str | None = None,
    cookie_name: bytes | str | None = None,
) -> bytes | None:
    """The session-affinity key: the configured header if valid, else the configured cookie.

    Both are trimmed and must be 1..256 visible ASCII; an invalid or oversized value is
    ignored (no affinity) rather than rejected.
    """
    if header_value.__class__ is bytes:
        # header_token's test written out for the bytes the request path passes: one call fewer per request.
        key = header_value.strip(OWS)  # type: ignore[union-attr]
        if key and len(key) <= MAX_NAME_BYTES and not key.translate(None, VISIBLE_ASCII):
            return key
    else:
        key = header_token(header_value)
        if key is not None:
            return key
    if cookie_header is None or cookie_name is None:
        return None
    if isinstance(cookie_header, str):
        cookie_header = cookie_header.encode("latin-1", "replace")
    if isinstance(cookie_name, str):
        cookie_name = cookie_name.encode("latin-1", "replace")
    return header_token(_cookie_value(cookie_header, cookie_name))
