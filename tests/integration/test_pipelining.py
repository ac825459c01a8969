"""Issue 20 end to end: pipelined requests of every framing kind through a real gateway and provider.

Bytes on the wire in, bytes on the wire out: each request reaches the provider exactly once (counted
at the provider), each is answered exactly once and in order (each answer names its request), sent in
one write, in 7-byte pieces, or a byte at a time. On main, one chunked POST and a GET in one write were
forwarded 3 times, two chunked POSTs and a GET 45 times, and three chunked POSTs grew the worker to 4 GB.
(Every byte boundary, at the codec: tests/unit/test_pipelining_replay.py.)
"""

from __future__ import annotations

import json
import socket
import time

import h11
import pytest

from tests.fuzz_http import request
from tests.harness import candidate, envelope, mock_served

MODELS = [f"m{index}" for index in range(4)]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from loadtest.mock_provider import start_mock_provider_process
    from tests.harness import Gateway

    handle = start_mock_provider_process(0, "pipe")
    gateway = Gateway(str(tmp_path_factory.mktemp("pipelining")), {"pipe": [handle.address]},
                      envelope([candidate(model, "pipe") for model in MODELS])).start()
    yield handle, gateway
    gateway.stop()
    handle.stop()


def wire_of(kind: str, seq: int) -> bytes:
    """A chat completion naming model m<seq> and carrying X-Seq (the mock echoes both), or a GET of
    /v1/models (bodyless: answered by the gateway, never forwarded)."""
    headers = [(b"x-seq", b"%d" % seq), (b"x-mock-echo", b"1"), (b"content-type", b"application/json")]
    if kind == "empty_chunked":
        headers.append((b"x-model", b"m%d" % seq))
    body = b'{"model": "m%d", "messages": [{"role": "user", "content": "hello %d"}]}' % (seq, seq)
    target = b"/v1/models" if kind == "bodyless" else b"/v1/chat/completions"
    return request(kind, target, body, sizes=[7, 5], headers=headers).wire


SENTINEL = b"GET /v1/models HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n"


def pipeline_exchange(port: int, payload: bytes, split: int | None, kinds: list[str]) -> list[tuple[int, dict]]:
    """Write ``payload`` (whole or in ``split``-byte pieces) without waiting for any answer, as a
    pipelining client does; read the answers; once as many arrived as requests were sent, send one
    more request (asking to close) and read to the end. The answers, read by a plain h11 client, must
    be one per request, in order, then the last one's: a replayed request shows up as one too many."""
    client = h11.Connection(h11.CLIENT)
    out: list[tuple[int, dict]] = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        step = split or len(payload)
        for start in range(0, len(payload), step):
            sock.sendall(payload[start:start + step])
            if split:
                time.sleep(0.0002)
        for kind in [*kinds, "bodyless"]:
            if len(out) == len(kinds):
                sock.sendall(SENTINEL)
            client.send(h11.Request(method="GET" if kind == "bodyless" else "POST", target="/",
                                    headers=[("host", "g"), ("content-length", "0")]))
            client.send(h11.EndOfMessage())
            status, body = 0, b""
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(sock.recv(65536))
                elif type(event) is h11.ConnectionClosed:
                    raise AssertionError(f"connection closed after {len(out)} answers")
                elif type(event) is h11.Response:
                    status = event.status_code
                elif type(event) is h11.Data:
                    body += event.data
                elif type(event) is h11.EndOfMessage:
                    break
            out.append((status, json.loads(body)))
            if client.our_state is h11.DONE and client.their_state is h11.DONE:
                client.start_next_cycle()
        rest = client.trailing_data[0]
        while data := sock.recv(65536):
            rest += data
    assert not rest, f"bytes after the last answer: {rest[:300]!r}"
    return out[:-1]


STREAMS = {
    "chunked+get": ["chunked", "bodyless"],  # forwarded 3 times on main
    "chunked+chunked+get": ["chunked", "chunked", "bodyless"],  # 45 times
    "chunked+chunked": ["chunked", "chunked"],  # 1,000 times (max_requests_per_connection)
    "three_chunked": ["chunked", "chunked", "chunked"],  # the 4 GB worker
    "length+chunked_ext_trailers+empty_chunked": ["length", "chunked_ext_trailers", "empty_chunked"],
    "chunked_ext+length+get": ["chunked_ext", "length", "bodyless"],
    "get+chunked_trailers+length": ["bodyless", "chunked_trailers", "length"],
}


# Every stream in one write and in 7-byte pieces; two representative ones a byte at a time too (every
# byte boundary of every kind: the codec test).
CASES = [(name, split) for name in sorted(STREAMS) for split in (None, 7)] + [
    ("chunked+chunked+get", 1), ("length+chunked_ext_trailers+empty_chunked", 1)]


@pytest.mark.parametrize(("name", "split"), CASES, ids=[f"{name}-{split or 'whole'}" for name, split in CASES])
def test_each_pipelined_request_is_forwarded_once_and_answered_once_in_order(pipeline, name, split):
    handle, gateway = pipeline
    kinds = STREAMS[name]
    worker = gateway.worker_pids()
    before = mock_served(handle, ["chat"])
    payload = b"".join(wire_of(kind, seq) for seq, kind in enumerate(kinds))
    got = pipeline_exchange(gateway.port, payload, split, kinds)
    for seq, (kind, (status, body)) in enumerate(zip(kinds, got, strict=True)):
        assert status == 200, (seq, body)
        if kind == "bodyless":
            assert body["object"] == "list"
            continue
        assert ["x-seq", str(seq)] in [[n.lower(), v] for n, v in body["mock_echo"]["headers"]]
        if kind != "empty_chunked":
            assert body["model"] == f"m{seq}"  # the body forwarded is this request's
    assert mock_served(handle, ["chat"]) - before == sum(kind != "bodyless" for kind in kinds)
    assert gateway.worker_pids() == worker  # the worker neither died nor was replaced
