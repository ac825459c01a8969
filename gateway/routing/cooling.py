"""Cooling at the right scope: a 429/503 cools the *endpoint* that answered, and its provider only when
the answer speaks for the whole provider or no endpoint of it is left (docs/routing.md, "Cooling").
Pure: the request path reads the answer's head with :func:`cooling_signals`; the worker's provider
state (workers/providers.py) applies :func:`cooling_scope` and shares the result through shared memory.

Why a provider's endpoints are cooled one by one: a provider cluster is several replicas (endpoints)
behind one name, and an overloaded replica answering 503 (or a replica-local limiter answering 429)
says nothing about its siblings; cooling the whole provider on every worker for seconds, up to
minutes, took its healthy replicas out with it.

Which answers speak for the whole provider: a rate limit counted against the provider's credential,
which every endpoint shares (``upstream_auth`` is per cluster). Providers say so with the standard
remaining-quota headers, so a 429 or 503 carrying one of them at ``0`` cools the provider at once:

- ``x-ratelimit-remaining-requests`` / ``x-ratelimit-remaining-tokens`` (OpenAI, Azure OpenAI and the
  many APIs that copy them, gridgate's own token quota included);
- ``anthropic-ratelimit-requests-remaining``, ``anthropic-ratelimit-tokens-remaining``,
  ``anthropic-ratelimit-input-tokens-remaining``, ``anthropic-ratelimit-output-tokens-remaining``.

A ``Retry-After`` alone is per endpoint: it says when *this* server wants to be asked again.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum

# Response headers whose value 0 means the provider's credential is out of quota (every endpoint).
PROVIDER_WIDE_LIMIT_HEADERS = frozenset((
    b"x-ratelimit-remaining-requests",
    b"x-ratelimit-remaining-tokens",
    b"anthropic-ratelimit-requests-remaining",
    b"anthropic-ratelimit-tokens-remaining",
    b"anthropic-ratelimit-input-tokens-remaining",
    b"anthropic-ratelimit-output-tokens-remaining",
))


class Scope(IntEnum):
    """What a 429/503 cooled."""

    ENDPOINT = 1  # the endpoint that answered; its provider stays selectable through the others
    PROVIDER = 2  # the whole provider: every worker's new selections skip it


def cooling_signals(headers: Iterable[tuple[bytes, bytes]]) -> tuple[bytes | None, bool]:
    """(``Retry-After`` value or None, whether the answer says the whole provider is limited).

    One pass over a retryable answer's head (lower-case names, as the codec gives them); called only
    for 429/502/503/504 heads, never for a served response.
    """
    retry_after = None
    provider_wide = False
    for name, value in headers:
        if name == b"retry-after":
            if retry_after is None:
                retry_after = value
        elif name in PROVIDER_WIDE_LIMIT_HEADERS and value.strip() == b"0":
            provider_wide = True
    return retry_after, provider_wide


def cooling_scope(provider_wide: bool, cooled_endpoints: int, endpoints: int) -> Scope:
    """The scope of a 429/503 once the endpoint that sent it counts among ``cooled_endpoints`` of the
    provider's ``endpoints``: the provider when the answer said so or no endpoint is left."""
    if provider_wide or cooled_endpoints >= endpoints:
        return Scope.PROVIDER
    return Scope.ENDPOINT
