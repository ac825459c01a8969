"""Worker-held token leases (``quota.lease``, opt-in): one block of a budget, admitted against locally. Pure.

Without leases every metered request reserves its estimate in Valkey: exact, and one round trip plus
a suspended coroutine per request. With leases a worker reserves a block of ``tokens`` for one
(rule, tenant) with the same ledger call a request uses (to Valkey the block is one reservation), then
admits requests of that pair against the block in memory, with no await. When the block is closed
(its ``ttl`` passed, the next request does not fit, or a window of the rule ends) and its last request
has ended, the worker settles the block's reservation with the tokens its requests were charged: the
unused part goes back to the budget. The same design as Envoy's rate-limit quota service: the data
plane spends an assignment locally and reports what it used. The gate asks for a used block's successor
shortly before its ``ttl`` ends (``LeaseBook``), so steady traffic never waits between blocks.

What that trades: tokens another worker holds in an open block are reserved in Valkey, so a budget
near its limit could refuse a request while a block somewhere still has room. Blocks are therefore
taken only while the budget's room is at least ``headroom`` blocks, and closed after ``ttl``: near the
limit every request reserves in Valkey again, exactly as without leases. Rules with ``max_in_flight``
never lease (a concurrency cap must count every request in Valkey).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.quota.admission import H_LIMIT, H_REMAINING, H_RESET, duration_text
from gateway.quota.ledger import Reservation
from gateway.quota.rules import QuotaRule


@dataclass(frozen=True, slots=True)
class LeaseSpec:
    """``quota.lease``: the block size, how long a block admits, and the room a budget must have."""

    tokens: int
    ttl_s: float
    headroom: int

    def wanted(self, room: int) -> bool:
        """Whether a budget with ``room`` tokens left (after the request just decided) may lease a block."""
        return room >= self.headroom * self.tokens


class LeaseReservation(Reservation, frozen=True, gc=False):
    """The ledger reservation behind a block: settled once, with what the block's requests were charged.
    Its own class so reconciliation counts blocks apart from requests (their tokens are counted per
    request, when each one settles)."""


def leasable(rule: QuotaRule) -> bool:
    """A concurrency cap needs every request counted in Valkey: such rules never lease."""
    return rule.max_in_flight == 0


def ms_to_window_end(rule: QuotaRule, server_now_ms: int) -> int:
    """Milliseconds until the first of the rule's windows ends (windows are aligned to the epoch, and
    ``server_now_ms`` is the ledger's clock): a block must not admit into the next window, since its
    reservation was made in this one."""
    return min(b.window_s * 1000 - server_now_ms % (b.window_s * 1000) for b in rule.budgets)


class Allowance:
    """One kind of budget a block holds: its ``capacity``, what the block's requests ``committed`` of it
    (the estimates of those in flight + what the ended ones were charged), and its rate-limit headers as
    this worker knows them. A block holds tokens today; request slots (``x-ratelimit-*-requests``) and
    nano-USD are further allowances of the same shape, and a request is admitted when every one fits."""

    __slots__ = ("capacity", "committed", "room", "resets_at", "limit_header", "remaining_name", "_reset_name",
                 "_reset_until", "_reset_header")

    def __init__(self, capacity: int, limit: int, room_beyond: int, resets_at: float,
                 names: tuple[bytes, bytes, bytes] = (H_LIMIT, H_REMAINING, H_RESET)) -> None:
        self.capacity = capacity
        self.committed = 0
        self.room = room_beyond + capacity  # the room this worker knows of, before anything is committed
        self.resets_at = resets_at  # monotonic seconds at which the tightest budget's window ends
        limit_name, self.remaining_name, self._reset_name = names
        self.limit_header = (limit_name, b"%d" % limit)  # the tightest budget's limit, from the grant
        # The reset header, and until when (monotonic) it says the right whole second: the block's requests
        # share one rather than compute a duration each.
        self._reset_until = -math.inf
        self._reset_header = (self._reset_name, b"")

    @property
    def remaining(self) -> int:
        """The room outside the block at the grant plus what the block has not committed."""
        return max(0, self.room - self.committed)

    def reset_header(self, now: float) -> tuple[bytes, bytes]:
        """The reset header in whole seconds (rounded up), made once per second."""
        if now > self._reset_until:
            seconds = int(self.resets_at - now + 0.999)
            self._reset_header = (self._reset_name, duration_text(max(0, seconds) * 1000))
            # It says `seconds` while resets_at - now + 0.999 >= seconds; past the reset it stays 0 ms.
            self._reset_until = self.resets_at + 0.999 - seconds if seconds > 0 else math.inf
        return self._reset_header


class Lease:
    """One block: admits while open and the request fits every allowance; once closed it only waits for
    its requests to end, then it is settled (``end``/``close`` say when)."""

    __slots__ = ("reservation", "tokens", "in_flight", "closes_at", "closed", "tenant_slot")

    def __init__(self, reservation: Reservation, tokens: Allowance, closes_at: float, tenant_slot: int = -1) -> None:
        self.reservation = reservation
        self.tokens = tokens
        self.in_flight = 0
        self.closes_at = closes_at  # monotonic seconds
        self.closed = False
        self.tenant_slot = tenant_slot  # the tenant's TenantTokens slot: one tenant per block

    def take(self, estimate: int, now: float) -> tuple[tuple[bytes, bytes], ...] | None:
        """Admit a request of ``estimate`` tokens if the block is open and has room: its rate-limit
        headers (limit, remaining, reset), else None. A block that has no room left for it is closed
        (requests go to Valkey until the next block); a request larger than any block goes to Valkey and
        leaves the block open."""
        tokens = self.tokens
        if self.closed or estimate > tokens.capacity:
            return None
        committed = tokens.committed + estimate
        if now >= self.closes_at or committed > tokens.capacity:
            self.closed = True
            return None
        tokens.committed = committed
        self.in_flight += 1
        # ``remaining`` without its max(): committed <= capacity here, so it cannot be negative.
        return (tokens.limit_header, (tokens.remaining_name, b"%d" % (tokens.room - committed)),
                tokens.reset_header(now))

    def end(self, estimate: int, charged: int) -> bool:
        """A request of this block ended and was charged ``charged`` tokens (its estimate, the
        provider's usage, or 0 when nothing reached a provider). True when the block is now closed
        and idle: settle it."""
        self.tokens.committed += charged - estimate
        self.in_flight -= 1
        return self.closed and self.in_flight == 0

    def close(self) -> bool:
        """Stop admitting. True when nothing is in flight: settle it now."""
        self.closed = True
        return self.in_flight == 0
