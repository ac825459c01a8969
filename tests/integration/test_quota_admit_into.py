"""``QuotaGate.admit_into`` (the proxy's admit step, a worker-held block's take written out) decides every request
as ``QuotaGate.admission`` does: the same verdicts, headers, block state and counters, through a block's life
(open, full, closed, the next one), against the real bundled Valkey, in-process (docs/limits.md)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gateway.identity.limits import Budget, RequestLimit
from gateway.quota.admission import Admission
from gateway.quota.gate import QuotaGate
from gateway.quota.lease import LeaseSpec
from tests.integration.test_limits_ledger import DAY, new_tenant, open_gate, rule
from tests.integration.test_quota_ledger import LONG


def _verdict(admission: Any) -> tuple:
    """What a request's answer and its settlement depend on (the reset headers aside: they count whole seconds
    from each block's own grant)."""
    if admission is None:
        return (None,)
    if admission.__class__ is not Admission:
        return ("awaits the ledger",)
    shown = tuple(pair for pair in admission.headers if not pair[0].startswith(b"x-ratelimit-reset"))
    return (admission.allowed, admission.reason, shown, admission.estimate, admission.lease is not None,
            admission.metered, admission.worst_nusd, admission.shadow)


def _state(gate: QuotaGate) -> tuple:
    counters = gate.counters
    blocks = sorted((lease.taken, lease.in_flight, lease.closed, lease.tokens.committed, lease.slots.committed,
                     lease.last_estimate) for lease in gate._open_leases.values())  # type: ignore[union-attr]
    return (counters.admitted, counters.leased, counters.tokens_estimated, counters.leases_granted, blocks)


def test_admit_into_decides_each_request_of_a_block_as_admission_does(valkey_url: str) -> None:
    plain, fused = new_tenant(), new_tenant()

    def rules(tenant: str) -> list:
        return [rule(tenant, requests=[RequestLimit(DAY, 10_000, 10_000)], budgets=[Budget(LONG, 1_000_000)])]

    async def scenario() -> None:
        spec = LeaseSpec(ttl_s=30, headroom=2, tokens=400, requests=6)
        async with open_gate(valkey_url, rules(plain), lease=spec) as by_admission, \
                open_gate(valkey_url, rules(fused), lease=spec) as by_admit_into:
            for gate, tenant in ((by_admission, plain), (by_admit_into, fused)):
                first = await gate.admission(tenant, "m", 40, 16)  # type: ignore[misc]
                gate.settle(first, 20)
                while gate.counters.leases_granted < 1:
                    await asyncio.sleep(0.005)
            # Sizes that fit, one larger than the block's tokens (to the ledger, the block stays open), the
            # slots running out (the block closes: the rest go to the ledger), and a body of a default allowance.
            requests = [(40, 16), (0, 1), (400, 399), (4, 16), (8, 100), (12, None), (0, 16), (0, 16), (0, 16)]
            for body_len, allowance in requests:
                record = SimpleNamespace(admission=None)
                verdict = by_admit_into.admit_into(record, fused, "m", body_len, allowance)
                if verdict is None and record.admission is not None:
                    verdict = record.admission
                else:
                    assert record.admission is None  # only a block's admission is set on the record
                expected = by_admission.admission(plain, "m", body_len, allowance)
                assert _verdict(verdict) == _verdict(expected), (body_len, allowance)
                assert _state(by_admit_into)[:3] == _state(by_admission)[:3]
                assert _state(by_admit_into)[4] == _state(by_admission)[4]
                for gate, admission in ((by_admit_into, verdict), (by_admission, expected)):
                    if admission.__class__ is not Admission:
                        admission = await admission  # type: ignore[misc]
                    gate.settle(admission, 10)  # type: ignore[arg-type]
            # Unmetered (no rule matches the tenant): None from both, nothing set, counted alike.
            record = SimpleNamespace(admission=None)
            assert by_admit_into.admit_into(record, "nobody", "m", 0, 1) is None and record.admission is None
            assert by_admission.admission("nobody", "m", 0, 1) is None
            assert by_admit_into.counters.unmetered == by_admission.counters.unmetered == 1

    asyncio.run(scenario())
