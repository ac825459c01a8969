"""Worker-held blocks (``quota.lease``, on by default): a share of every limit, admitted against locally. Pure.

Without blocks every metered request is decided in Valkey: exact, and one round trip plus a suspended
coroutine per request. With blocks a worker takes, for one (tenant, rule, key), ``slots`` request slots
of every request limit and ``tokens`` of every token budget at once, with the same ledger call a
request uses (to Valkey a block is one reservation that took ``slots`` slots), then admits requests of
that (tenant, rule, key) against the block in memory, with no await. When the block is closed (its
``ttl`` passed, the next request does not fit, or a token window ended) and its last request has ended,
the worker settles the block's reservation with the tokens its requests were charged and gives back
the slots they did not use (nor used for work that never reached a provider). The same design as
Envoy's rate-limit quota service: the data plane spends an assignment locally and reports what it used.

Sizes follow use, counted in requests: the first block of a (tenant, rule, key) holds ``MIN_BLOCK_REQUESTS``
requests; a block that lived out its ``ttl`` is followed by one of one and a half times the requests it
took; one that filled up early by one sized for its rate over a whole ``ttl`` (at least twice, at most
``MAX_GROWTH`` times its size), so a busy key reaches its block size in two or three blocks rather than
doubling its way up, each fill sending a burst of requests to Valkey. A block holds as many tokens as
its requests need (each request's estimate, or what the last block's requests committed on average if
that is more) and as many request slots: the two kinds never fill one another's block early
(``next_sizes``). A fixed ``quota.lease.tokens`` / ``requests`` overrides that.

What that trades: what a block holds is taken in Valkey, so near a limit another worker's request could
be refused while a block somewhere still has room. Blocks are therefore taken only while the tightest
limit of each kind has room for ``headroom`` blocks (a block shrinks to fit, down to its floor, else
none is taken), and closed after ``ttl``: near the limit every request is decided in Valkey, exactly as
without blocks. No limit is ever exceeded: a block is a reservation like any other. With USD budgets a
block also holds ``nusd`` nano-USD, reserved in every hard spend window like a request's worst case: a
request fits when its own worst case fits what is left, ends charging its real cost into the block, and
the block settles the sum (docs/limits.md, "USD budgets"). Scopes with
``max_in_flight`` or a shadow limit never lease (a concurrency cap must count every request in Valkey,
and a shadow limit must see every request to say which it would have refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.quota.ledger import Account, Reservation
from gateway.quota.rate_headers import REQUEST_HEADERS, TOKEN_HEADERS, duration_text

MIN_BLOCK_REQUESTS = 4  # the floor of a block: fewer is not worth a round trip
GROWTH_WHEN_FULL = 2.0  # a block that filled up: at least this many times its requests
GROWTH_WHEN_USED = 1.5  # one that lived out its ttl: this many times the requests it took
MAX_GROWTH = 16.0  # at most this many times, however early a block filled


@dataclass(frozen=True, slots=True)
class LeaseSpec:
    """``quota.lease``: how long a block admits, the room a limit must have, fixed sizes (None: by use)."""

    ttl_s: float
    headroom: int
    tokens: int | None = None
    requests: int | None = None


class SpendAllowance:
    """The nano-USD a block holds for its USD budgets: ``committed`` = the worst cases of its requests
    in flight + the real costs of those that ended (what the block is settled with)."""

    __slots__ = ("capacity", "committed", "filled", "room")

    def __init__(self, capacity: int, room_beyond: int) -> None:
        self.capacity = capacity
        self.committed = 0
        self.filled = False
        self.room = room_beyond + capacity  # the tightest hard budget's room at the grant (-1 beyond: none)

    @property
    def remaining(self) -> int:
        return max(0, self.room - self.committed)


class LeaseReservation(Reservation, frozen=True, gc=False):
    """The ledger reservation behind a block: settled once, with what the block's requests were charged.
    Its own class so reconciliation counts blocks apart from requests (their tokens are counted per
    request, when each one settles)."""


def ms_to_window_end(account: Account, server_now_ms: int) -> int | None:
    """Milliseconds until the first of the account's token windows ends (windows are aligned to the
    epoch, and ``server_now_ms`` is the ledger's clock): a block must not admit into the next window,
    since its reservation was made in this one. None: no token window (request limits have no ends)."""
    windows = [b.window_s * 1000 for scope in account.scopes for b in scope.limits.budgets]
    if not windows:
        return None
    return min(w - server_now_ms % w for w in windows)


def fit(size: int, room: int, headroom: int, floor: int, fixed: bool) -> int:
    """A block size the room allows (``room >= headroom * size``), shrunk if need be (not a fixed one)
    down to ``floor``; 0: no block."""
    if room >= headroom * size:
        return size
    if fixed:
        return 0
    size = room // headroom
    return size if size >= floor else 0


class Allowance:
    """One kind of limit a block holds: its ``capacity``, what the block's requests ``committed`` of it
    (tokens: the estimates of those in flight + what the ended ones were charged; slots: one per request
    that may have reached a provider), and its rate-limit headers as this worker knows them."""

    __slots__ = ("capacity", "committed", "filled", "room", "resets_at", "limit_header", "remaining_name",
                 "_reset_name", "_reset_until", "_reset_header")

    def __init__(self, capacity: int, limit: int, room_beyond: int, resets_at: float,
                 names: tuple[bytes, bytes, bytes] = TOKEN_HEADERS) -> None:
        self.capacity = capacity
        self.committed = 0
        self.filled = False  # a request did not fit: the next block may be larger
        self.room = room_beyond + capacity  # the room this worker knows of, before anything is committed
        self.resets_at = resets_at  # monotonic seconds at which the tightest limit resets
        limit_name, self.remaining_name, self._reset_name = names
        self.limit_header = (limit_name, b"%d" % limit)  # the tightest limit, from the grant
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


def request_allowance(slots: int, limit: int, room_beyond: int, resets_at: float) -> Allowance:
    return Allowance(slots, limit, room_beyond, resets_at, REQUEST_HEADERS)


class Lease:
    """One block: admits while open and the request fits every allowance it holds; once closed it only
    waits for its requests to end, then it is settled (``end``/``close`` say when)."""

    __slots__ = ("reservation", "tokens", "slots", "spend", "in_flight", "taken", "closes_at", "closed",
                 "tenant_slot", "opened_at", "last_estimate", "last_worst", "tokens_and_slots")

    def __init__(self, reservation: Reservation, tokens: Allowance | None, closes_at: float, tenant_slot: int = -1,
                 slots: Allowance | None = None, spend: SpendAllowance | None = None,
                 opened_at: float | None = None) -> None:
        self.reservation = reservation
        self.tokens = tokens  # None: no token budget applies
        self.slots = slots  # None: no request limit applies
        self.spend = spend  # None: no USD budget applies
        self.in_flight = 0
        self.taken = 0  # requests admitted from it
        self.closes_at = closes_at  # monotonic seconds
        self.closed = False
        self.tenant_slot = tenant_slot  # the tenant's TenantTokens slot: one tenant per block
        self.opened_at = opened_at  # monotonic seconds of the grant (None: unknown), for the next size
        self.last_estimate = 0  # the estimate of the latest request it admitted, for the next size
        self.last_worst = 0  # and its worst-case cost (nano-USD), when USD budgets apply
        # Token budgets and request limits, no USD budget (the production config's every block): admitted by
        # ``take_tokens_and_slot``, which tests no allowance for None.
        self.tokens_and_slots = tokens is not None and slots is not None and spend is None

    def take(self, estimate: int, now: float, worst: int = 0) -> tuple[tuple[bytes, bytes], ...] | None:
        """Admit a request of ``estimate`` tokens (and ``worst`` nano-USD at most) if the block is open and
        has room: its rate-limit headers (limit, remaining, reset of each kind), else None. A block that
        has no room left for it is closed (requests go to Valkey until the next block); a request larger
        than the block's tokens or nano-USD goes to Valkey and leaves the block open."""
        if self.closed:
            return None
        if self.tokens_and_slots:
            return self.take_tokens_and_slot(estimate, now)
        tokens, slots, spend = self.tokens, self.slots, self.spend
        if tokens is not None and estimate > tokens.capacity:
            return None
        if spend is not None and worst > spend.capacity:
            return None
        if now >= self.closes_at:
            self.closed = True
            return None
        if slots is not None and slots.committed >= slots.capacity:
            slots.filled = self.closed = True
            return None
        if spend is not None:
            if spend.committed + worst > spend.capacity:
                spend.filled = self.closed = True
                return None
            if tokens is not None and tokens.committed + estimate > tokens.capacity:
                tokens.filled = self.closed = True
                return None
            spend.committed += worst
            self.last_worst = worst
        if tokens is not None:
            committed = tokens.committed + estimate
            if committed > tokens.capacity:
                tokens.filled = self.closed = True
                return None
            tokens.committed = committed
            self.last_estimate = estimate
            # ``remaining`` without its max(): committed <= capacity here, so it cannot be negative.
            # The reset header as ``reset_header`` gives it, without the call while it still holds.
            headers = (tokens.limit_header, (tokens.remaining_name, b"%d" % (tokens.room - committed)),
                       tokens._reset_header if now <= tokens._reset_until else tokens.reset_header(now))
        else:
            headers = ()
        if slots is not None:
            slots.committed += 1
            headers += (slots.limit_header, (slots.remaining_name, b"%d" % (slots.room - slots.committed)),
                        slots._reset_header if now <= slots._reset_until else slots.reset_header(now))
        self.in_flight += 1
        self.taken += 1
        return headers

    def take_tokens_and_slot(self, estimate: int, now: float) -> tuple[tuple[bytes, bytes], ...] | None:
        """``take`` of a block that holds tokens and request slots and no nano-USD (``tokens_and_slots``;
        the quota gate calls it directly): the same checks in the same order, the same headers."""
        if self.closed:
            return None
        tokens: Allowance = self.tokens  # type: ignore[assignment]  # both held (``tokens_and_slots``)
        slots: Allowance = self.slots  # type: ignore[assignment]
        if estimate > tokens.capacity:
            return None
        if now >= self.closes_at:
            self.closed = True
            return None
        used = slots.committed
        if used >= slots.capacity:
            slots.filled = self.closed = True
            return None
        committed = tokens.committed + estimate
        if committed > tokens.capacity:
            tokens.filled = self.closed = True
            return None
        tokens.committed = committed
        self.last_estimate = estimate
        slots.committed = used = used + 1
        self.in_flight += 1
        self.taken += 1
        # ``remaining`` without its max() (committed <= capacity here), the reset header without its call
        # while it still holds (``Allowance.reset_header``).
        return (tokens.limit_header, (tokens.remaining_name, b"%d" % (tokens.room - committed)),
                tokens._reset_header if now <= tokens._reset_until else tokens.reset_header(now),
                slots.limit_header, (slots.remaining_name, b"%d" % (slots.room - used)),
                slots._reset_header if now <= slots._reset_until else slots.reset_header(now))

    def take_hit(self, now: float) -> bool:
        """``take`` and ``end`` of a request of 0 tokens and 0 nano-USD that reached its answer (a response
        cache hit), in one step: its one request slot, when ``take(0, now, 0)`` would admit it (open, before
        its deadline, a slot free, neither tokens nor nano-USD committed past the block's capacity by an
        overage). False changes nothing: ``take`` then decides (and closes the block as it would)."""
        if self.closed or now >= self.closes_at:
            return False
        tokens, slots, spend = self.tokens, self.slots, self.spend
        if ((slots is not None and slots.committed >= slots.capacity)
                or (tokens is not None and tokens.committed > tokens.capacity)
                or (spend is not None and spend.committed > spend.capacity)):
            return False
        if tokens is not None:
            self.last_estimate = 0  # as `take` keeps it, for the next block's size
        if spend is not None:
            self.last_worst = 0
        if slots is not None:
            slots.committed += 1
        self.taken += 1
        return True

    def end(self, estimate: int, charged: int, reached: bool = True, worst: int = 0, cost: int | None = None) -> bool:
        """A request of this block ended and was charged ``charged`` tokens (its estimate, the
        provider's usage, or 0) and ``cost`` nano-USD (None: its ``worst`` case); ``reached`` False: it
        never reached a provider, its slot goes back with the block. True when the block is now closed
        and idle: settle it. ``QuotaGate.settle`` writes it out for a request that reached its provider
        in a block without USD budgets: change both together."""
        if self.tokens is not None:
            self.tokens.committed += charged - estimate
        if self.spend is not None and cost is not None:
            self.spend.committed += (cost if cost > 0 else 0) - worst
        if not reached and self.slots is not None:
            self.slots.committed -= 1
        self.in_flight -= 1
        return self.closed and self.in_flight == 0

    def close(self) -> bool:
        """Stop admitting. True when nothing is in flight: settle it now."""
        self.closed = True
        return self.in_flight == 0

    @property
    def tokens_charged(self) -> int:
        return 0 if self.tokens is None else self.tokens.committed

    @property
    def spend_charged(self) -> int | None:
        return None if self.spend is None else self.spend.committed

    @property
    def slots_unused(self) -> int:
        return 0 if self.slots is None else self.slots.capacity - self.slots.committed


def _filled(lease: Lease) -> bool:
    return ((lease.slots is not None and lease.slots.filled) or (lease.tokens is not None and lease.tokens.filled)
            or (lease.spend is not None and lease.spend.filled))


def growth(lease: Lease, now: float | None) -> float:
    """How many times the requests ``lease`` took its successor should hold: one and a half times for a
    block that lived out its life; for one that filled up, its rate over a whole life (one and a half
    times that), between ``GROWTH_WHEN_FULL`` and ``MAX_GROWTH``."""
    if not _filled(lease):
        return GROWTH_WHEN_USED
    opened_at = lease.opened_at
    if opened_at is None or now is None:
        return GROWTH_WHEN_FULL
    life, elapsed = lease.closes_at - opened_at, now - opened_at
    if elapsed <= 0:
        return MAX_GROWTH
    return min(MAX_GROWTH, max(GROWTH_WHEN_FULL, GROWTH_WHEN_USED * life / elapsed))


def next_sizes(spec: LeaseSpec, previous: Lease | None, estimate: int, now: float | None = None) -> tuple[int, int]:
    """(tokens, slots) of the next block of a (tenant, rule, key): the fixed sizes when configured, else
    ``MIN_BLOCK_REQUESTS`` requests for a first block, and the previous block's requests times its
    ``growth``; tokens for that many requests of ``estimate`` tokens (or of the previous block's latest
    estimate, or of what its requests committed on average, when more: a request takes its estimate
    when admitted, and gives back what it was not charged only when it ends)."""
    requests = next_requests(previous, now)
    per_request = max(1, estimate)
    if previous is not None and previous.tokens is not None and previous.taken:
        per_request = max(per_request, previous.last_estimate, -(-previous.tokens.committed // previous.taken))
    return spec.tokens or requests * per_request, spec.requests or requests


def next_requests(previous: Lease | None, now: float | None) -> int:
    """How many requests the next block of a (tenant, rule, key) is sized for: ``MIN_BLOCK_REQUESTS`` at
    first, then the previous block's requests times its ``growth``."""
    if previous is None:
        return MIN_BLOCK_REQUESTS
    # round() first: 8 x 15.000000000000002 is 120 requests, not 121.
    return max(MIN_BLOCK_REQUESTS, math.ceil(round(previous.taken * growth(previous, now), 6)))


def next_spend(previous: Lease | None, worst: int, now: float | None = None) -> int:
    """The nano-USD of the next block: its requests (``next_requests``) times the larger of ``worst``,
    the previous block's latest worst case and what its requests committed on average."""
    per_request = max(1, worst)
    if previous is not None and previous.spend is not None and previous.taken:
        per_request = max(per_request, previous.last_worst, -(-previous.spend.committed // previous.taken))
    return next_requests(previous, now) * per_request
