"""Prefix affinity's placements shared by a host's workers (gateway/routing/prefix_shared.py over
shm/prefixes.py): two workers' tables over one shared segment count a prefix's requests in flight and
its feedback together."""

from __future__ import annotations

from gateway.routing.prefix_shared import SharedPrefixTable
from shm.prefixes import PrefixCells
from shm.segment import Segment


class Ranked:
    def __init__(self, provider: int) -> None:
        self.provider = provider


RING = [Ranked(2), Ranked(0), Ranked(1)]
KEY = b"k" * 8


def host(workers: int = 2, slots: int = 16, spill: int = 2, misses: int = 2, slow: float | None = None):
    segment = Segment.create(4, 8, extra_regions={"prefixes": PrefixCells.required_bytes(4, slots)})
    PrefixCells(segment.region("prefixes"), 4, slots)
    for worker in range(workers):
        segment.claim_worker_row(worker)
    return segment, [SharedPrefixTable(PrefixCells.attach(segment.region("prefixes")), worker,
                                       segment.rows_in_use, spill, misses, slow) for worker in range(workers)]


def place(table: SharedPrefixTable, key: bytes = KEY):
    entry = table.entry(key)
    provider = RING[table.place(entry, RING)].provider
    return provider, table.placed


def test_the_spill_share_counts_the_requests_in_flight_of_every_worker():
    _, (one, two) = host(spill=2)
    assert place(one)[0] == 2 and place(two)[0] == 2  # one each: the host's two on the prefix's place
    third, placement = place(one)
    assert third == 0  # the host's share is full: the next of the ring, though worker one has only one there
    assert place(two)[0] == 0
    one.ended(placement, 0, None, None)  # a spilled request ends: room on provider 0 again
    assert place(two)[0] == 0


def test_a_move_learnt_on_one_worker_is_followed_by_the_other():
    _, (one, two) = host(spill=8, misses=2)
    for table in (one, two):  # one miss on each worker: the host's run of two
        provider, placement = place(table)
        assert provider == 2
        table.ended(placement, provider, 0, 0.01)
    assert one.moved + two.moved == 1
    assert place(one)[0] == 0 and place(two)[0] == 0 and two.entry(KEY).offset == 1


def test_a_hit_on_any_worker_ends_every_run():
    _, (one, two) = host(spill=8, misses=2)
    provider, placement = place(one)
    one.ended(placement, provider, 0, None)  # miss on one
    provider, placement = place(two)
    two.ended(placement, provider, 50, None)  # hit on two: the run is over
    provider, placement = place(one)
    one.ended(placement, provider, 0, None)  # a miss again: a run of one
    assert place(two)[0] == 2 and one.moved + two.moved == 0


def test_a_slow_first_token_on_one_worker_moves_the_prefix_for_both():
    _, (one, two) = host(spill=8, slow=0.5)
    provider, placement = place(two)
    two.ended(placement, provider, None, 0.9)
    assert place(one)[0] == 0


def test_another_prefix_in_the_same_slot_takes_the_cell_over_and_counts_stay_right():
    _, (one, _two) = host(workers=2, slots=16, spill=1)
    other = next(key for key in (bytes([n]) * 8 for n in range(1, 255))
                 if key != KEY and one.cells.slot_of(key) == one.cells.slot_of(KEY))
    _, held = place(one)  # KEY in flight on 2
    assert place(one, other)[0] == 2  # the cell is the other's now: KEY's count went with it
    one.ended(held, 2, None, None)  # KEY's request ends: nothing of the other prefix's count is taken
    assert place(one, other)[0] == 0  # the other prefix's own request is still in flight on 2


def test_a_dead_workers_requests_in_flight_are_reset_its_moves_kept():
    segment, (one, two) = host(spill=1, misses=1)
    provider, placement = place(two)
    two.ended(placement, provider, 0, None)  # a miss moves it
    place(two)  # in flight on its new place (0)
    assert place(one)[0] == 1  # full there: spilled
    PrefixCells.attach(segment.region("prefixes")).reset_inflight(1)
    assert one.entry(KEY).offset == 1 and one.entry(KEY).inflight == {1: 1}
