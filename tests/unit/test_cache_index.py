"""The response cache's host index (shm/cache_index.py) and its announcements (gateway/cache/announce.py):
what a worker reads for a key the writer noted, expired, dropped for lack of room, and the host in-flight
cells of several workers."""

from __future__ import annotations

import os

import pytest

from gateway.cache.announce import announcement, key_digest, parse_announcement
from shm.cache_index import (
    HOSTED,
    KNOWN,
    LEADER_SLOTS,
    TAKEN,
    CacheIndex,
    CacheIndexWriter,
    IndexLayout,
    KeyPlace,
    place_of,
)

NAME = b"gridgate:cache:" + b"%032x" % 0x1234_5678_9ABC_DEF0_0FED_CBA9_8765_4321


def fresh(capacity: int = 1024, workers: int = 4) -> tuple[CacheIndex, CacheIndexWriter]:
    index = CacheIndex.create(capacity, workers)
    return index, CacheIndexWriter(index)


def test_an_announcement_round_trips_the_keys_digests() -> None:
    other = b"gridgate:cache:" + b"f" * 32
    payload = announcement(3_600_500, [key_digest(NAME), key_digest(other)])
    assert payload.startswith(b"3600500:")
    assert parse_announcement(payload) == (3_600_500, [key_digest(NAME), key_digest(other)])
    for garbage in (b"", b"12", b"12:abc", b"x:" + b"0" * 32):
        with pytest.raises(ValueError):
            parse_announcement(garbage)


def test_a_noted_key_is_known_until_it_expires_and_others_are_not() -> None:
    index, writer = fresh()
    place = index.place(key_digest(NAME))
    assert not index.knows(place, 100.0)
    writer.note(place, 200.0, 100.0)
    assert index.knows(place, 150.0) and not index.knows(place, 200.0)
    writer.note(place, 150.0, 100.0)  # an earlier expiry never shortens what is known
    assert index.knows(place, 199.0)
    neighbour = KeyPlace(b"\x01" * 8, place.bucket, place.slot)  # same bucket, another key
    assert not index.knows(neighbour, 150.0)


def test_expired_slots_are_reused_and_a_full_bucket_makes_its_keys_known() -> None:
    index, writer = fresh()
    bucket = 7
    places = [KeyPlace(os.urandom(7) + b"\x01", bucket, 0) for _ in range(9)]
    for place in places[:8]:
        writer.note(place, 50.0, 10.0)
    writer.note(places[8], 300.0, 10.0)  # no room: the bucket's overflow word keeps it
    assert writer.dropped == 1 and CacheIndexWriter.dropped_of(index) == 1
    stranger = KeyPlace(b"\x02" * 8, bucket, 0)
    assert index.knows(places[8], 100.0) and index.knows(stranger, 100.0)  # the safe side: known
    assert not index.knows(KeyPlace(b"\x02" * 8, bucket + 1, 0), 100.0)  # other buckets are exact
    writer.note(places[8], 400.0, 60.0)  # the eight expired: one slot is reused
    assert writer.dropped == 1
    assert index.knows(places[8], 350.0) and not index.knows(stranger, 350.0)


def test_a_fingerprint_across_two_slots_counts_as_known() -> None:
    """Ambiguous (its bytes straddle two slots' fingerprints): the safe side, the awaited lookup."""
    index, writer = fresh()
    writer.note(KeyPlace(b"\x00\x00\x00\x00\xaa\xbb\xcc\xdd", 3, 0), 100.0, 0.0)
    writer.note(KeyPlace(b"\xee\xff\x11\x22\x00\x00\x00\x01", 3, 0), 100.0, 0.0)
    assert index.knows(KeyPlace(b"\xaa\xbb\xcc\xdd\xee\xff\x11\x22", 3, 0), 50.0)


def test_authority_lasts_until_the_writer_says() -> None:
    index, writer = fresh()
    assert not index.authoritative(1.0)
    writer.set_valid_until(10.0)
    assert index.authoritative(9.9) and not index.authoritative(10.0)
    writer.set_valid_until(0.0)
    assert not index.authoritative(1.0)


def test_leader_cells_are_one_per_worker_and_read_as_one_slice() -> None:
    index, _ = fresh(workers=3)
    place = place_of(key_digest(NAME), index.buckets)
    assert index.leaders(place.slot) == index.no_leaders
    index.lead(place.slot, 2, place.fingerprint)
    cells = index.leaders(place.slot)
    assert cells != index.no_leaders and cells.find(place.fingerprint) == 16
    index.lead(place.slot, 0, place.fingerprint)
    assert index.leaders(place.slot).count(place.fingerprint) == 2
    index.unlead(place.slot, 2)
    index.clear_worker(0)
    assert index.leaders(place.slot) == index.no_leaders
    assert all(index.leaders(slot) == index.no_leaders for slot in range(LEADER_SLOTS))


def test_the_layout_is_sized_from_the_capacity_and_refuses_out_of_range() -> None:
    layout = IndexLayout(1024, 2)
    assert layout.buckets * 8 >= 2 * 1024
    assert layout.total == layout.leaders + LEADER_SLOTS * 2 * 8
    for capacity, workers in ((10, 2), (1024, 0)):
        with pytest.raises(ValueError):
            IndexLayout(capacity, workers)


def test_a_place_never_has_a_zero_fingerprint() -> None:
    assert place_of(b"\x05" + bytes(15), 1024).fingerprint == (1).to_bytes(8, "little")


def test_take_leads_an_unknown_key_once_per_host_and_tells_the_others_why_not() -> None:
    index, writer = fresh(workers=3)
    digest = key_digest(NAME)
    cell = index.take(digest, 1, 10.0)
    assert cell >= 0 and index.take(digest, 2, 10.0) == HOSTED and index.hosted(digest, 2)
    assert index.take(digest, 1, 10.0) == TAKEN  # its own cell already holds it: the awaited lookup
    other = bytes(8) + digest[8:15] + b"\x7f"  # the same slot (its first 8 bytes equal), another key
    assert index.take(digest[:8] + other[8:], 0, 10.0) == TAKEN
    index.release(cell)
    assert not index.hosted(digest, 2) and index.leaders(index.place(digest).slot) == index.no_leaders
    writer.note(index.place(digest), 20.0, 10.0)
    assert index.take(digest, 0, 15.0) == KNOWN and index.known(digest, 15.0)
    assert index.take(digest, 0, 25.0) >= 0  # expired: unknown again
