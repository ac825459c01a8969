"""An admit's reply as the request's ``Admission``: its headers, and when refused, the limit that refused in
words, with ``Retry-After`` from that limit (docs/limits.md). Pure.

Admitted: the ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` of the tightest enforced limit of
each kind that applies (the numbers are the reply's own bytes: no conversion but the reset's duration).
Refused: 429 ``rate_limit_exceeded`` naming the limit (``rule team-a tokens 30000/1m``), ``Retry-After``
when its next slot frees (a request limit), its window ends (a token budget) or one second (an in-flight
cap); a request whose estimate exceeds a whole window can never fit and carries no ``Retry-After``.
A hard USD budget: 429 ``budget_exceeded`` naming the budget and when its period resets (``key spend
$5.00/1d (UTC) exceeded; resets 2026-12-02T00:00:00Z``), ``Retry-After`` until then; a request whose
worst-case cost exceeds the whole budget can never fit and carries no ``Retry-After``.
A managed key the admit found in its tenant's deny set: 401 ``key_blocked`` / ``key_revoked``, the codes and
words of the head gate's refusal (``gateway.keys.answers``), whatever this host's key table still says.
"""

from __future__ import annotations

from gateway.identity.key_status import KEY_BLOCKED, status_refusal
from gateway.identity.limits import LimitRef, usd_text
from gateway.pricing.period import rfc3339
from gateway.quota.admission import (
    H_LIMIT,
    H_LIMIT_REQUESTS,
    H_REMAINING,
    H_REMAINING_REQUESTS,
    H_RESET,
    H_RESET_REQUESTS,
    H_RETRY_AFTER,
    Admission,
    duration_text,
    never_fits_message,
    refusal_message,
)
from gateway.quota.counters import QuotaCounters
from gateway.quota.ledger import (
    F_REFUSED,
    F_RETRY,
    F_RQ_LIMIT,
    F_RQ_REMAINING,
    F_RQ_RESET,
    F_SHADOW,
    F_TK_LIMIT,
    F_TK_REMAINING,
    F_TK_RESET,
    Account,
    AdmitReply,
)

Headers = tuple[tuple[bytes, bytes], ...]
_KEY_REFUSAL_HEADERS: Headers = ((b"www-authenticate", b'Bearer realm="gridgate"'),)
_NO_SHADOW = b"-"
_REASONS = {"tokens": "denied", "requests": "denied_requests", "in_flight": "denied_concurrency"}
BUDGET_EXCEEDED = "budget_exceeded"


def rate_headers(account: Account, fields: list[bytes]) -> Headers:
    """The tightest limit of each kind, as the reply states it."""
    headers: Headers = ()
    if account.has_requests and fields[F_RQ_LIMIT] != b"0":
        headers = ((H_LIMIT_REQUESTS, fields[F_RQ_LIMIT]), (H_REMAINING_REQUESTS, fields[F_RQ_REMAINING]),
                   (H_RESET_REQUESTS, duration_text(int(fields[F_RQ_RESET]))))
    if account.has_budgets and fields[F_TK_LIMIT] != b"0":
        headers += ((H_LIMIT, fields[F_TK_LIMIT]), (H_REMAINING, fields[F_TK_REMAINING]),
                    (H_RESET, duration_text(int(fields[F_TK_RESET]))))
    return headers


def shadow_names(account: Account, fields: list[bytes]) -> tuple[str, ...] | None:
    """The shadow limits that would have refused, in words; None when none would have."""
    shadow = fields[F_SHADOW]
    if shadow == _NO_SHADOW:
        return None
    return tuple(account.limits[int(index) - 1].text for index in shadow.split(b","))


def refused(account: Account, answer: AdmitReply, estimate: int, counters: QuotaCounters, worst: int = 0) -> Admission:
    """The 429 of an admit the ledger refused (``answer.admitted`` False), counted; the 401 of a managed key
    the admit found blocked or revoked."""
    if answer.key_status is not None:
        return key_refused(account, answer.key_status, estimate)
    fields = answer.fields
    index = int(fields[F_REFUSED])
    if not 1 <= index <= len(account.limits):
        raise ValueError(f"an admit refused by limit {index} of {len(account.limits)}")
    ref = account.limits[index - 1]
    retry_ms = int(fields[F_RETRY])
    headers = rate_headers(account, fields)
    shadow = shadow_names(account, fields)
    if shadow is not None:
        counters.shadow_refusals += len(shadow)
    if ref.kind == "spend":
        counters.denied += 1
        counters.denied_budget += 1
        return budget_refused(account, ref, retry_ms, worst, headers, shadow)
    if ref.kind == "in_flight":
        counters.denied_concurrency += 1
    else:
        counters.denied += 1
        if ref.kind == "requests":
            counters.denied_requests += 1
    if retry_ms < 0:  # larger than a whole window of a budget: not retryable
        counters.denied_never_fits += 1
        message = never_fits_message(ref, estimate, int(fields[F_TK_LIMIT]))
        return Admission(False, "denied_never_fits", 429, headers, None, estimate, message=message, shadow=shadow)
    retry_s = max(1, -(-retry_ms // 1000))
    return Admission(False, _REASONS[ref.kind], 429, ((H_RETRY_AFTER, b"%d" % retry_s), *headers), None, estimate,
                     message=refusal_message(ref, retry_s), shadow=shadow,
                     error_type="tokens" if ref.kind == "tokens" else "requests")


def budget_refused(account: Account, ref: LimitRef, retry_ms: int, worst: int, headers: Headers,
                   shadow: tuple[str, ...] | None) -> Admission:
    """The 429 of a hard USD budget: when its period resets, or that the request can never fit."""
    resets = next((window.span.end for window in account.spend if window.budget is ref.limit), 0)
    if retry_ms < 0:
        message = (f"{ref.text} exceeded by this request alone: its worst-case cost {usd_text(worst)} is more than "
                   f"the whole budget; lower max_tokens or shorten the prompt.")
        return Admission(False, BUDGET_EXCEEDED, 429, headers, None, message=message, shadow=shadow,
                         error_type="insufficient_quota", code=BUDGET_EXCEEDED)
    retry_s = max(1, -(-retry_ms // 1000))
    message = f"{ref.text} exceeded; resets {rfc3339(resets)}"
    return Admission(False, BUDGET_EXCEEDED, 429, ((H_RETRY_AFTER, b"%d" % retry_s), *headers), None,
                     message=message, shadow=shadow, error_type="insufficient_quota", code=BUDGET_EXCEEDED)


def key_refused(account: Account, status: bytes, estimate: int) -> Admission:
    """The 401 of a managed key in its tenant's deny set (``status``: ``blocked`` or ``revoked``)."""
    kid = account.key.kid
    code, message = status_refusal(kid, status.decode(errors="replace")) or (KEY_BLOCKED, f"API key {kid} is blocked")
    return Admission(False, code, 401, _KEY_REFUSAL_HEADERS, None, estimate, message=message, error_type=None,
                     code=code)
