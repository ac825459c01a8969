"""Shared affinity table: bounded, expiring, and safe across forked writers."""

from __future__ import annotations

import mmap
import os
import random
import struct

import pytest
import xxhash

from shm.affinity import HEADER_BYTES, RECORD_BYTES, WAYS, AffinityTable


def count_live(table: AffinityTable, now: float) -> int:
    """Readable, unexpired records of ``table``: a full scan, through the reads ``lookup`` makes."""
    live = 0
    for slot in range(table.capacity):
        rec = HEADER_BYTES // 8 + slot * (RECORD_BYTES // 8)
        key_lo = table.words[rec + 1]
        if key_lo:
            read = table._read(rec, key_lo, table.words[rec + 2])
            live += read is not None and read[1].expires_at > now
    return live


def shared(capacity: int) -> tuple[mmap.mmap, AffinityTable]:
    mm = mmap.mmap(-1, AffinityTable.required_bytes(capacity))
    return mm, AffinityTable(memoryview(mm), capacity)


def test_required_bytes_rounds_capacity_up_to_whole_buckets() -> None:
    assert AffinityTable.required_bytes(1) == HEADER_BYTES + WAYS * RECORD_BYTES
    assert AffinityTable.required_bytes(WAYS * 3 + 1) == HEADER_BYTES + 4 * WAYS * RECORD_BYTES
    _, table = shared(20)
    assert table.capacity == 24
    with pytest.raises(ValueError):
        AffinityTable.required_bytes(0)


def test_bind_then_lookup_round_trips() -> None:
    _, table = shared(64)
    assert table.lookup(b"session", 0.0) is None
    table.bind(b"session", 11, 22, 100.0)
    found = table.lookup(b"session", 50.0)
    assert found is not None and tuple(found) == (11, 22, 100.0)
    assert table.lookup(b"other", 50.0) is None


def test_rebinding_a_key_replaces_its_record() -> None:
    _, table = shared(64)
    table.bind(b"k", 1, 1, 10.0)
    table.bind(b"k", 2, 3, 20.0)
    found = table.lookup(b"k", 0.0)
    assert found is not None and (found.stable_id_hash, found.capability_hash) == (2, 3)
    assert count_live(table, 0.0) == 1


def test_expired_binding_reads_as_absent() -> None:
    _, table = shared(64)
    table.bind(b"k", 1, 1, 10.0)
    assert table.lookup(b"k", 9.999) is not None
    assert table.lookup(b"k", 10.0) is None


def test_capacity_limit_does_not_grow_unbounded() -> None:
    mm, table = shared(64)
    size = len(mm)
    for i in range(10_000):
        table.bind(b"key-%d" % i, i + 1, 7, 1000.0 + i)
    assert count_live(table, 0.0) <= table.capacity == 64
    assert len(mm) == size
    assert table.lookup(b"key-9999", 0.0) is not None  # the newest binding is kept


def test_full_bucket_evicts_expired_or_oldest_first() -> None:
    _, table = shared(WAYS)  # a single bucket
    for i in range(WAYS):
        table.bind(b"k%d" % i, i + 1, 1, 100.0 + i)
    table.bind(b"late", 99, 1, 500.0)
    assert table.lookup(b"k0", 0.0) is None  # expires first: evicted
    assert all(table.lookup(b"k%d" % i, 0.0) is not None for i in range(1, WAYS))
    table.bind(b"k3", 4, 1, 1.0)  # rebinding keeps its slot, now expiring soonest
    table.bind(b"next", 5, 1, 600.0)
    assert table.lookup(b"k3", 0.0) is None
    assert table.lookup(b"k1", 0.0) is not None


def test_second_attachment_sees_the_same_bindings_and_checks_layout() -> None:
    mm, table = shared(64)
    table.bind(b"k", 5, 6, 10.0)
    again = AffinityTable(memoryview(mm), 64)
    found = again.lookup(b"k", 0.0)
    assert found is not None and found.stable_id_hash == 5
    with pytest.raises(ValueError):
        AffinityTable(memoryview(mm), 8)
    with pytest.raises(ValueError):
        AffinityTable(memoryview(bytearray(100)), 64)


def test_a_binding_another_worker_rewrites_or_evicts_is_read_again() -> None:
    # Each worker remembers what it read, valid only while the record's sequence is unchanged.
    mm, writer = shared(WAYS)  # a single bucket
    reader = AffinityTable(memoryview(mm), WAYS)
    writer.bind(b"k", 1, 1, 100.0)
    assert reader.lookup(b"k", 0.0) == (1, 1, 100.0)
    assert reader.lookup(b"k", 0.0) == (1, 1, 100.0)  # remembered
    writer.bind(b"k", 2, 3, 200.0)  # a failover on another worker moves the session
    assert reader.lookup(b"k", 0.0) == (2, 3, 200.0)
    for i in range(WAYS):  # newer sessions push it out of its bucket
        writer.bind(b"other-%d" % i, 9, 9, 300.0 + i)
    assert reader.lookup(b"k", 0.0) is None


def test_a_remembered_binding_still_expires_and_a_rebind_here_forgets_it() -> None:
    _, table = shared(64)
    table.bind(b"k", 1, 1, 10.0)
    assert table.lookup(b"k", 5.0) is not None
    assert table.lookup(b"k", 10.0) is None
    table.bind(b"k", 4, 4, 30.0)
    assert table.lookup(b"k", 20.0) == (4, 4, 30.0)


def _record_of(mm: mmap.mmap, table: AffinityTable, key: bytes) -> int:
    """Byte offset of the record holding ``key`` (found by scanning the tags)."""
    for slot in range(table.capacity):
        offset = HEADER_BYTES + slot * RECORD_BYTES
        stable = struct.unpack_from("<Q", mm, offset + 24)[0]
        if stable == 4242:
            return offset
    raise AssertionError("record not found")


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda mm, off: struct.pack_into("<Q", mm, off + 24, 4343), id="payload-half-written"),
        pytest.param(
            lambda mm, off: struct.pack_into("<d", mm, off + 40, 1e9), id="expiry-from-another-writer"
        ),
        pytest.param(lambda mm, off: struct.pack_into("<Q", mm, off + 48, 0), id="checksum-not-yet-written"),
        pytest.param(lambda mm, off: struct.pack_into("<Q", mm, off, 3), id="writer-inside-record"),
    ],
)
def test_torn_or_interleaved_record_reads_as_absent(tamper) -> None:  # type: ignore[no-untyped-def]
    mm, table = shared(64)
    table.bind(b"victim", 4242, 1, 10.0)
    tamper(mm, _record_of(mm, table, b"victim"))
    assert table.lookup(b"victim", 0.0) is None
    table.bind(b"victim", 4242, 1, 10.0)  # the next bind repairs it
    assert table.lookup(b"victim", 0.0) is not None


def test_key_left_in_two_ways_by_racing_writers_reads_the_later_binding() -> None:
    mm, table = shared(WAYS)  # a single bucket
    table.bind(b"k", 1, 1, 50.0)
    first = next(
        HEADER_BYTES + way * RECORD_BYTES
        for way in range(WAYS)
        if struct.unpack_from("<Q", mm, HEADER_BYTES + way * RECORD_BYTES + 24)[0] == 1
    )
    other = HEADER_BYTES + (WAYS - 1) * RECORD_BYTES
    key_lo, key_hi = struct.unpack_from("<QQ", mm, first + 8)
    payload = struct.pack("<QQQQd", key_lo, key_hi, 2, 1, 90.0)
    mm[other + 8 : other + 48] = payload
    struct.pack_into("<Q", mm, other + 48, xxhash.xxh3_64_intdigest(payload))
    found = table.lookup(b"k", 0.0)
    assert found is not None and found.stable_id_hash == 2
    later = table.lookup(b"k", 60.0)
    assert later is not None and later.stable_id_hash == 2
    assert table.lookup(b"k", 95.0) is None


# --------------------------------------------------------------------------- real processes

KEYS = [b"session-%d" % i for i in range(40)]
WRITERS = 3
ITERATIONS = 40_000


def _stable_for(key_index: int, writer: int) -> int:
    return (key_index + 1) * 1000 + writer


def _capability_for(stable: int) -> int:
    return stable * 7 + 3


def _expiry_for(stable: int) -> float:
    return 1e6 + stable


def _hammer(table: AffinityTable, writer: int, out: int) -> None:
    rng = random.Random(writer)
    hits = errors = 0
    for _ in range(ITERATIONS):
        k = rng.randrange(len(KEYS))
        stable = _stable_for(k, writer)
        table.bind(KEYS[k], stable, _capability_for(stable), _expiry_for(stable))
        r = rng.randrange(len(KEYS))
        found = table.lookup(KEYS[r], 0.0)
        if found is None:
            continue
        hits += 1
        valid = {_stable_for(r, w) for w in range(WRITERS)}
        if (
            found.stable_id_hash not in valid
            or found.capability_hash != _capability_for(found.stable_id_hash)
            or found.expires_at != _expiry_for(found.stable_id_hash)
        ):
            errors += 1
    os.write(out, struct.pack("<QQ", hits, errors))


def test_forked_writers_never_read_a_wrong_stable_id() -> None:
    # 40 keys in 16 slots: every bind evicts, and all writers fight over the same records.
    mm, table = shared(16)
    children: list[tuple[int, int]] = []
    for writer in range(WRITERS):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: hammer, report, exit without running pytest machinery
            code = 1
            try:
                os.close(read_end)
                _hammer(AffinityTable(memoryview(mm), 16), writer, write_end)
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        children.append((pid, read_end))
    hits = errors = 0
    for pid, read_end in children:
        _, status = os.waitpid(pid, 0)
        report = os.read(read_end, 16)
        os.close(read_end)
        assert os.waitstatus_to_exitcode(status) == 0
        child_hits, child_errors = struct.unpack("<QQ", report)
        hits += child_hits
        errors += child_errors
    assert errors == 0
    assert hits > 0
    assert count_live(table, 0.0) <= table.capacity
