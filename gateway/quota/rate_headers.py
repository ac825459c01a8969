"""The rate-limit headers an admission answers with (OpenAI's names) and how a reset time reads. Pure."""

from __future__ import annotations

H_RETRY_AFTER = b"retry-after"
H_LIMIT = b"x-ratelimit-limit-tokens"
H_REMAINING = b"x-ratelimit-remaining-tokens"
H_RESET = b"x-ratelimit-reset-tokens"
H_LIMIT_REQUESTS = b"x-ratelimit-limit-requests"
H_REMAINING_REQUESTS = b"x-ratelimit-remaining-requests"
H_RESET_REQUESTS = b"x-ratelimit-reset-requests"
TOKEN_HEADERS = (H_LIMIT, H_REMAINING, H_RESET)
REQUEST_HEADERS = (H_LIMIT_REQUESTS, H_REMAINING_REQUESTS, H_RESET_REQUESTS)


def duration_text(ms: int) -> bytes:
    """``x-ratelimit-reset-*`` in the duration form OpenAI uses (``250ms``, ``17.5s``, ``6m0s``,
    ``1h2m3s``), so clients that already parse OpenAI's headers parse ours."""
    ms = max(0, ms)
    if ms < 1000:
        return b"%dms" % ms
    minutes, ms = divmod(ms, 60000)
    hours, minutes = divmod(minutes, 60)
    seconds = (b"%d.%03d" % divmod(ms, 1000)).rstrip(b"0").rstrip(b".") + b"s"
    if hours:
        return b"%dh%dm" % (hours, minutes) + seconds
    if minutes:
        return b"%dm" % minutes + seconds
    return seconds
