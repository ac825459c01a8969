"""An admit's reply as the request's Admission (gateway/quota/verdict.py, ledger.read): which limit a 429 names,
its Retry-After, the rate-limit headers, shadow limits, and replies the script cannot have written."""

from __future__ import annotations

import pytest

from gateway.identity.auth import KeyIdentity
from gateway.identity.limits import Budget, Limits, RequestLimit
from gateway.quota.counters import QuotaCounters
from gateway.quota.ledger import AdmitCommand, QuotaLedger
from gateway.quota.rules import QuotaRule
from gateway.quota.verdict import rate_headers, refused, shadow_names
from gateway.valkey.transport import UnexpectedReply


class Transport:
    def use_script(self, script: object) -> None:  # the ledger hands its script; nothing runs
        pass

    def template(self, args: object) -> object:
        return args

    def fill(self, template: object, values: object) -> object:
        return template


RULE = QuotaRule("team-a", (Budget(60, 30000),), 16, requests=(RequestLimit(60, 1200, 1200),), max_in_flight=4)
KEY = KeyIdentity("t", "ci", None, Limits(requests=(RequestLimit(60, 60, 60), RequestLimit(86400, 9, 9, shadow=True))))


def command(estimate: int = 100) -> AdmitCommand:
    ledger = QuotaLedger(Transport(), reservation_timeout_s=10)  # type: ignore[arg-type]
    account = ledger.account("t", RULE, KEY)
    assert account is not None
    # key: requests 60/1m (1), requests 9/1d shadow (2); rule: requests 1200/1m (3), tokens 30000/1m (4), in-flight (5)
    assert [ref.text for ref in account.limits] == [
        "key requests 60/1m", "key requests 9/1d", "rule team-a requests 1200/1m", "rule team-a tokens 30000/1m",
        "rule team-a in-flight 4"]
    return ledger.admit_command(account, estimate, b"id")


def test_an_admitted_reply_carries_the_tightest_limit_of_each_kind_as_the_script_wrote_it() -> None:
    cmd = command()
    answer = QuotaLedger.read(cmd, b"1 1700000000000 0 0 0 60 41 19500 30000 29900 12250 2 -1 id|100|1|a:ci:w:60:1||")
    assert answer.admitted and answer.reservation is not None
    assert answer.reservation.member == b"id|100|1|a:ci:w:60:1||"
    assert rate_headers(cmd.account, answer.fields) == (
        (b"x-ratelimit-limit-requests", b"60"), (b"x-ratelimit-remaining-requests", b"41"),
        (b"x-ratelimit-reset-requests", b"19.5s"),
        (b"x-ratelimit-limit-tokens", b"30000"), (b"x-ratelimit-remaining-tokens", b"29900"),
        (b"x-ratelimit-reset-tokens", b"12.25s"))
    assert shadow_names(cmd.account, answer.fields) == ("key requests 9/1d",)


@pytest.mark.parametrize(("reply", "reason", "names", "retry", "kind"), [
    (b"0 1 0 1 11500 60 0 11500 30000 29900 5000 -", "denied_requests", "key requests 60/1m", b"12", "requests"),
    (b"0 1 0 4 5000 60 41 100 30000 20 5000 -", "denied", "rule team-a tokens 30000/1m", b"5", "tokens"),
    (b"0 1 0 5 1000 60 41 100 30000 29900 5000 -", "denied_concurrency", "rule team-a in-flight 4", b"1", "requests"),
    (b"0 1 0 3 1 60 41 100 30000 29900 5000 -", "denied_requests", "rule team-a requests 1200/1m", b"1", "requests"),
])
def test_a_refusal_names_its_limit_and_retries_when_that_limit_frees(reply: bytes, reason: str, names: str,
                                                                     retry: bytes, kind: str) -> None:
    cmd = command()
    counters = QuotaCounters()
    admission = refused(cmd.account, QuotaLedger.read(cmd, reply), 100, counters)
    assert (admission.allowed, admission.status, admission.reason) == (False, 429, reason)
    message, error_type, code = admission.error  # type: ignore[misc]
    assert names in message and (error_type, code) == (kind, "rate_limit_exceeded")
    assert dict(admission.headers)[b"retry-after"] == retry  # rounded up, at least one second
    assert counters.denied + counters.denied_concurrency == 1


def test_a_request_larger_than_a_whole_window_is_not_retryable() -> None:
    cmd = command(40000)
    admission = refused(cmd.account, QuotaLedger.read(cmd, b"0 1 0 4 -1 60 41 100 30000 30000 5000 -"), 40000,
                        QuotaCounters())
    assert admission.reason == "denied_never_fits" and b"retry-after" not in dict(admission.headers)
    assert "never be admitted" in admission.message and "30000 tokens per 1m" in admission.message  # type: ignore[operator]


@pytest.mark.parametrize("reply", [
    b"garbage", b"1 2 3", b"2 1 0 0 0 0 0 0 0 0 0 - m", b"0 1 0 9 1000 0 0 0 0 0 0 -", b"0 1 0 0 1000 0 0 0 0 0 0 -",
    b"0 1 0 x 1000 0 0 0 0 0 0 -", b"",
])
def test_a_reply_the_script_cannot_have_written_is_refused_as_such(reply: bytes) -> None:
    cmd = command()
    with pytest.raises(ValueError):
        answer = QuotaLedger.read(cmd, reply)
        refused(cmd.account, answer, 100, QuotaCounters())
    assert issubclass(UnexpectedReply, ValueError)


MANAGED = KeyIdentity("t", None, "kabcdefgh123", Limits(requests=(RequestLimit(60, 60, 60),)))


@pytest.mark.parametrize(("status", "code", "words"), [(b"blocked", "key_blocked", "is blocked"),
                                                        (b"revoked", "key_revoked", "was revoked")])
def test_a_deny_set_reply_is_the_head_gates_401_and_counts_no_limit(status: bytes, code: str, words: str) -> None:
    ledger = QuotaLedger(Transport(), reservation_timeout_s=10)  # type: ignore[arg-type]
    account = ledger.account("t", RULE, MANAGED)
    assert account is not None and account.managed
    cmd = ledger.admit_command(account, 100, b"id")
    answer = QuotaLedger.read(cmd, b"D 1700000000000 " + status)
    assert not answer.admitted and answer.reservation is None and answer.key_status == status
    counters = QuotaCounters()
    admission = refused(account, answer, 100, counters)
    assert (admission.allowed, admission.status, admission.reason) == (False, 401, code)
    assert admission.error == (f"API key kabcdefgh123 {words}", None, code)
    assert admission.headers == ((b"www-authenticate", b'Bearer realm="gridgate"'),)
    assert counters.denied == counters.denied_requests == counters.denied_concurrency == 0


@pytest.mark.parametrize("reply", [b"D 1700000000000 active", b"D 1700000000000", b"D 1 blocked extra"])
def test_a_deny_reply_the_script_cannot_have_written_is_a_backend_error(reply: bytes) -> None:
    with pytest.raises(UnexpectedReply):
        QuotaLedger.read(command(), reply)
