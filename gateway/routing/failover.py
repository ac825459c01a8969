"""Sans-IO provider failover for one request (docs/routing.md, "Failover"): the attempt budget, the
one deadline, backoff with full jitter, which statuses move a request on, and Retry-After.

The proxy asks ``may_try_another`` after a provider failed before any response byte reached the
client, sleeps ``backoff()``, and asks the router for the next provider excluding ``tried``.
"""

from __future__ import annotations

import random
from email.utils import parsedate_to_datetime

from gateway.config import Cooling, Retry
from gateway.http.errors import ErrorReply

# Statuses that move a request to the next provider (other 4xx and 500/501 pass through unchanged).
RETRYABLE_STATUSES = frozenset((429, 502, 503, 504))
# Statuses that cool the provider that sent them.
COOLING_STATUSES = frozenset((429, 503))
_MAX_RETRY_AFTER_DIGITS = 10


def parse_retry_after(value: bytes | None, wall_now: float) -> float | None:
    """Seconds from a Retry-After value: delta-seconds or an HTTP date (RFC 9110 §10.2.3); None if invalid."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit() and len(text) <= _MAX_RETRY_AFTER_DIGITS:
        return float(int(text))
    try:
        when = parsedate_to_datetime(text.decode("latin-1"))
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - wall_now)


def cooling_seconds(retry_after: float | None, cooling: Cooling) -> float:
    """How long a provider that answered 429/503 is skipped: its Retry-After (capped), else the default."""
    return min(retry_after if retry_after is not None else float(cooling.default), float(cooling.max))


class Failover:
    """Provider attempts of one request: which providers of the current model were tried, what the last
    one answered. A fallback chain (docs/models.md) keeps one ``Failover`` for all its models: one
    deadline and one attempt budget; ``next_model`` starts a new model's list of providers tried."""

    __slots__ = ("_policy", "deadline", "tried", "last_reply", "_rng", "_spent", "replies")

    def __init__(self, policy: Retry, deadline: float, rng: random.Random) -> None:
        self._policy = policy
        self.deadline = deadline  # monotonic seconds: until the first response byte, all attempts together
        self.tried: list[int] = []  # provider indexes of the current model, in order
        self.last_reply: ErrorReply | None = None  # the client's answer if no provider succeeds
        self._rng = rng
        self._spent = 0  # attempts spent on earlier models of a fallback chain
        self.replies: list[ErrorReply] = []  # what each provider of the current model failed with

    @property
    def attempts(self) -> int:
        return self._spent + len(self.tried)

    def failed(self, provider: int, reply: ErrorReply) -> None:
        self.tried.append(provider)
        self.replies.append(reply)
        self.last_reply = reply

    def may_try_another(self, now: float) -> bool:
        return self.attempts < self._policy.attempts and now < self.deadline

    def next_model(self) -> None:
        """The request moves to the next model of its chain: its providers are all untried."""
        self._spent += len(self.tried)
        self.tried = []
        self.replies = []

    def backoff(self) -> float:
        """Exponential backoff with full jitter before the next provider (AWS architecture blog)."""
        backoff = self._policy.backoff
        ceiling = min(float(backoff.max), float(backoff.base) * (2 ** (max(self.attempts, 1) - 1)))
        return self._rng.uniform(0.0, ceiling)
