"""Sans-IO bookkeeping of one request's upstream attempts and of what its quota reservation owes.

The proxy does the I/O; this decides: after a failed attempt, what next (another endpoint, the same
endpoint on a fresh connection, or stop); which error the client finally sees; and what each attempt
costs the tenant's token reservation (``attempt_tokens``, ``unanswered_tokens``, ``served_tokens``).
An attempt's outcome is an ``AttemptResult``, what the relay answers when the attempt is over.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Generic, TypeVar

import msgspec

from gateway.http.errors import ErrorReply
from gateway.request.estimate import estimate_prompt_tokens
from gateway.request.failures import Failure
from gateway.request.usage import UsageObserver

E = TypeVar("E")

MAX_ENDPOINT_ATTEMPTS = 3  # connections tried inside one provider for one request


class Next(IntEnum):
    """What to do after an attempt failed before any response byte reached the client."""

    STOP = 0
    OTHER_ENDPOINT = 1  # pick again, without the endpoints that failed
    FRESH_CONNECTION = 2  # pick again on a newly opened connection (a pooled one was stale)


class AttemptResult(msgspec.Struct, gc=False):
    """What one upstream attempt came to: the relay's answer once the attempt is over (or, for the
    attempt that is serving the client, once its response ends). Built in C, never in a cycle."""

    status: int = 0  # the provider's status; 0: no response head arrived
    started: bool = False  # the response began reaching the client: it served the request (no retry)
    held: bool = False  # a retryable status held back from the client (its body discarded)
    failure: Failure | None = None  # why it failed (before or after its head), None otherwise
    detail: str = ""  # the failure in plain words
    client_left: bool = False  # the client went away during the attempt
    retry_after: bytes | None = None  # the provider's Retry-After, when it sent one
    # What read the usage the provider reported (its ``total_tokens``, ``prompt_tokens``, ... are None
    # where it reported none); None when the attempt was not metered.
    usage: UsageObserver | None = None
    events: int | None = None  # data events relayed to the client (a metered event stream only)
    first_byte_s: float = 0.0  # request written -> response head
    duration_s: float = 0.0  # request written -> attempt over
    provider_wide: bool = False  # a 429/503 said the whole provider is limited (gateway/routing/cooling.py)
    # The provider ended a Responses or Messages stream with an `error` event (the access line's error code).
    stream_error: str | None = None
    refusal: str | None = None  # a held 400's error code a fallback chain moves on (docs/models.md)
    # Request written -> first token: a stream's first content event (gateway/request/first_token.py; its
    # end when it had none) when prefix affinity placed it; else, and for a non-stream, the response head.
    first_token_s: float = 0.0

    @property
    def total_tokens(self) -> int | None:
        usage = self.usage
        return None if usage is None else usage.total_tokens


# What each attempt of a request costs (docs/configuration.md, "What a request is charged"); the request
# is charged the sum over its attempts, so a request that failed over pays only for what its attempts
# cost. Pure functions of an attempt's outcome, so the rules are tested apart from any I/O.

def attempt_tokens(status: int, total_tokens: int | None, estimate: int, floor: int = 0) -> int:
    """The tokens one attempt that reached a provider costs.

    - The provider reported usage: that usage, whatever the status (a cut stream or a client that
      left after the usage arrived included).
    - Else a 4xx (429 included): the provider refused the work, it costs nothing.
    - Else it may have worked (a 5xx, a 2xx without usage, a stream cut by either side, no response
      head at all: ``status`` 0): the estimate, or ``floor`` when more (``served_floor``: the
      prompt plus what was relayed to the client, which the provider certainly generated).
    """
    if total_tokens is not None:
        return total_tokens
    if 400 <= status < 500:
        return 0
    return floor if floor > estimate else estimate


def served_floor(body_len: int, bytes_out: int, events: int | None) -> int:
    """The least a served attempt without usage cost: the prompt estimate plus what reached the client,
    which the provider certainly generated. An event stream counts one token per data event relayed (its
    framing is some 200 bytes a token: four bytes a token would charge about fifty times the tokens);
    any other body four bytes a token, like the prompt (its JSON makes that generous)."""
    relayed = events if events is not None else estimate_prompt_tokens(bytes_out)
    return estimate_prompt_tokens(body_len) + relayed


def served_tokens(result: AttemptResult, estimate: int, body_len: int, bytes_out: int) -> int:
    """What the attempt that served the request costs (``attempt_tokens``): its usage, else by its status,
    with what was relayed (``served_floor``) as the floor."""
    tokens = result.total_tokens
    if tokens is not None:
        return tokens
    return attempt_tokens(result.status, None, estimate, served_floor(body_len, bytes_out, result.events))


def usage_split(total: int, prompt: int | None, completion: int | None) -> tuple[int | None, int | None]:
    """The tenant's tokens in/out of a usage: both sides as reported, or, when it reported its total and
    only one side, the other side from the total (None, None: it reported neither)."""
    if (prompt is None) == (completion is None):
        return prompt, completion
    if prompt is None:
        return max(0, total - (completion or 0)), completion
    return prompt, max(0, total - prompt)


def never_taken(failure: Failure, reused: bool) -> bool:
    """An attempt written on a pooled connection the provider had already closed (a reset on reuse): the
    provider never took the request (it did not reach it)."""
    return reused and failure == Failure.RESET


def unanswered_tokens(failure: Failure, reused: bool, estimate: int) -> int:
    """The tokens an attempt costs whose request was written but got no response head. One the provider
    never took (``never_taken``) costs nothing (the failover sends it again for the same reason).
    Anything else (a timeout, a reset on a fresh connection, a malformed answer) may have worked: the
    estimate."""
    if never_taken(failure, reused):
        return 0
    return attempt_tokens(0, None, estimate)


class ProviderAttempts(Generic[E]):
    """Attempts inside one provider: which endpoints failed, whether to retry on a fresh connection,
    and the failure to report if every attempt fails."""

    __slots__ = ("provider", "left", "excluded", "fresh", "reached", "failure", "detail", "busy")

    def __init__(self, provider: str, max_attempts: int = MAX_ENDPOINT_ATTEMPTS) -> None:
        self.provider = provider
        self.left = max_attempts
        self.excluded: list[E] | None = None  # endpoints not to pick again (allocated on first failure)
        self.fresh = False  # the next attempt must open a new connection
        self.reached = False  # a request was written to some endpoint of this provider
        self.failure: Failure | None = None
        self.detail = ""
        self.busy = False  # an endpoint had no free connection

    def _exclude(self, endpoint: E) -> None:
        if self.excluded is None:
            self.excluded = [endpoint]
        else:
            self.excluded.append(endpoint)

    def _spend(self) -> Next:
        self.left -= 1
        return Next.OTHER_ENDPOINT if self.left > 0 else Next.STOP

    def connect_failed(self, endpoint: E, failure: Failure, detail: str) -> Next:
        self.failure, self.detail = failure, detail
        self.fresh = False
        self._exclude(endpoint)
        return self._spend()

    def pool_busy(self, endpoint: E) -> Next:
        self.busy = True
        self.fresh = False
        self._exclude(endpoint)
        return self._spend()

    def sent(self) -> None:
        self.reached = True

    def failed_before_head(self, endpoint: E, failure: Failure, detail: str, reused: bool) -> Next:
        """The request was written but no response head arrived."""
        self.failure, self.detail = failure, detail
        if failure == Failure.TIMEOUT:
            return Next.STOP  # the provider may still be working on it: do not send it twice here
        if reused and not self.fresh:
            # A pooled connection may have been closed by the provider: retry once on a fresh one.
            self.fresh = True
            self.left -= 1
            return Next.FRESH_CONNECTION if self.left > 0 else Next.STOP
        self.fresh = False
        self._exclude(endpoint)
        return self._spend()

    def error_reply(self) -> ErrorReply:
        """The client's answer when no attempt produced a response."""
        provider = self.provider
        if not self.reached and self.busy:
            return ErrorReply(503, "upstream_busy", f"{provider}: all connections busy", [(b"retry-after", b"1")])
        failure = self.failure
        if failure is None:
            return ErrorReply(502, "upstream_unavailable", f"{provider}: no endpoint available")
        message = f"{provider}: {self.detail}"
        if failure == Failure.TIMEOUT:  # a connect timeout is a connect failure: 502, like a refusal
            return ErrorReply(504, "upstream_timeout", message)
        if failure == Failure.MALFORMED:
            return ErrorReply(502, "bad_upstream_response", message)
        return ErrorReply(502, "upstream_unavailable", message)
