"""Where a streamed answer's first token is: the first event that carries content, per API surface
(prefix affinity's ``slow_first_token``, docs/routing.md "Prefix affinity").

A stream's head and its opening events (chat's role-only delta, Responses' ``response.created``,
Messages' ``message_start``) come before the model produced anything; the first token is the first
event with text, reasoning, a refusal or a tool call in it. Pure: patterns over the raw SSE bytes.
"""

from __future__ import annotations

import re

from gateway.request.surfaces import MESSAGES_USAGE, OPENAI_USAGE, RESPONSES_USAGE

# Chat and completions: a non-empty content/text/reasoning/refusal string, or a tool call.
_OPENAI = re.compile(rb'"(?:content|text|reasoning_content|reasoning|refusal)"\s*:\s*"(?!")|"tool_calls"\s*:\s*\[')
# Responses: any ``response.<part>.delta`` event (text, reasoning, refusal, function-call arguments).
_RESPONSES = re.compile(rb"response\.[a-z_.]+\.delta")
# Messages: a content block's delta (text, thinking, tool input).
_MESSAGES = re.compile(rb"content_block_delta")

_BY_USAGE = {OPENAI_USAGE: _OPENAI, RESPONSES_USAGE: _RESPONSES, MESSAGES_USAGE: _MESSAGES}
# Bytes of one chunk kept for the next: a marker cut across two chunks is still found.
OVERLAP = 48


def first_token_pattern(usage_kind: int) -> re.Pattern[bytes] | None:
    """The pattern of a content event in a stream of this surface's usage kind (None: it has none)."""
    return _BY_USAGE.get(usage_kind)
