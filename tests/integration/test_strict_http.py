"""Strict intermediary rules (RFC 9112 / 9110): each case sent whole and split into small writes.

Every rejection must carry the precise status with an OpenAI-style JSON body, close the
connection, and send nothing to the provider.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.harness import candidate, envelope, mock_served, raw_exchange, status_of

MAX_HEADER = 4096
MAX_BODY = 2048
MAX_URL = 1024


@pytest.fixture(scope="module")
def strict_gateway(tmp_path_factory):
    from loadtest.mock_provider import start_mock_provider_process
    from tests.harness import Gateway

    handle = start_mock_provider_process(0, "strict")
    directory = tmp_path_factory.mktemp("strict")
    gateway = Gateway(
        str(directory), {"strict": [handle.address]}, envelope([candidate("m", "strict")]),
        cluster_options={"allowed_routes": ["GET,POST /debug/echo"]},  # the mock's echo page, read back below
        extra={
            "limits": {"max_header_bytes": MAX_HEADER, "max_body_bytes": MAX_BODY, "max_url_bytes": MAX_URL},
            "timeouts": {"header_read": "1s"},
        },
    ).start()
    yield handle, gateway
    gateway.stop()
    handle.stop()


GOOD_BODY = b'{"model": "m"}'
GOOD_REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 14\r\n\r\n" + GOOD_BODY

CASES = {
    "content_length_and_transfer_encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 14\r\n"
        b"Transfer-Encoding: chunked\r\n\r\ne\r\n" + GOOD_BODY + b"\r\n0\r\n\r\n", 400),
    "transfer_encoding_on_http10": (
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"e\r\n" + GOOD_BODY + b"\r\n0\r\n\r\n", 400),
    "unsupported_transfer_encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
    "host_list": (b"GET /v1/models HTTP/1.1\r\nHost: a, b\r\n\r\n", 400),
    "empty_host": (b"GET /v1/models HTTP/1.1\r\nHost:\r\n\r\n", 400),
    "two_hosts": (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    "missing_host_http11": (b"GET /v1/models HTTP/1.1\r\nX: y\r\n\r\n", 400),
    "http2_request_line": (b"GET /v1/models HTTP/2.0\r\nHost: g\r\n\r\n", 505),
    "connect": (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 405),
    "asterisk_form": (b"OPTIONS * HTTP/1.1\r\nHost: g\r\n\r\n", 400),
    "authority_form_target": (b"GET example.com:80 HTTP/1.1\r\nHost: g\r\n\r\n", 400),
    "absurd_content_length": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 99999999999\r\n\r\n" + GOOD_BODY, 413),
    "body_over_limit": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)
        + b"x" * (MAX_BODY + 1), 413),
    "chunked_body_over_limit": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"400\r\n" + b"x" * 1024 + b"\r\n") * 3 + b"0\r\n\r\n", 413),
    "absurd_chunk_size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"fffffffffffffff\r\nabc", 413),
    "absurd_chunk_size_behind_leading_zeros": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"000000000000000000000000fffffffff\r\nabc", 413),
    "chunk_data_without_crlf": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"e\r\n" + GOOD_BODY + b"XX0\r\n\r\n", 400),
    "malformed_chunk_extension": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"e;=\x01\r\n" + GOOD_BODY + b"\r\n0\r\n\r\n", 400),
    "malformed_trailer": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"e\r\n" + GOOD_BODY + b"\r\n0\r\nno colon here\r\n\r\n", 400),
    "control_byte_0x01_in_header_value": (b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-A: a\x01b\r\n\r\n", 400),
    "control_byte_0x07_in_header_value": (b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-A: \x07\r\n\r\n", 400),
    "control_byte_0x1f_in_header_value": (b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-A: a\x1f\r\n\r\n", 400),
    "control_byte_0x7f_in_header_value": (b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-A: a\x7fb\r\n\r\n", 400),
    "control_byte_in_host": (b"GET /v1/models HTTP/1.1\r\nHost: \x07\r\n\r\n", 400),
    "userinfo_in_host": (b"GET /v1/models HTTP/1.1\r\nHost: user@a\r\n\r\n", 400),
    "bad_port_in_host": (b"GET /v1/models HTTP/1.1\r\nHost: a:8x\r\n\r\n", 400),
    "two_leading_empty_lines": (b"\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: g\r\n\r\n", 400),
    "oversized_chunk_extension": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"e;ext=" + b"x" * 5000 + b"\r\n" + GOOD_BODY + b"\r\n0\r\n\r\n", 400),
    "header_block_too_large": (
        b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-Big: " + b"y" * (MAX_HEADER + 10) + b"\r\n\r\n", 431),
    "many_headers_too_large": (
        b"GET /v1/models HTTP/1.1\r\nHost: g\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60) for i in range(80))
        + b"\r\n", 431),
    "url_too_long": (b"GET /" + b"a" * (MAX_URL + 1) + b" HTTP/1.1\r\nHost: g\r\n\r\n", 414),
    "space_before_colon": (b"GET /v1/models HTTP/1.1\r\nHost : g\r\n\r\n", 400),
    "garbage_request_line": (b"HELLO\r\n\r\n", 400),
    "bad_content_length": (b"POST / HTTP/1.1\r\nHost: g\r\nContent-Length: 1x\r\n\r\n", 400),
    "conflicting_content_lengths": (
        b"POST / HTTP/1.1\r\nHost: g\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    # limits.max_header_count (100): counted before any header is parsed, however small the block.
    "too_many_header_fields": (
        b"GET /v1/models HTTP/1.1\r\nHost: g\r\n" + b"a:b\r\n" * 100 + b"\r\n", 431),
    "obfuscated_transfer_encoding": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: xchunked\r\n\r\n", 501),
    "two_transfer_encodings": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501),
    "negative_chunk_size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"-e\r\n" + GOOD_BODY + b"\r\n0\r\n\r\n", 400),
    "bare_lf_after_chunk_size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"e\n" + GOOD_BODY + b"\r\n0\r\n\r\n", 400),
    "chunk_data_longer_than_its_size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\n" + GOOD_BODY + b"\r\n0\r\n\r\n", 400),
    "nul_in_header_value": (b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-A: a\x00b\r\n\r\n", 400),
}


@pytest.mark.parametrize("split", [None, 7], ids=["whole", "split"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rejects_and_closes(strict_gateway, case, split):
    handle, gateway = strict_gateway
    payload, expected = CASES[case]
    before = mock_served(handle)
    raw = raw_exchange(gateway.port, payload, split=split, pause=0.0005)
    assert status_of(raw) == expected, raw[:300]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["message"] and error["type"] and error["code"]
    # The server closed the connection (raw_exchange returned on EOF) and nothing went upstream.
    assert mock_served(handle) == before


SMUGGLED = b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 14\r\n\r\n" + GOOD_BODY


@pytest.mark.parametrize("split", [None, 7], ids=["whole", "split"])
@pytest.mark.parametrize("case", ["content_length_and_transfer_encoding", "transfer_encoding_on_http10",
                                  "chunk_data_without_crlf", "negative_chunk_size", "bare_lf_after_chunk_size",
                                  "chunk_data_longer_than_its_size", "two_transfer_encodings", "malformed_trailer",
                                  "conflicting_content_lengths", "too_many_header_fields"])
def test_pipelined_request_after_rejection_is_never_processed(strict_gateway, case, split):
    # Once framing is in doubt nothing more is read from the connection: a request pipelined behind
    # a rejected one (where a smuggling attempt would put it) never reaches the provider.
    handle, gateway = strict_gateway
    before = mock_served(handle)
    raw = raw_exchange(gateway.port, CASES[case][0] + SMUGGLED * 3, split=split, pause=0.0005)
    assert raw.count(b"HTTP/1.1 ") == 1 and status_of(raw) == CASES[case][1], raw[:300]
    assert mock_served(handle) == before


@pytest.mark.parametrize("cut", ["head", "length_body", "chunked_body"])
def test_a_request_cut_short_by_a_half_close_is_answered_400_at_once(strict_gateway, cut):
    # The client can never finish it: answer now, instead of at the header or body deadline.
    handle, gateway = strict_gateway
    before = mock_served(handle)
    partial = {
        "head": b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-A: b",
        "length_body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 14\r\n\r\n" + GOOD_BODY[:5],
        "chunked_body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"e\r\n" + GOOD_BODY + b"\r\n",
    }[cut]
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
    started = time.monotonic()
    sock.sendall(GOOD_REQUEST + partial)
    sock.shutdown(socket.SHUT_WR)
    raw = b""
    while data := sock.recv(65536):
        raw += data
    sock.close()
    assert time.monotonic() - started < 0.9  # well before the 1 s header deadline
    assert raw.count(b"HTTP/1.1 200 ") == 1 and raw.count(b"HTTP/1.1 400 ") == 1, raw[-300:]
    assert mock_served(handle) == before + 1  # the complete request before it, once


def test_absolute_form_target_is_accepted(strict_gateway):
    _, gateway = strict_gateway
    raw = raw_exchange(gateway.port, b"GET http://example.com/v1/models HTTP/1.1\r\nHost: example.com\r\n"
                       b"Connection: close\r\n\r\n")
    assert status_of(raw) == 200


def test_chunked_request_body_is_forwarded(strict_gateway):
    handle, gateway = strict_gateway
    before = mock_served(handle)
    payload = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"5;ext=1\r\n" + GOOD_BODY[:5] + b"\r\n9\r\n" + GOOD_BODY[5:] + b"\r\n0\r\n\r\n"
    )
    for split in (None, 3):
        raw = raw_exchange(gateway.port, payload, split=split, pause=0.0005)
        assert status_of(raw) == 200, raw[:300]
    assert mock_served(handle) == before + 2


@pytest.mark.parametrize("split", [None, 1, 3], ids=["whole", "split1", "split3"])
@pytest.mark.parametrize("case", ["leading_zeros", "leading_empty_line", "valid_hosts"])
def test_valid_but_odd_syntax_is_accepted_and_reframed(strict_gateway, case, split):
    handle, gateway = strict_gateway
    before = mock_served(handle)
    if case == "leading_zeros":  # 1*HEXDIG: the size limit applies to the value, not the digits
        payload = (b"POST /debug/echo HTTP/1.1\r\nHost: g\r\nX-Model: m\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
                   b"Connection: close\r\n\r\n" + b"0" * 40 + b"5\r\nhello\r\n" + b"0" * 30 + b"\r\n\r\n")
    elif case == "leading_empty_line":  # RFC 9112 §2.2: one empty line before the request line is ignored
        payload = b"\r\nPOST /debug/echo HTTP/1.1\r\nHost: g\r\nX-Model: m\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n" \
                  b"Connection: close\r\n\r\nhello"
    else:
        payload = b"POST /debug/echo HTTP/1.1\r\nHost: [::1]:8080\r\nX-Model: m\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n" \
                  b"Connection: close\r\n\r\nhello"
    raw = raw_exchange(gateway.port, payload, split=split, pause=0.0005)
    assert status_of(raw) == 200, raw[:300]
    echoed = json.loads(raw.partition(b"\r\n\r\n")[2])
    headers = {k.lower(): v for k, v in echoed["headers"]}
    assert echoed["body"] == "hello" and headers["content-length"] == "5" and "transfer-encoding" not in headers
    assert mock_served(handle) == before + 1


def test_empty_line_between_keepalive_requests_is_ignored(strict_gateway):
    _, gateway = strict_gateway
    one = b"GET /v1/models HTTP/1.1\r\nHost: g\r\n\r\n"
    raw = raw_exchange(gateway.port, one + b"\r\n" + one[:-2] + b"Connection: close\r\n\r\n")
    assert raw.count(b"HTTP/1.1 200 ") == 2


@pytest.mark.parametrize("split", [None, 5], ids=["whole", "split"])
def test_incomplete_header_block_times_out_with_408(strict_gateway, split):
    _, gateway = strict_gateway
    started = time.monotonic()
    raw = raw_exchange(gateway.port, b"GET /v1/models HTTP/1.1\r\nHost: g\r\nX-Slow: ", split=split, timeout=5)
    assert status_of(raw) == 408
    assert 0.8 <= time.monotonic() - started < 4


def test_slowloris_header_drip_is_cut_at_the_deadline(strict_gateway):
    _, gateway = strict_gateway
    started = time.monotonic()
    raw = raw_exchange(gateway.port, b"GET /v1/models HTTP/1.1\r\nHost: g\r\n" + b"X-A: b\r\n" * 40,
                       split=8, pause=0.1, timeout=6)
    assert status_of(raw) == 408
    assert time.monotonic() - started < 3


def test_expect_continue_gets_100(strict_gateway):
    _, gateway = strict_gateway
    raw = raw_exchange(
        gateway.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nExpect: 100-continue\r\nConnection: close\r\n"
        b"Content-Length: 14\r\n\r\n" + GOOD_BODY,
    )
    assert raw.startswith(b"HTTP/1.1 100 ")
    assert b"HTTP/1.1 200 " in raw


def test_obs_fold_is_replaced_by_a_space_before_forwarding(strict_gateway):
    # RFC 9112 §5.2: a server must reject obs-fold or replace it with SP; the codec does the latter.
    _, gateway = strict_gateway
    raw = raw_exchange(gateway.port, b"GET /debug/echo HTTP/1.1\r\nHost: g\r\nX-Model: m\r\nX-Folded: a\r\n  b\r\n"
                       b"Connection: close\r\n\r\n")
    assert status_of(raw) == 200
    echoed = {k.lower(): v for k, v in json.loads(raw.partition(b"\r\n\r\n")[2])["headers"]}
    assert echoed["x-folded"] == "a b"


@pytest.mark.parametrize("split", [None, 3], ids=["whole", "split"])
@pytest.mark.parametrize("value", [b"a\x01b", b"a\x7fb", b"a\x00b"], ids=["soh", "del", "nul"])
def test_the_admin_listener_refuses_control_bytes_in_header_values(strict_gateway, value, split):
    # Its heads are parsed by the same plain-head parser: a control byte must still be refused there.
    _, gateway = strict_gateway
    raw = raw_exchange(gateway.admin_port, b"GET /healthz HTTP/1.1\r\nHost: g\r\nX-A: " + value + b"\r\n\r\n",
                       split=split)
    assert status_of(raw) == 400
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["type"] == "invalid_request_error"


def test_the_admin_listener_answers_a_plain_head(strict_gateway):
    _, gateway = strict_gateway
    raw = raw_exchange(gateway.admin_port, b"GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
    assert status_of(raw) == 200
