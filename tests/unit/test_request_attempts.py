"""Sans-IO attempt bookkeeping inside one provider, and what each attempt costs the quota."""

from __future__ import annotations

import pytest

from gateway.request.attempts import (
    AttemptResult,
    Next,
    ProviderAttempts,
    attempt_tokens,
    served_floor,
    served_tokens,
    unanswered_tokens,
    usage_split,
)
from gateway.request.failures import Failure
from gateway.request.usage import UsageScanner


def test_connect_failures_move_to_other_endpoints_then_stop_with_502_naming_the_provider():
    attempts: ProviderAttempts[str] = ProviderAttempts("provider-a", max_attempts=2)
    assert attempts.excluded is None  # nothing allocated until something fails
    assert attempts.connect_failed("e1", Failure.REFUSED, "connection refused") == Next.OTHER_ENDPOINT
    assert attempts.connect_failed("e2", Failure.REFUSED, "connection refused") == Next.STOP
    assert attempts.excluded == ["e1", "e2"] and not attempts.reached
    reply = attempts.error_reply()
    assert (reply.status, reply.code, reply.message) == (502, "upstream_unavailable", "provider-a: connection refused")


def test_stale_pooled_connection_gets_one_fresh_retry_on_the_same_pick():
    attempts: ProviderAttempts[str] = ProviderAttempts("p")
    attempts.sent()
    assert attempts.failed_before_head("e1", Failure.RESET, "connection lost", reused=True) == Next.FRESH_CONNECTION
    assert attempts.fresh and attempts.excluded is None
    attempts.sent()
    assert attempts.failed_before_head("e1", Failure.RESET, "connection lost", reused=False) == Next.OTHER_ENDPOINT
    assert attempts.excluded == ["e1"] and not attempts.fresh


def test_read_timeout_after_sending_is_never_retried_and_is_504():
    attempts: ProviderAttempts[str] = ProviderAttempts("p")
    attempts.sent()
    assert attempts.failed_before_head("e1", Failure.TIMEOUT, "no response bytes for 1s", reused=True) == Next.STOP
    reply = attempts.error_reply()
    assert (reply.status, reply.code) == (504, "upstream_timeout")


def test_busy_everywhere_without_reaching_anyone_is_503_with_retry_after():
    attempts: ProviderAttempts[str] = ProviderAttempts("p", max_attempts=1)
    assert attempts.pool_busy("e1") == Next.STOP
    reply = attempts.error_reply()
    assert reply.status == 503 and (b"retry-after", b"1") in reply.headers


def test_malformed_response_is_502_bad_upstream_response():
    attempts: ProviderAttempts[str] = ProviderAttempts("p", max_attempts=1)
    attempts.sent()
    attempts.failed_before_head("e1", Failure.MALFORMED, "malformed response", reused=False)
    assert attempts.error_reply().code == "bad_upstream_response"


ESTIMATE = 521


@pytest.mark.parametrize(("status", "usage", "floor", "expected"), [
    (200, 42, 0, 42),  # a response that reports usage is charged that usage
    (200, 42, 9000, 42),  # ... even when the client left after it arrived (the floor is for no usage)
    (503, 42, 0, 42),  # ... whatever its status
    (429, 7, 0, 7),
    (400, None, 0, 0),  # a provider 4xx without usage did no billable work
    (429, None, 0, 0),
    (404, None, 300, 0),
    (500, None, 0, ESTIMATE),  # a 5xx without usage may have worked
    (503, None, 0, ESTIMATE),
    (0, None, 0, ESTIMATE),  # no response head (a timeout, a lost connection)
    (200, None, 0, ESTIMATE),  # a 2xx without usage
    (200, None, 1900, 1900),  # a client that hung up after 1,800 tokens were relayed pays for those
    (200, None, 100, ESTIMATE),  # ... and at least the estimate
])
def test_what_one_attempt_costs(status, usage, floor, expected):
    assert attempt_tokens(status, usage, ESTIMATE, floor) == expected


@pytest.mark.parametrize(("failure", "reused", "expected"), [
    (Failure.RESET, True, 0),  # a pooled connection the provider had closed: it never took the request
    (Failure.RESET, False, ESTIMATE),
    (Failure.TIMEOUT, True, ESTIMATE),
    (Failure.TIMEOUT, False, ESTIMATE),
    (Failure.MALFORMED, True, ESTIMATE),
])
def test_what_an_attempt_without_a_response_head_costs(failure, reused, expected):
    assert unanswered_tokens(failure, reused, ESTIMATE) == expected


def test_a_request_that_failed_over_pays_for_each_attempt_by_the_same_rules():
    # Issue 21 item 7: three providers answering 429 cost 521 tokens; a 429 costs nothing.
    assert sum(attempt_tokens(429, None, ESTIMATE) for _ in range(3)) == 0
    # A 503 (may have worked), then a stale pooled connection, then a 200 reporting 40 tokens.
    owed = attempt_tokens(503, None, ESTIMATE) + unanswered_tokens(Failure.RESET, True, ESTIMATE)
    assert owed + attempt_tokens(200, 40, ESTIMATE) == ESTIMATE + 40


# -- the attempt that served the request --------------------------------------------------------------

def test_a_hang_up_of_an_event_stream_pays_one_token_per_data_event_relayed():
    # 500 events of some 200 bytes each reached the client, no usage: the prompt (100 bytes: 25) + 500,
    # not the 25,000 tokens the bytes would make at four bytes a token.
    cut = AttemptResult(status=200, started=True, client_left=True, events=500)
    assert served_floor(100, 100_000, 500) == 525
    assert served_tokens(cut, estimate=1_024, body_len=100, bytes_out=100_000) == 1_024  # the estimate is more
    assert served_tokens(cut, estimate=300, body_len=100, bytes_out=100_000) == 525


def test_a_hang_up_of_any_other_body_pays_four_bytes_a_token():
    cut = AttemptResult(status=200, started=True, client_left=True)  # not an event stream: no events counted
    assert served_tokens(cut, estimate=300, body_len=100, bytes_out=8_000) == 25 + 2_000


def test_a_served_attempt_with_usage_pays_its_usage_and_a_4xx_without_usage_nothing():
    assert served_tokens(AttemptResult(status=500, started=True, usage=UsageScanner(total_tokens=42), events=9), 300, 100, 10) == 42
    assert served_tokens(AttemptResult(status=404, started=True), 300, 100, 10_000) == 0


@pytest.mark.parametrize(("total", "prompt", "completion", "expected"), [
    (30, 20, 10, (20, 10)),
    (30, 20, None, (20, 10)),
    (30, None, 12, (18, 12)),
    (30, None, None, (None, None)),
    (5, 20, None, (20, 0)),
])
def test_the_tenant_s_tokens_in_and_out_of_a_usage(total, prompt, completion, expected):
    assert usage_split(total, prompt, completion) == expected
