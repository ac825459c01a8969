"""Sans-IO attempt bookkeeping inside one provider, and quota settlement."""

from __future__ import annotations

import pytest

from gateway.request.attempts import Next, ProviderAttempts, Settlement, settlement_for
from gateway.request.failures import Failure


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


@pytest.mark.parametrize(("status", "tokens", "gone", "expected"), [
    (200, 42, False, Settlement.CHARGE_USAGE),
    (200, None, False, Settlement.CHARGE_ESTIMATE),  # no usage reported
    (200, 42, True, Settlement.CHARGE_ESTIMATE),  # the client left: the usage seen may be partial
    (503, 42, False, Settlement.CHARGE_ESTIMATE),
    (400, None, False, Settlement.CHARGE_ESTIMATE),
])
def test_settlement_of_a_started_response(status, tokens, gone, expected):
    assert settlement_for(status, tokens, gone) == expected
