"""The prompt prefix of a request: a hash of its leading prompt content (docs/routing.md, "Prefix affinity").

Providers' prompt caches (vLLM, OpenAI, Anthropic) serve the leading part of a prompt they have seen
before: the tools, the system prompt, the first turns. Requests that share that part should meet the
same provider; ``prompt_prefix`` names it with 8 bytes.

Cheap on purpose: one msgspec decode into a Struct of ``msgspec.Raw`` fields (the decoder skips every
other field and copies nothing: each field is a view of the body's own bytes), then one xxh3 over the
leading bytes of the fields that make the prompt, in the order providers render them:

- ``tools``, ``system`` (Messages), ``instructions`` (Responses), then the turns: ``messages`` (chat,
  Messages), ``input`` (Responses), ``prompt`` (completions);
- of a list of turns, every turn but the last (the last one is the new question that differs per
  request), unless it is the only content there is;
- at most ``limit`` bytes of that (about four bytes per token), so a long conversation keeps the
  prefix of its first turns.

Pure: bytes in, bytes (or None: no prompt to speak of) out.
"""

from __future__ import annotations

import msgspec
import xxhash

from gateway.request.surfaces import CHAT_BODY, MESSAGES_BODY, RESPONSES_BODY, Surface

BYTES_PER_TOKEN = 4  # the rough size of a token in JSON text; the limit is a budget, not a count
_EMPTY = msgspec.Raw()
_SEPARATOR = b"\x1e"  # between fields: `tools` then `messages` never hashes like one longer field
_digest = xxhash.xxh3_64_digest
PROMPT_FAMILIES = frozenset({CHAT_BODY, RESPONSES_BODY, MESSAGES_BODY})


class _PromptFields(msgspec.Struct):
    """The body fields a prompt is made of, as raw JSON (never parsed into objects)."""

    tools: msgspec.Raw = _EMPTY
    system: msgspec.Raw = _EMPTY
    instructions: msgspec.Raw = _EMPTY
    messages: list[msgspec.Raw] | None = None
    input: msgspec.Raw = _EMPTY
    prompt: msgspec.Raw = _EMPTY


_decoder = msgspec.json.Decoder(_PromptFields)
_turns_decoder = msgspec.json.Decoder(list[msgspec.Raw])


def has_prompt(surface: Surface) -> bool:
    """Whether requests of this API carry a prompt a provider caches (chat, completions, Responses,
    Messages; not embeddings, not token counting, not MCP)."""
    return surface.metered and surface.body in PROMPT_FAMILIES


def prompt_prefix(body: bytes, limit: int) -> bytes | None:
    """The 8-byte hash of the body's leading prompt content (at most ``limit`` bytes of it), or None
    when the body is not a JSON object with a prompt."""
    try:
        fields = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    head = [part for part in (fields.tools, fields.system, fields.instructions) if len(part) > 4]  # not null
    turns = fields.messages
    if turns is None:
        raw = fields.input if len(fields.input) else fields.prompt
        turns = _turns(raw)
    if turns:
        head += turns[:-1] if len(turns) > 1 else (turns if not head else ())
    if not head:
        return None
    return _digest(_leading(head, limit))


def _turns(raw: msgspec.Raw) -> list[msgspec.Raw]:
    """A Responses ``input`` or a completions ``prompt``: its items when it is a list, else itself."""
    if not len(raw) or (len(raw) == 4 and bytes(raw) == b"null"):
        return []
    if memoryview(raw)[:1] == b"[":
        try:
            return _turns_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return [raw]
    return [raw]


def _leading(parts: list[msgspec.Raw], limit: int) -> bytes:
    """The first ``limit`` bytes of the parts, joined; copies no more than it keeps."""
    taken: list[bytes | msgspec.Raw] = []
    size = 0
    for part in parts:
        if size + len(part) >= limit:
            taken.append(memoryview(part)[:limit - size].tobytes())
            break
        taken.append(part)
        taken.append(_SEPARATOR)
        size += len(part) + 1
    return b"".join(taken)  # type: ignore[arg-type]
