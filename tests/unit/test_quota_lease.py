"""The worker-held block's arithmetic (gateway/quota/lease.py)."""

from __future__ import annotations

from gateway.identity.auth import KeyIdentity
from gateway.identity.limits import Budget, Limits, RequestLimit
from gateway.quota.lease import (
    MAX_GROWTH,
    MIN_BLOCK_REQUESTS,
    Allowance,
    Lease,
    LeaseReservation,
    LeaseSpec,
    fit,
    ms_to_window_end,
    next_sizes,
    request_allowance,
)
from gateway.quota.ledger import scopes_of
from gateway.quota.rules import QuotaRule


def _lease(capacity: int = 100, closes_at: float = 10.0, room_beyond: int = 1000) -> Lease:
    reservation = LeaseReservation(b"z", b"p", b"id|100|60:1", capacity)
    return Lease(reservation, Allowance(capacity, 5000, room_beyond, 20.0), closes_at)


def test_a_block_admits_while_requests_fit_and_closes_on_the_first_that_does_not() -> None:
    lease = _lease()
    assert lease.take(60, now=1.0) and lease.take(40, now=1.0)
    assert (lease.tokens.committed, lease.in_flight, lease.tokens.remaining) == (100, 2, 1000)
    assert lease.tokens.limit_header == (b"x-ratelimit-limit-tokens", b"5000")
    assert not lease.take(101, now=1.0) and not lease.closed  # larger than any block: to Valkey, block stays
    assert not lease.take(1, now=1.0) and lease.closed
    assert not lease.end(60, 10)  # one request still in flight
    assert not lease.take(1, now=1.0)  # closed stays closed, though 50 tokens came back
    assert lease.end(40, 55)  # the last one ended: settle the block
    assert lease.tokens.committed == 65  # what its requests were charged: 10 + 55


def test_a_block_closes_at_its_deadline_and_close_says_when_it_is_idle() -> None:
    lease = _lease(closes_at=5.0)
    assert lease.take(10, now=4.9)
    assert not lease.take(10, now=5.0) and lease.closed
    assert lease.end(10, 0)  # released unused: nothing charged
    assert lease.tokens.committed == 0
    busy = _lease()
    assert busy.take(10, now=1.0)
    assert not busy.close()  # still in flight: settled when it ends
    assert busy.end(10, 12) and busy.tokens.committed == 12


def test_remaining_counts_the_room_beyond_the_block_plus_what_it_has_left() -> None:
    lease = _lease(capacity=100, room_beyond=50)
    lease.take(30, now=0.0)
    assert lease.tokens.remaining == 120
    lease.end(30, 200)  # an overage past the block
    assert lease.tokens.remaining == 0


def test_a_block_fits_the_headroom_shrinking_to_its_floor_unless_its_size_is_fixed() -> None:
    assert fit(100, 1000, 10, 4, fixed=False) == 100
    assert fit(100, 999, 10, 4, fixed=True) == 0  # a fixed size does not shrink: no block
    assert fit(100, 999, 10, 4, fixed=False) == 99
    assert fit(100, 39, 10, 4, fixed=False) == 0  # below the floor: every request decided in Valkey


def test_sizes_start_at_the_floor_double_when_full_and_follow_use_otherwise() -> None:
    spec = LeaseSpec(ttl_s=1.0, headroom=10)
    assert next_sizes(spec, None, 50) == (MIN_BLOCK_REQUESTS * 50, MIN_BLOCK_REQUESTS)
    block = _lease(capacity=400)
    block.slots = request_allowance(8, 100, 50, 20.0)
    for _ in range(8):
        assert block.take(10, now=1.0)
    assert not block.take(10, now=1.0) and block.slots.filled and not block.tokens.filled
    # Filled, when it opened is unknown: twice its requests, and tokens for as many of 10 tokens each.
    assert next_sizes(spec, block, 10) == (16 * 10, 16)
    assert next_sizes(LeaseSpec(1.0, 10, tokens=7, requests=9), block, 10) == (7, 9)


def test_a_block_that_filled_early_is_followed_by_one_sized_for_its_rate_and_both_kinds_fit_it() -> None:
    spec = LeaseSpec(ttl_s=1.0, headroom=10)
    block = Lease(LeaseReservation(b"z", b"p", b"m", 400, 8), Allowance(400, 5000, 1000, 20.0), 11.0,
                  slots=request_allowance(8, 100, 50, 20.0), opened_at=10.0)
    for _ in range(8):
        assert block.take(10, now=10.1)
    assert not block.take(10, now=10.1) and block.slots.filled
    # 8 requests in 0.1 s of a 1 s life: 80 a second, x1.5 = 120 requests; tokens for 120 of them.
    assert next_sizes(spec, block, 10, now=10.1) == (1200, 120)
    # Filled at once: at most MAX_GROWTH times.
    assert next_sizes(spec, block, 10, now=10.0)[1] == int(8 * MAX_GROWTH)
    # Filled near the end of its life: at least GROWTH_WHEN_FULL times.
    assert next_sizes(spec, block, 10, now=10.99)[1] == 16
    # Requests that were charged more than their estimate: the tokens follow what they used.
    for _ in range(8):
        block.end(10, 30)
    assert next_sizes(spec, block, 10, now=10.1) == (120 * 30, 120)
    # Charged less: each request of the next block still takes its estimate when admitted. A renewal
    # (estimate 0 here) sizes the tokens by the block's latest estimate.
    block.tokens.committed = 8 * 3
    assert next_sizes(spec, block, 0, now=10.1) == (120 * 10, 120)


def test_a_block_that_lived_out_its_life_is_followed_by_one_and_a_half_times_what_it_took() -> None:
    spec = LeaseSpec(ttl_s=1.0, headroom=10)
    block = Lease(LeaseReservation(b"z", b"p", b"m", 1000, 100), Allowance(1000, 5000, 1000, 20.0), 11.0,
                  slots=request_allowance(100, 1000, 500, 20.0), opened_at=10.0)
    for _ in range(40):
        assert block.take(10, now=10.5)
    assert not block.take(10, now=11.0) and block.closed and not block.slots.filled
    assert next_sizes(spec, block, 10, now=11.0) == (60 * 10, 60)


def test_a_slot_of_a_request_that_never_reached_a_provider_goes_back_with_the_block() -> None:
    block = Lease(LeaseReservation(b"z", b"p", b"m", 0, 8), None, 10.0, slots=request_allowance(8, 60, 40, 5.0))
    headers = dict(block.take(0, now=1.0))
    assert headers[b"x-ratelimit-limit-requests"] == b"60" and headers[b"x-ratelimit-remaining-requests"] == b"47"
    assert block.take(0, now=1.0)
    assert not block.end(0, 0, reached=False)
    assert block.close() is False and block.end(0, 0) is True
    assert (block.slots_unused, block.tokens_charged) == (7, 0)  # one used: seven slots go back


def test_a_block_ends_with_the_first_token_window_of_its_limits() -> None:
    from gateway.quota.ledger import QuotaLedger

    class Transport:
        def use_script(self, script: object) -> None:  # the ledger hands its script; nothing runs
            pass

        def template(self, args: object) -> object:
            return args

        def fill(self, template: object, values: object) -> object:
            return template

    ledger = QuotaLedger(Transport(), reservation_timeout_s=10)  # type: ignore[arg-type]
    rule = QuotaRule("r", (Budget(3600, 10), Budget(60, 10)), 16)
    key = KeyIdentity("t", "ci", None, Limits(budgets=(Budget(30, 5),)))
    assert ms_to_window_end(ledger.account("t", rule), 59_000) == 1_000  # type: ignore[arg-type]
    assert ms_to_window_end(ledger.account("t", rule), 3_600_000) == 60_000  # type: ignore[arg-type]
    assert ms_to_window_end(ledger.account("t", rule, key), 59_000) == 1_000  # type: ignore[arg-type]
    assert ms_to_window_end(ledger.account("t", rule, key), 15_000) == 15_000  # type: ignore[arg-type]
    only_requests = QuotaRule("q", (), 16, requests=(RequestLimit(60, 10, 10),))
    assert ms_to_window_end(ledger.account("t", only_requests), 59_000) is None  # type: ignore[arg-type]
    assert [s.kind for s in scopes_of(rule, key)] == ["key", "rule"]


def test_capped_or_shadowed_accounts_never_lease() -> None:
    from gateway.quota.ledger import QuotaLedger

    class Transport:
        def use_script(self, script: object) -> None:  # the ledger hands its script; nothing runs
            pass

        def template(self, args: object) -> object:
            return args

        def fill(self, template: object, values: object) -> object:
            return template

    ledger = QuotaLedger(Transport(), reservation_timeout_s=10)  # type: ignore[arg-type]
    assert ledger.account("t", QuotaRule("r", (Budget(60, 10),), 16)).leasable  # type: ignore[union-attr]
    assert not ledger.account("t", QuotaRule("c", (Budget(60, 10),), 16, max_in_flight=2)).leasable  # type: ignore[union-attr]
    shadow = QuotaRule("s", (Budget(60, 10, shadow=True),), 16)
    assert not ledger.account("t", shadow).leasable  # type: ignore[union-attr]
    assert ledger.account("t", None) is None  # nothing meters it
    capped_key = KeyIdentity("t", "ci", None, Limits(max_in_flight=1))
    assert not ledger.account("t", QuotaRule("r", (Budget(60, 10),), 16), capped_key).leasable  # type: ignore[union-attr]
    # A managed key leases too, its blocks its own (the kid in the lease key) even under its tenant's rule only.
    managed = ledger.account("t", QuotaRule("r", (Budget(60, 10),), 16), KeyIdentity("t", None, "kabcdefgh123"))
    assert managed is not None and managed.leasable and managed.managed and managed.lease_key == ("t", "r", "kabcdefgh123")
    assert ledger.account("t", QuotaRule("r", (Budget(60, 10),), 16)).lease_key == ("t", "r", "")  # type: ignore[union-attr]


def test_the_reset_header_is_whole_seconds_rounded_up_and_made_once_per_second() -> None:
    lease = _lease()  # its window resets at 20.0
    first = lease.tokens.reset_header(now=2.5)
    assert first == (b"x-ratelimit-reset-tokens", b"18s")
    assert lease.tokens.reset_header(now=2.9) is first
    assert lease.tokens.reset_header(now=3.2) == (b"x-ratelimit-reset-tokens", b"17s")
    assert lease.tokens.reset_header(now=25.0)[1] == b"0ms"  # past the window's end: nothing left to wait


def test_a_block_of_tokens_and_slots_takes_its_own_path_with_takes_answers() -> None:
    def block() -> Lease:
        return Lease(LeaseReservation(b"z", b"p", b"m", 100, 5), Allowance(100, 5000, 900, 20.0), 10.0,
                     slots=request_allowance(5, 60, 40, 20.0))

    fast, general = block(), block()
    assert fast.tokens_and_slots
    general.tokens_and_slots = False  # the general path of take, for the same block
    steps = [(30, 1.0), (101, 1.0), (30, 1.5), (10, 2.0), (10, 2.0), (40, 2.0), (1, 2.0)]
    answers = [(fast.take(estimate, now), general.take(estimate, now)) for estimate, now in steps]
    assert [a for a, _ in answers] == [b for _, b in answers]
    assert answers[0][0] == ((b"x-ratelimit-limit-tokens", b"5000"), (b"x-ratelimit-remaining-tokens", b"970"),
                             (b"x-ratelimit-reset-tokens", b"19s"), (b"x-ratelimit-limit-requests", b"60"),
                             (b"x-ratelimit-remaining-requests", b"44"), (b"x-ratelimit-reset-requests", b"19s"))
    assert answers[1][0] is None and answers[-1][0] is None  # larger than the block; then it closed, full
    for lease in (fast, general):
        assert (lease.closed, lease.tokens.filled, lease.slots.committed, lease.tokens.committed) == (True, True, 4, 80)
        assert (lease.in_flight, lease.taken, lease.last_estimate) == (4, 4, 10)
    slots_full = block()
    for _ in range(5):
        assert slots_full.take_tokens_and_slot(1, 1.0)
    assert slots_full.take_tokens_and_slot(1, 1.0) is None and slots_full.slots.filled and slots_full.closed
    assert block().take_tokens_and_slot(1, 10.0) is None  # past its ttl: closed
