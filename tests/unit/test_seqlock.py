from __future__ import annotations

import mmap
import os
import time

import pytest

from shm.seqlock import SeqlockBusy, read_record, write_record

RECORD_WORDS = 15


def _words(size: int = 4096) -> memoryview:
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_SHARED)).cast("q")


def _record(k: int) -> list[int]:
    # Every word derives from k differently, so any mix of two publishes is detectable.
    return [k * (i + 1) ^ (0x5555 << i) for i in range(RECORD_WORDS)]


def test_write_then_read_returns_the_record_and_an_even_sequence() -> None:
    words = _words()
    write_record(words, 8, _record(7))
    assert read_record(words, 8, RECORD_WORDS) == _record(7)
    assert words[8] == 2  # the record's sequence word


def test_reader_gives_up_on_a_writer_that_died_mid_publish_and_the_next_writer_repairs_it() -> None:
    words = _words()
    write_record(words, 0, _record(1))
    words[0] += 1  # a writer died after making the sequence odd
    with pytest.raises(SeqlockBusy):
        read_record(words, 0, RECORD_WORDS, timeout_s=0.01)
    write_record(words, 0, _record(2))
    assert words[0] % 2 == 0
    assert read_record(words, 0, RECORD_WORDS) == _record(2)


def test_reader_never_sees_a_torn_record_while_a_forked_writer_hammers_it() -> None:
    words = _words()
    write_record(words, 0, _record(0))
    stop_word = 64  # the reader tells the writer to stop
    pid = os.fork()
    if pid == 0:  # writer
        code = 0
        try:
            k = 1
            while not words[stop_word]:
                write_record(words, 0, _record(k))
                k += 1
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    reads = torn = 0
    seen: set[int] = set()
    deadline = time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline:
            try:
                values = read_record(words, 0, RECORD_WORDS)
            except SeqlockBusy:  # the writer was descheduled mid-publish (a busy machine): read again
                continue
            k = values[0] ^ 0x5555
            reads += 1
            seen.add(k)
            if values != _record(k):
                torn += 1
    finally:
        words[stop_word] = 1
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torn == 0
    assert reads > 1000
    assert len(seen) > 100  # the reader really raced a moving writer
