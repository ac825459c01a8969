"""Request-path checks written out where their input is met, beside the general function they stand for
(one call fewer per request): each decides as that function does, over many cases."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace
from typing import Any

from gateway.http.errors import ErrorReply
from gateway.quota.admission import Admission
from gateway.request.capability import BodyFields, CapabilityRequest, session_key
from gateway.request.estimate import MAX_ALLOWANCE
from gateway.request.headers import HeaderPlan
from workers.proxy import Flow, Proxy
from workers.request_record import RequestRecord

_COUNTS: tuple[Any, ...] = (None, 0, 1, 16, 4096, -1, -(2**63), MAX_ALLOWANCE - 1, MAX_ALLOWANCE, MAX_ALLOWANCE + 1,
                            2**64, True, False, 1.5, "16")


def _session_values() -> list[bytes]:
    rng = random.Random(11)
    values = [b"", b" ", b"\t", b"s", b" s ", b"\ts\t", b"a b", b"s\x7f", b"s\x00", b"\xff", b"x" * 256, b" " + b"x" * 256,
              b"x" * 257, b"session-12", b"\"quoted\"", b" \t x \t "]
    alphabet = b" \t!~azAZ09\x7f\x80\x1f\xff"
    for _ in range(2000):
        size = rng.choice((0, 1, 2, 5, 40, 255, 256, 257, 258))
        values.append(bytes(rng.choice(alphabet) for _ in range(size)))
    return values


def test_the_scan_reads_the_session_header_as_session_key_does() -> None:
    plan = HeaderPlan("x-model", session_header="X-Session-Id")
    values = _session_values()
    for value in values:
        assert plan.scan([(b"x-session-id", value)]).session == session_key(value), value
    rng = random.Random(5)
    for _ in range(500):  # sent twice: the last one counts, as it did when the raw value was kept
        first, last = rng.choice(values), rng.choice(values)
        found = plan.scan([(b"x-session-id", first), (b"x-session-id", last)])
        assert found.session == session_key(last)
        assert found.forward == [(b"x-session-id", first), (b"x-session-id", last)]  # forwarded as they came


class _Quota:
    """Records the allowance the quota step passes, and refuses (the request ends there)."""

    def __init__(self) -> None:
        self.allowances: list[int | None] = []

    def admission(self, tenant: str, model: str | None, body_len: int, allowance: int | None,
                  key: object) -> Admission:
        self.allowances.append(allowance)
        return Admission(False, "denied", 429, ())

    def admit_into(self, record: object, tenant: str, model: str | None, body_len: int, allowance: int | None,
                   key: object) -> Admission:
        return self.admission(tenant, model, body_len, allowance, key)


def _allowance_passed(fields: BodyFields) -> int | None:
    """The allowance ``Proxy.admit`` (the quota step) passes for a body with these fields."""
    proxy = object.__new__(Proxy)
    quota = proxy.quota = _Quota()  # type: ignore[assignment]
    route = SimpleNamespace(kind=99, surface=SimpleNamespace(metered=True), barred=frozenset())
    admitted = SimpleNamespace(request_id=b"r", tenant="t", route=route, managed=None, key=None)
    flow = Flow(RequestRecord(), SimpleNamespace(body=b"{}"), admitted, None)  # type: ignore[arg-type]
    flow.request = CapabilityRequest("inference_model", "m", fields)
    verdict = proxy.admit(flow)
    assert type(verdict) is ErrorReply and verdict.status == 429  # the stand-in refuses: the request ends
    (allowance,) = quota.allowances
    return allowance


def test_the_proxy_passes_the_completion_allowance_the_body_fields_name() -> None:
    for max_tokens, max_completion_tokens, max_output_tokens in itertools.product(_COUNTS, repeat=3):
        fields = BodyFields(max_tokens=max_tokens, max_completion_tokens=max_completion_tokens,
                            max_output_tokens=max_output_tokens)
        assert _allowance_passed(fields) == fields.completion_allowance, fields
