"""The APIs the gateway serves, one row each (docs/api-surfaces.md). Pure data.

A row (``Surface``) says what the request path needs to know about one API:

- ``body``: which request-body fields the gateway reads: a family (``CHAT_BODY`` ...) that
  gateway/request/capability.py turns into the fields it decodes and the features the filters see;
- ``rewrites_stream``: whether a streamed request may be rewritten to ask for usage
  (``stream_options.include_usage``). Only APIs that define that member: a provider of any other
  answers 400 to it (the Responses and Messages APIs report usage in every stream anyway);
- ``usage``: where the answer carries its usage (``OPENAI_USAGE``, ``RESPONSES_USAGE``,
  ``MESSAGES_USAGE``, ``NO_USAGE``), which picks the response-side parser (gateway/request/usage.py);
- ``errors``: the shape of gateway-made errors (``OPENAI_SHAPE`` or ``ANTHROPIC_SHAPE``,
  gateway/http/errors.py): a client's SDK parses only its own API's shape;
- ``metered``: whether its tokens count against token quotas and budgets (counting a prompt's
  tokens, ``/v1/messages/count_tokens``, generates none and is free at the providers).

The route table (gateway/request/routes.py) builds its routes from ``API_SURFACES`` and hands each
admitted request its row on the ``AllowedRoute`` it already looks up: no second lookup per request.
Adding an API is adding a row to ``API_SURFACES`` (and a parser if its usage lives elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.http.errors import ANTHROPIC_SHAPE, OPENAI_SHAPE

# Body families: which fields the gateway reads (gateway/request/capability.py).
CHAT_BODY = 0  # chat completions and legacy completions: max_tokens, max_completion_tokens, messages, tools ...
EMBEDDINGS_BODY = 1  # model, input; the request needs the embeddings feature
RESPONSES_BODY = 2  # max_output_tokens, input items (input_image parts), tools, text.format
MESSAGES_BODY = 3  # Anthropic: max_tokens, messages (image blocks), tools
MCP_BODY = 4  # JSON-RPC: method, params.name
OTHER_BODY = 5  # routes beyond the defaults: model and stream only, as read for any body

# Where the usage of an answer lives (gateway/request/usage.py picks the parser).
OPENAI_USAGE = 0  # the body's `usage`; streamed: the usage chunk (`"choices": []`) before [DONE]
RESPONSES_USAGE = 1  # the body's `usage`; streamed: `response.usage` of response.completed/incomplete/failed
MESSAGES_USAGE = 2  # the body's `usage`; streamed: message_start's `message.usage`, then message_delta's `usage`
NO_USAGE = 3  # the answer reports no tokens used (nothing to read)


@dataclass(frozen=True, slots=True)
class Surface:
    """One API (see the module docstring). ``path`` is None for routes whose path is configured."""

    name: str
    path: str | None
    body: int
    rewrites_stream: bool
    usage: int
    errors: int
    metered: bool = True


CHAT_COMPLETIONS = Surface("chat_completions", "/v1/chat/completions", CHAT_BODY, True, OPENAI_USAGE, OPENAI_SHAPE)
COMPLETIONS = Surface("completions", "/v1/completions", CHAT_BODY, True, OPENAI_USAGE, OPENAI_SHAPE)
EMBEDDINGS = Surface("embeddings", "/v1/embeddings", EMBEDDINGS_BODY, False, OPENAI_USAGE, OPENAI_SHAPE)
RESPONSES = Surface("responses", "/v1/responses", RESPONSES_BODY, False, RESPONSES_USAGE, OPENAI_SHAPE)
MESSAGES = Surface("messages", "/v1/messages", MESSAGES_BODY, False, MESSAGES_USAGE, ANTHROPIC_SHAPE)
COUNT_TOKENS = Surface("count_tokens", "/v1/messages/count_tokens", MESSAGES_BODY, False, NO_USAGE, ANTHROPIC_SHAPE,
                       metered=False)

# The API routes every cluster serves (POST), in the order docs/api-surfaces.md lists them.
API_SURFACES = (CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES, COUNT_TOKENS)

# Routes that are not one API: the MCP endpoint (routing.mcp_path), the routes clusters list in
# allowed_routes (files, batches, ...: the gateway adds nothing to them), and GET /v1/models, which the
# gateway answers itself.
MCP = Surface("mcp", None, MCP_BODY, False, OPENAI_USAGE, OPENAI_SHAPE)
OTHER = Surface("other", None, OTHER_BODY, False, OPENAI_USAGE, OPENAI_SHAPE)
MODELS = Surface("models", "/v1/models", OTHER_BODY, False, NO_USAGE, OPENAI_SHAPE, metered=False)

SURFACE_BY_PATH: dict[str, Surface] = {surface.path: surface for surface in API_SURFACES}  # type: ignore[misc]

_ANTHROPIC_PREFIX = b"/v1/messages"


def error_shape_of_target(target: bytes) -> int:
    """The error shape for a request no route admitted (or before its route is known): Anthropic's
    under ``/v1/messages`` (``/v1/messages/batches`` ... come from Anthropic SDKs), else OpenAI's.
    For the error path only; an admitted request reads ``route.surface.errors``."""
    if target.startswith(_ANTHROPIC_PREFIX) and target[12:13] in (b"", b"/", b"?"):
        return ANTHROPIC_SHAPE
    return OPENAI_SHAPE
