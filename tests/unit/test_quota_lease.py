"""The worker-held block's arithmetic (gateway/quota/lease.py)."""

from __future__ import annotations

from gateway.quota.lease import Allowance, Lease, LeaseReservation, LeaseSpec, leasable, ms_to_window_end
from gateway.quota.rules import Budget, QuotaRule


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


def test_spec_wants_headroom_and_capped_rules_never_lease() -> None:
    spec = LeaseSpec(tokens=100, ttl_s=1.0, headroom=10)
    assert spec.wanted(1000) and not spec.wanted(999)
    rule = QuotaRule("r", (Budget(60, 10),), 16)
    assert leasable(rule) and not leasable(QuotaRule("c", (Budget(60, 10),), 16, max_in_flight=2))


def test_a_block_ends_with_the_first_window_of_its_rule() -> None:
    rule = QuotaRule("r", (Budget(3600, 10), Budget(60, 10)), 16)
    assert ms_to_window_end(rule, 59_000) == 1_000
    assert ms_to_window_end(rule, 3_600_000) == 60_000


def test_the_reset_header_is_whole_seconds_rounded_up_and_made_once_per_second() -> None:
    lease = _lease()  # its window resets at 20.0
    first = lease.tokens.reset_header(now=2.5)
    assert first == (b"x-ratelimit-reset-tokens", b"18s")
    assert lease.tokens.reset_header(now=2.9) is first
    assert lease.tokens.reset_header(now=3.2) == (b"x-ratelimit-reset-tokens", b"17s")
    assert lease.tokens.reset_header(now=25.0)[1] == b"0ms"  # past the window's end: nothing left to wait
