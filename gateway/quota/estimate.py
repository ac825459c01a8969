"""Token estimate reserved at admission. Pure.

Heuristic for the prompt: ``ceil(body_bytes / 4)``. BPE tokenizers average about four bytes of
English text per token, and the JSON body also carries field names, roles and punctuation, so this
slightly over-estimates English prompts. It under-estimates dense scripts (CJK: three UTF-8 bytes
but about one token per character). Reconciliation with the provider's ``usage.total_tokens``
corrects either way, so the estimate only has to be cheap and of the right order of magnitude;
tokenising on the request path would cost far more than it saves.
"""

from __future__ import annotations

PROMPT_BYTES_PER_TOKEN = 4


def estimate_prompt_tokens(body_len: int) -> int:
    return -(-max(body_len, 0) // PROMPT_BYTES_PER_TOKEN)


def estimate_tokens(
    body_len: int,
    max_tokens: int | None,
    max_completion_tokens: int | None,
    default_max_tokens: int,
) -> int:
    """Prompt estimate plus the completion allowance: ``max_tokens``, else ``max_completion_tokens``,
    else the rule's ``default_max_tokens``. Negative or non-int allowances fall back to the default
    (the provider will reject such a request anyway; it must not produce a negative reservation).
    ``bool`` is an int subclass, and ``{"max_tokens": true}`` is not a count: hence ``__class__ is int``."""
    if max_tokens.__class__ is int and max_tokens >= 0:  # type: ignore[operator]
        completion = max_tokens
    elif max_completion_tokens.__class__ is int and max_completion_tokens >= 0:  # type: ignore[operator]
        completion = max_completion_tokens
    else:
        completion = default_max_tokens
    return estimate_prompt_tokens(body_len) + completion  # type: ignore[operator]
