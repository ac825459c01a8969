"""The access log's writer against outputs that stop taking lines: it drops and counts, never blocks."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from workers.line_writer import LineWriter

pytestmark = pytest.mark.timeout(30)  # a write that blocks would hang here: nobody reads the outputs


def put(writer: LineWriter, line: bytes) -> bool:
    """What the access log does with an encoded line: append it, drop it past the bound (``trim``)."""
    start = len(writer.buffer)
    writer.buffer += line
    writer.trim(start)
    writer.wrote()
    return len(writer.buffer) > start


def line(number: int) -> bytes:
    return json.dumps({"n": number, "pad": "x" * 80}).encode() + b"\n"


def numbers(data: bytes) -> list[int]:
    assert data.endswith(b"\n")
    return [json.loads(text)["n"] for text in data.splitlines()]  # every line whole


def drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def fill(writer: LineWriter, count: int) -> list[int]:
    """Offer ``count`` lines in bursts, letting the loop flush between them; the numbers accepted."""
    accepted = []
    for number in range(count):
        if put(writer, line(number)):
            accepted.append(number)
        if number % 100 == 0:
            await asyncio.sleep(0.002)
    await asyncio.sleep(0.05)  # a last flush attempt
    return accepted


def test_full_pipe_then_full_buffer_drops_and_counts():
    read_end, write_end = os.pipe()

    async def scenario() -> None:
        writer = LineWriter(f"/proc/self/fd/{write_end}", max_buffer_bytes=32 * 1024, flush_delay_s=0.001)
        accepted = await fill(writer, 5000)  # ~500 KB into a 64 KiB pipe nobody reads
        assert writer.dropped == 5000 - len(accepted) > 0
        assert os.get_blocking(write_end)  # the writer's O_NONBLOCK is on its own open file description
        in_pipe = numbers(drain(read_end))
        assert in_pipe == accepted[: len(in_pipe)]  # whole lines, in order
        assert len(writer.buffer) <= 32 * 1024 + len(line(0))

        await writer.close()  # the pipe has room again: what was buffered gets out
        assert in_pipe + numbers(drain(read_end)) == accepted

    try:
        asyncio.run(scenario())
    finally:
        os.close(read_end)
        os.close(write_end)


CHILD = textwrap.dedent("""
    import asyncio, json, os, sys, time
    from workers.line_writer import LineWriter

    async def main():
        writer = LineWriter("-", max_buffer_bytes=16 * 1024, flush_delay_s=0.001)
        slowest = 0.0
        for number in range(3000):
            started = time.perf_counter()
            start = len(writer.buffer)
            writer.buffer += json.dumps({"n": number, "pad": "x" * 300}).encode() + b"\\n"
            writer.trim(start)
            writer.wrote()
            slowest = max(slowest, time.perf_counter() - started)
            if number % 50 == 0:
                await asyncio.sleep(0.001)
        await writer.close(timeout_s=0.1)
        sys.stderr.write(json.dumps({"dropped": writer.dropped, "slowest": slowest,
                                     "stdout_blocking": os.get_blocking(1)}))

    asyncio.run(main())
""")


@pytest.mark.parametrize("kind", ["pipe", "socket"])
def test_standard_output_that_nobody_reads(kind):
    """A pipe (a plain redirect) or a stream socket (journald): full, yet the loop never blocks on it,
    and the shared standard output is not switched to non-blocking under the other writers."""
    if kind == "pipe":
        ours, theirs = os.pipe()
    else:
        left, right = socket.socketpair()
        ours, theirs = left.detach(), right.detach()
    try:
        child = subprocess.run([sys.executable, "-c", CHILD], stdout=theirs, stderr=subprocess.PIPE,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               timeout=20)
        assert child.returncode == 0, child.stderr.decode()
        report = json.loads(child.stderr)
        received = numbers(drain(ours))
        assert report["dropped"] > 0 and report["dropped"] + len(received) == 3000
        assert received == sorted(received)
        assert report["stdout_blocking"] is True
        assert report["slowest"] < 0.05  # appending never waited for the output
    finally:
        os.close(ours)
        os.close(theirs)


def test_trim_drops_and_counts_the_appended_lines_past_the_bound(tmp_path) -> None:
    async def main() -> None:
        writer = LineWriter(str(tmp_path / "trim.log"), max_buffer_bytes=10 * len(line(0)))
        writer.buffer += b"".join(line(n) for n in range(4))  # waiting from before, within the bound
        start = len(writer.buffer)
        writer.buffer += b"".join(line(n) for n in range(4, 13))  # a batch without per-line checks
        writer.trim(start)
        assert numbers(bytes(writer.buffer)) == list(range(10))  # whole lines, the oldest kept
        assert writer.dropped == 3
        full = len(writer.buffer) + 5  # a buffer already past its bound keeps what it had
        writer.max_buffer_bytes = full - 100
        writer.buffer += line(99)
        writer.trim(full - 5)
        assert numbers(bytes(writer.buffer)) == list(range(10)) and writer.dropped == 4
        await writer.close()

    asyncio.run(main())
