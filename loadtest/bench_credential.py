"""Micro-benchmark: what a long Authorization value costs each request-head step, 40 vs 700-byte bearer.

    python -m loadtest.bench_credential [--number 20000]

Prints µs per call (best of 5) of the codec's head parse: by the plain-head parser (the server's config,
gateway/http/request_head.py), and by h11 with and without the set-aside (gateway/http/credential_line.py);
the plain-head parser alone; the strict head checks, the header scan and the credential's digest.
The difference between the two lengths is the per-byte work the JWT and long-key variants pay.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import timeit
from collections.abc import Callable

from gateway.http import codec
from gateway.http.credential_line import MIN_SET_ASIDE_BYTES
from gateway.http.framing import check_request_head
from gateway.http.request_head import parse_plain_head
from gateway.identity.auth import presented_digest
from gateway.request.headers import HeaderPlan

WRK_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nX-Session-Id: session-17\r\nContent-Length: 100\r\n\r\n")


def head(token_bytes: int) -> bytes:
    return WRK_HEAD % (b"eyJ" + b"x" * (token_bytes - 3))


def parse(wire: bytes, set_aside_bytes: int, plain_heads: bool = False) -> Callable[[], object]:
    def run() -> object:
        server = codec.ServerCodec(65536, 100, set_aside_bytes, plain_heads)
        server.feed(wire)
        return server.next_event()
    return run


def steps(token_bytes: int) -> dict[str, Callable[[], object]]:
    wire = head(token_bytes)
    event = parse(wire, sys.maxsize)()
    pairs = codec.header_pairs(event.headers)
    plan = HeaderPlan("x-model")
    authorization = dict(pairs)[b"authorization"]
    return {
        "codec head parse, plain-head parser": parse(wire, MIN_SET_ASIDE_BYTES, plain_heads=True),
        "parse_plain_head alone": lambda: parse_plain_head(wire),
        "codec head parse, h11 alone": parse(wire, sys.maxsize),
        "codec head parse, set-aside": parse(wire, MIN_SET_ASIDE_BYTES),
        "header_pairs": lambda: codec.header_pairs(event.headers),
        "check_request_head": lambda: check_request_head(b"POST", b"/v1/chat/completions", b"1.1", pairs, 8192, 1 << 20),
        "check_request_head, a plain head": lambda: check_request_head(
            b"POST", b"/v1/chat/completions", b"1.1", pairs, 8192, 1 << 20, values_checked=True),
        "HeaderPlan.scan": lambda: plan.scan(pairs),
        "presented_digest (sha256)": lambda: presented_digest(authorization, None),
        "sha256 of the value": lambda: hashlib.sha256(authorization).digest(),
        "hash() of a fresh bytes copy": lambda: hash(bytes(bytearray(authorization))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--lengths", default="40,700,1000")
    args = parser.parse_args(argv)
    lengths = [int(length) for length in args.lengths.split(",")]
    table = {length: steps(length) for length in lengths}
    print("| step | " + " | ".join(f"{length} B µs" for length in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name in table[lengths[0]]:
        cells = [min(timeit.repeat(table[length][name], number=args.number, repeat=5)) / args.number * 1e6
                 for length in lengths]
        print(f"| {name} | " + " | ".join(f"{cell:.2f}" for cell in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
