"""Token estimate reserved at admission. Pure.

Heuristic for the prompt: ``ceil(body_bytes / 4)``. BPE tokenizers average about four bytes of
English text per token, and the JSON body also carries field names, roles and punctuation, so this
slightly over-estimates English prompts. It under-estimates dense scripts (CJK: three UTF-8 bytes
but about one token per character). Reconciliation with the provider's ``usage.total_tokens``
corrects either way, so the estimate only has to be cheap and of the right order of magnitude;
tokenising on the request path would cost far more than it saves.

The completion allowance is the largest one the body names (``completion_allowance``): providers
obey the field they know, so a request naming ``max_tokens: 1`` beside ``max_completion_tokens:
20000`` may generate 20,000 tokens, and must be reserved for that many.
"""

from __future__ import annotations

PROMPT_BYTES_PER_TOKEN = 4
# The ledger's Lua numbers are doubles: counts above 2**53 lose their meaning there. No budget is that
# large, so a larger allowance is still refused (it can never fit), and stays an exact integer.
MAX_ALLOWANCE = 2**53 - 1


def estimate_prompt_tokens(body_len: int) -> int:
    return -(-max(body_len, 0) // PROMPT_BYTES_PER_TOKEN)


def completion_allowance(
    max_tokens: int | None, max_completion_tokens: int | None, max_output_tokens: int | None = None
) -> int | None:
    """The largest completion allowance the body names: ``max_tokens`` (chat, completions, messages),
    ``max_completion_tokens`` (chat) or ``max_output_tokens`` (responses); None when it names none.
    Negative or non-int values are ignored (the provider rejects such a request; it must not shrink or
    negate a reservation); a value beyond ``MAX_ALLOWANCE`` counts as that. ``bool`` is an int
    subclass, and ``{"max_tokens": true}`` is not a count: hence ``__class__ is int``. No call per
    field: this runs for every metered request."""
    allowance = -1
    if max_tokens.__class__ is int and max_tokens > allowance:  # type: ignore[operator]
        allowance = max_tokens  # type: ignore[assignment]
    if max_completion_tokens.__class__ is int and max_completion_tokens > allowance:  # type: ignore[operator]
        allowance = max_completion_tokens  # type: ignore[assignment]
    if max_output_tokens.__class__ is int and max_output_tokens > allowance:  # type: ignore[operator]
        allowance = max_output_tokens  # type: ignore[assignment]
    if allowance < 0:
        return None
    return allowance if allowance <= MAX_ALLOWANCE else MAX_ALLOWANCE


def estimate_tokens(
    body_len: int,
    max_tokens: int | None,
    max_completion_tokens: int | None,
    default_max_tokens: int,
    max_output_tokens: int | None = None,
) -> int:
    """Prompt estimate plus the completion allowance (``completion_allowance``), else the rule's
    ``default_max_tokens``."""
    allowance = completion_allowance(max_tokens, max_completion_tokens, max_output_tokens)
    return estimate_prompt_tokens(body_len) + (default_max_tokens if allowance is None else allowance)
