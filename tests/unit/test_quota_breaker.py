"""The quota backend breaker's state and the on_backend_error policy's answer (gateway/quota/breaker.py)."""

from __future__ import annotations

import pytest

from gateway.quota.breaker import BackendBreaker, Breaker
from gateway.quota.counters import QuotaCounters
from gateway.quota.ledger import QuotaLedger
from gateway.valkey.resp_transport import RespTransport


def test_consecutive_failures_open_it_and_one_answer_closes_it() -> None:
    breaker = Breaker(failures_to_open=3)
    assert not breaker.failure() and not breaker.failure()
    assert not breaker.success()  # an answer in between starts the count again
    assert not breaker.failure() and not breaker.failure() and not breaker.is_open
    assert breaker.failure() and breaker.is_open  # the third in a row opens it, once
    assert not breaker.failure() and breaker.is_open
    assert breaker.success() and not breaker.is_open
    assert breaker.trip() and breaker.is_open and not breaker.trip()
    with pytest.raises(ValueError):
        Breaker(failures_to_open=0)


def _breaker(policy: str) -> tuple[BackendBreaker, QuotaCounters]:
    counters = QuotaCounters()
    ledger = QuotaLedger(RespTransport(), reservation_timeout_s=1)  # never reached: nothing here probes
    return BackendBreaker(ledger, counters, policy=policy), counters  # type: ignore[arg-type]


def test_reject_answers_503_with_a_retry_hint_and_counts_it() -> None:
    breaker, counters = _breaker("reject")
    answer = breaker.unavailable()
    assert (answer.allowed, answer.status, answer.reason) == (False, 503, "backend_error_rejected")
    assert dict(answer.headers)[b"retry-after"] == b"1"
    assert answer.error is not None and answer.error[2] == "quota_unavailable"
    assert (counters.backend_error_rejected, counters.backend_error_allowed) == (1, 0)


def test_allow_admits_unmetered_and_counts_it() -> None:
    breaker, counters = _breaker("allow")
    answer = breaker.unavailable()
    assert (answer.allowed, answer.reason, answer.reservation, answer.metered) == (
        True, "backend_error_allowed", None, False)
    assert (counters.backend_error_rejected, counters.backend_error_allowed) == (0, 1)


def test_an_unknown_policy_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="quota.on_backend_error"):
        _breaker("maybe")
