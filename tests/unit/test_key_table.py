"""The host key table in shared memory (shm.keys) and a worker's lookup over it (gateway.keys.lookup)."""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import time

import pytest

from gateway.identity.keyformat import key_digest, new_key, new_kid
from gateway.keys.lookup import KeyLookup
from gateway.keys.record import KeyRecord, PreviousSecret
from gateway.keys.view import views_of
from shm.keys import KeyTable, KeyTableFull, KeyTableWriter, TableLayout


def digest(n: int) -> bytes:
    return hashlib.sha256(b"key-%d" % n).digest()


def blob_for(n: int, size: int) -> bytes:
    """A blob whose every byte says which key and size it belongs to: a torn read cannot pass for one."""
    return bytes([n % 251]) * size


def record(key: str, **fields) -> KeyRecord:
    kid = key.split("-")[1]
    base = dict(kid=kid, tenant="team-a", status="active", digest=key_digest(key).hex(), created_at=1,
                created_by="ops", updated_at=1, version=1)
    return KeyRecord(**{**base, **fields})


def test_every_key_put_is_found_with_its_blob_until_removed():
    table = KeyTable.create(2000)
    writer = KeyTableWriter(table)
    for n in range(2000):
        writer.put(digest(n), blob_for(n, n % 700 + 1))
    assert len(table) == 2000
    for n in range(2000):
        slot, version = table.find(digest(n))
        assert table.blob(slot, version) == blob_for(n, n % 700 + 1)
    assert table.find(digest(5000)) is None
    for n in range(0, 2000, 2):
        assert writer.remove(digest(n))
    assert not writer.remove(digest(0))
    assert [table.find(digest(n)) is None for n in range(6)] == [True, False] * 3
    for n in range(0, 2000, 2):  # the freed slots and heap take new records
        writer.put(digest(n), blob_for(n + 1, 300))
    assert table.blob(*table.find(digest(10))) == blob_for(11, 300)
    assert len(table) == 2000


def test_a_key_past_the_capacity_is_refused_and_the_others_keep_working():
    table = KeyTable.create(10)
    writer = KeyTableWriter(table)
    for n in range(10):
        writer.put(digest(n), b"x")
    with pytest.raises(KeyTableFull, match="auth.key_table_capacity"):
        writer.put(digest(10), b"x")
    assert table.find(digest(10)) is None
    assert all(table.find(digest(n)) for n in range(10))
    writer.put(digest(3), b"replaced")  # a known key still changes
    assert table.blob(*table.find(digest(3))) == b"replaced"


def test_a_record_too_big_for_the_heap_is_refused_without_changing_anything():
    table = KeyTable.create(4)  # 4 * 512 heap bytes
    writer = KeyTableWriter(table)
    writer.put(digest(1), b"a" * 1500)
    with pytest.raises(KeyTableFull, match="heap"):
        writer.put(digest(2), b"b" * 1000)
    assert table.find(digest(2)) is None and len(table) == 1
    writer.remove(digest(1))
    writer.put(digest(2), b"b" * 1000)  # the freed chunks are reused
    assert table.blob(*table.find(digest(2))) == b"b" * 1000


def test_every_change_gives_the_slot_a_new_version_so_cached_decodes_are_dropped():
    table = KeyTable.create(100)
    writer = KeyTableWriter(table)
    writer.put(digest(1), b"one")
    slot, first = table.find(digest(1))
    writer.put(digest(1), b"two")  # in place
    assert table.find(digest(1)) == (slot, first + 1)
    assert table.blob(slot, first) is None  # a reader holding the old version learns it changed
    writer.put(digest(1), b"three" * 100)  # moved to a bigger heap block
    assert table.find(digest(1))[1] == first + 2
    writer.remove(digest(1))
    writer.put(digest(2), b"other")
    if table.find(digest(2))[0] == slot:  # a reused slot never repeats a version
        assert table.find(digest(2))[1] > first + 2


def test_lookup_answers_the_changed_record_after_a_block():
    table = KeyTable.create(100)
    writer = KeyTableWriter(table)
    key = new_key(new_kid())
    for digest_, blob in views_of(record(key), 0).items():
        writer.put(digest_, blob)
    lookup = KeyLookup(table)
    entry = lookup(key_digest(key))
    assert entry is not None and entry.status == "active" and entry.tenant == "team-a"
    assert lookup(key_digest(key)) is entry  # decoded once per version
    for digest_, blob in views_of(record(key, status="blocked", version=2), 0).items():
        writer.put(digest_, blob)
    assert lookup(key_digest(key)).status == "blocked"
    assert lookup(key_digest(new_key(new_kid()))) is None


def test_a_lookup_is_reused_only_while_the_table_is_unchanged():
    table = KeyTable.create(100)
    writer = KeyTableWriter(table)
    key, other = new_key(new_kid()), new_key(new_kid())
    for digest_, blob in views_of(record(key), 0).items():
        writer.put(digest_, blob)
    lookup = KeyLookup(table)
    entry = lookup(key_digest(key))
    seq = table.seq()
    assert lookup(key_digest(key)) is entry and table.seq() == seq  # nothing changed: the same answer
    for digest_, blob in views_of(record(other), 0).items():  # another key's change moves the seqlock word
        writer.put(digest_, blob)
    assert table.seq() != seq and lookup(key_digest(key)) is entry  # looked up again: same slot and version
    writer.remove(key_digest(key))  # revoked and dropped: the next lookup sees it gone at once
    assert lookup(key_digest(key)) is None
    for digest_, blob in views_of(record(key, status="revoked", version=3), 0).items():
        writer.put(digest_, blob)
    assert lookup(key_digest(key)).status == "revoked"


def test_use_marks_an_active_key_used_and_leaves_a_blocked_or_expiring_one_to_the_caller():
    table = KeyTable.create(100)
    writer = KeyTableWriter(table)
    writer.set_minute(29_000_000)
    plain, expiring = new_key(new_kid()), new_key(new_kid())
    for key, fields in ((plain, {}), (expiring, {"expires_at": 5000})):
        for digest_, blob in views_of(record(key, **fields), 0).items():
            writer.put(digest_, blob)
    lookup = KeyLookup(table)
    entry = lookup.use(key_digest(plain))
    assert entry is not None and entry.plain and table.used_since(1) == [(entry.slot, 29_000_000)]
    writer.set_minute(29_000_001)
    assert lookup.use(key_digest(plain)) is entry  # the table did not change: the same entry, marked again
    assert table.used_since(29_000_001) == [(entry.slot, 29_000_001)]
    dated = lookup.use(key_digest(expiring))
    assert dated is not None and not dated.plain and dated.expires_at == 5000
    assert table.used_since(29_000_001) == [(entry.slot, 29_000_001)]  # the caller decides and marks it
    for digest_, blob in views_of(record(plain, status="blocked", version=2), 0).items():
        writer.put(digest_, blob)
    blocked = lookup.use(key_digest(plain))
    assert blocked is not entry and blocked.status == "blocked" and not blocked.plain
    assert lookup.use(key_digest(new_key(new_kid()))) is None


def test_a_rotated_key_opens_with_both_secrets_until_the_grace_ends():
    old, new = new_key("AAAAAAAAAAAA"), new_key("AAAAAAAAAAAA")
    rotated = record(new, previous=[PreviousSecret(key_digest(old).hex(), until=2000)], expires_at=5000)
    blobs = views_of(rotated, now=1000)
    table = KeyTable.create(10)
    writer = KeyTableWriter(table)
    for digest_, blob in blobs.items():
        writer.put(digest_, blob)
    lookup = KeyLookup(table)
    assert lookup(key_digest(new)).expires_at == 5000
    assert lookup(key_digest(old)).expires_at == 2000  # the grace's end
    assert key_digest(old) not in views_of(rotated, now=2000)  # over: not written again


def placed(first: int, second: int, tag: int) -> bytes:
    """A digest whose two candidate slots are ``first`` and ``second`` (in a table of 10 slots)."""
    return struct.pack("<QQ", first, second) + bytes([tag]) * 16


def test_a_key_moved_to_its_other_slot_keeps_its_blob_and_last_use():
    table = KeyTable.create(4)  # 10 slots
    writer = KeyTableWriter(table)
    writer.set_minute(29_000_000)
    first = placed(3, 5, 1)
    assert writer.put(first, b"first") == 3
    table.mark_used(3)
    assert writer.put(placed(3, 3, 2), b"second") == 3  # its only slot: the first key moves to 5
    assert table.find(first)[0] == 5 and table.blob(*table.find(first)) == b"first"
    assert table.blob(*table.find(placed(3, 3, 2))) == b"second"
    assert table.used_since(1) == [(5, 29_000_000)]
    with pytest.raises(KeyTableFull):  # both choices held by keys that cannot move
        writer.put(placed(3, 3, 3), b"third")


def test_used_marks_carry_the_published_minute_and_a_freed_slot_forgets_them():
    table = KeyTable.create(50)
    writer = KeyTableWriter(table)
    writer.set_minute(29_000_000)
    slot = writer.put(digest(1), b"x")
    table.mark_used(slot)
    assert table.used_since(29_000_000) == [(slot, 29_000_000)]
    assert table.used_since(29_000_001) == []
    writer.remove(digest(1))
    assert table.used_since(1) == []


def test_a_reader_in_another_process_never_sees_a_torn_record():
    # The child hammers lookups while this process rewrites every record in place and moves them
    # to bigger blocks: each blob read back must be one whole blob the writer wrote.
    table = KeyTable.create(64)
    writer = KeyTableWriter(table)
    for n in range(64):
        writer.put(digest(n), blob_for(n, 10))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader: whatever happens, it answers and exits (never runs on as a copy of pytest)
        os.close(read)
        bad, whole = -1, 0
        try:
            bad = 0
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                for n in range(64):
                    try:
                        found = table.find(digest(n))
                        data = None if found is None else table.blob(*found)
                    except TimeoutError:  # the writer descheduled mid-change past the read budget (a loaded
                        continue  # machine): the lookup refuses, it reads nothing, torn or whole
                    if data is not None and (len(set(data)) != 1 or data[0] != n % 251):
                        bad += 1
                    whole += data is not None
        finally:
            os.write(write, f"{bad} {whole}".encode())
            os._exit(0)
    os.close(write)
    try:
        size = 10
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            size = size % 400 + 7
            for n in range(64):
                writer.put(digest(n), blob_for(n, size))
        bad, whole = map(int, os.read(read, 100).split())
        assert bad == 0 and whole > 64, (bad, whole)  # no torn record in more than one pass over the table
    finally:
        os.close(read)
        os.kill(pid, signal.SIGKILL) if _alive(pid) else None
        os.waitpid(pid, 0)


def test_the_table_is_sized_from_its_capacity():
    layout = TableLayout(100_000)
    assert layout.slots == 250_000
    # What the table costs whatever it holds (header, digests, meta and used cells: everything before
    # the heap): 32 + 16 + 4 bytes per slot, 2.5 slots per key; then 512 heap bytes per key.
    assert layout.heap < 14 * 1024 * 1024
    assert layout.heap_bytes == 100_000 * 512
    with pytest.raises(ValueError):
        TableLayout(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
