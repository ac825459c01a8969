"""``Outcomes.close`` writes out the end of a metered request that one attempt served with a usage whose
counts are known to be counts (``request_cost.CHECKED_OBSERVERS``): pricing without checking them again,
and settling without ``attempts_cost`` and ``_charge``. It must leave what the general path leaves, over
every case: the record the access line reads, the quota's counters, blocks and settlements, the tenant
tokens, the unpriced counts, the spend rollups and the metrics row. The general path is taken by handing
the same counts in an observer of another class (as gateway/request/usage_surfaces.py's are), which the
fast path does not trust.

And what lets it trust them: whatever bytes a provider sends, a ``UsageScanner``'s and an
``SseUsageFilter``'s counts are each None or a plain int >= 0."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import Cooling, PriceOverride, Pricing
from gateway.identity.auth import KeyIdentity
from gateway.metrics.catalogue import COUNTERS
from gateway.metrics.writer import WorkerMetrics
from gateway.pricing.table import shipped_table
from gateway.quota.admission import Admission
from gateway.quota.gate import QuotaGate
from gateway.quota.lease import Allowance, Lease, LeaseSpec, SpendAllowance, request_allowance
from gateway.quota.ledger import Reservation
from gateway.request.attempts import AttemptResult
from gateway.request.usage import SseUsageFilter, UsageScanner
from gateway.spend.alerts import install_outbox
from gateway.spend.price_book import PriceBook
from workers import spend_tracker
from workers.outcomes import Outcomes
from workers.request_cost import CHECKED_OBSERVERS
from workers.request_record import RequestRecord
from workers.spend_tracker import SpendTracker

NOW = 1_780_000_000.5
FIELDS = ("total_tokens", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_write_tokens",
          "reasoning_tokens")


class SurfaceUsage:
    """An observer the fast path does not trust (its counts are checked): the general path's usage."""

    def __init__(self, **counts: Any) -> None:
        for name in FIELDS:
            setattr(self, name, counts.get(name))


def scanner(counts: dict[str, int | None]) -> UsageScanner:
    """A ``UsageScanner`` that read ``counts`` from a provider's JSON answer, as the relay's does."""
    usage: dict[str, Any] = {name: counts[name] for name in ("total_tokens", "prompt_tokens", "completion_tokens")
                             if counts[name] is not None}
    if counts["cached_tokens"] is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": counts["cached_tokens"]}
    if counts["reasoning_tokens"] is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": counts["reasoning_tokens"]}
    observer = UsageScanner()
    observer.feed(json.dumps({"id": "c", "choices": [], "usage": usage}).encode())
    observer.flush()
    return observer


def sse_filter(counts: dict[str, int | None]) -> SseUsageFilter:
    """An ``SseUsageFilter`` that read ``counts`` from the usage-only chunk of a stream."""
    usage: dict[str, Any] = {name: counts[name] for name in ("total_tokens", "prompt_tokens", "completion_tokens")}
    usage["prompt_tokens_details"] = {"cached_tokens": counts["cached_tokens"]}
    usage["completion_tokens_details"] = {"reasoning_tokens": counts["reasoning_tokens"]}
    observer = SseUsageFilter()
    observer.feed(b'data: {"choices": [{"delta": {}}], "usage": null}\n\n')
    observer.feed(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
    observer.flush()
    return observer


class QuietOutcomes(Outcomes):
    """Without cooling (a 429 or 503 cools its provider in every worker: not what is compared here)."""

    __slots__ = ()

    def observe(self, provider: int, cluster: str, endpoint: Any, result: AttemptResult) -> None:
        pass


class World:
    """One worker's end of the request path: quota gate (a block, or exact reservations), prices, spend."""

    def __init__(self, case: dict[str, Any]) -> None:
        overrides = {"priced": PriceOverride(input="2.50", output="10.00", cached_input="1.25", reasoning="20")}
        self.prices = PriceBook.from_config(Pricing(overrides=overrides, unpriced=case["unpriced"]), shipped_table())
        self.gate = QuotaGate(SimpleNamespace(reservation_timeout_s=30.0), [], lease=LeaseSpec(1.0, 2),
                              prices=self.prices, tenants=["acme"])
        self.spend = SpendTracker(self.prices, None, case["store"])
        self.row = [0] * COUNTERS
        metrics = WorkerMetrics(self.row, ["c"], ["acme"])
        access_log = SimpleNamespace(record=lambda record: None)
        self.outcomes = QuietOutcomes(self.gate, metrics, access_log, None, Cooling(), True,  # type: ignore[arg-type]
                                      self.prices, self.spend)
        self.reservation = Reservation(b"z", b"p", b"block", 10_000, 100)
        self.lease = None
        if case["lease"]:
            tokens = Allowance(10**9, 10**12, 0, 0.0) if case["lease_tokens"] else None
            slots = request_allowance(1_000, 50_000, 0, 0.0) if case["lease_slots"] else None
            spend = SpendAllowance(10**12, 0) if case["lease_spend"] else None
            self.lease = Lease(self.reservation, tokens, 10**9, 0, slots=slots, spend=spend)
            self.lease.in_flight = 1 if case["last_in_flight"] else 3
            self.lease.closed = case["lease_closed"]
            self.gate._leases._held.add(self.lease)  # type: ignore[union-attr]

    def close(self, case: dict[str, Any], usage: Any) -> RequestRecord:
        result = AttemptResult(status=case["status"], started=True, usage=usage, first_byte_s=0.01, duration_s=0.2,
                               client_left=case["client_left"])
        relay = SimpleNamespace(result=lambda: result)
        identity = KeyIdentity("acme", "ops")
        exchange = SimpleNamespace(admitted=SimpleNamespace(key=identity), client_gone=False)
        reservation = None if self.lease is not None else Reservation(b"z", b"p", b"one", case["estimate"])
        admission = Admission(True, "admitted", None, (), reservation, case["estimate"], 0, None, self.lease, True,
                              worst_nusd=case["worst"])
        record = RequestRecord(exchange=exchange, tenant="acme", capability=case["model"], admission=admission,
                               route=SimpleNamespace(cluster="c", provider=0), attempt=relay, owed=case["owed"],
                               reached=case["owed"] > 0, overhead_s=0.001, served_model=case["served_model"])
        self.outcomes.close(record)
        record.admission = admission  # what settling left of it (the record lets go of it as it closes)
        return record

    def state(self, record: RequestRecord) -> dict[str, Any]:
        gate = self.gate
        lease = self.lease
        admission = record.admission
        return {
            "record": {name: getattr(record, name) for name in ("status", "error", "provider", "cost_nusd",
                                                               "tokens_prompt", "tokens_completion", "tokens_cached",
                                                               "tokens_reasoning")},
            "admission": (admission.lease is None, admission.reservation is None),  # type: ignore[union-attr]
            "counters": gate.counters.snapshot(),
            "tenant_tokens": gate.tenant_tokens.snapshot(),
            "settlements": list(gate._reconciler._pending),
            "lease": None if lease is None else (
                lease.in_flight, lease.tokens_charged, lease.slots_unused, lease.spend_charged, lease in gate._leases._held),  # type: ignore[union-attr]
            "unpriced": asdict(self.prices.counts),
            "rollups": dict(self.spend.batch.cells),
            "dropped": self.spend.cells_dropped,
            "row": list(self.row),
        }


COUNTS = (None, 0, 7, 120, 3_000, 250_000)
CASES = {
    "model": ("priced", "demo-unpriced", "gpt-4o", "gpt-4o-2099-01-01"),
    "served_model": (None, "priced"),
    "unpriced": ("zero", "estimate"),
    "status": (200, 200, 400, 429, 500, 503),
    "client_left": (False, False, True),
    "owed": (0, 0, 0, 40),
    "estimate": (1, 36, 500, 400_000),
    "worst": (0, 0, 1, 5_000, 10**9),  # 1 and 5_000: a priced usage past ABSURD_FACTOR times it is clamped
    "lease": (True, True, False),
    "lease_tokens": (True, False),
    "lease_slots": (True, False),
    "lease_spend": (False, True),
    "lease_closed": (False, True),
    "last_in_flight": (True, False),
    "store": ("redis://127.0.0.1:1", None),
}


def cases(count: int) -> list[dict[str, Any]]:
    pick = random.Random(20260601)
    return [{name: pick.choice(values) for name, values in CASES.items()} for _ in range(count)]


def usages(pick: random.Random) -> dict[str, int | None]:
    shape = pick.random()
    counts: dict[str, int | None] = {name: pick.choice(COUNTS) for name in FIELDS}
    counts["cache_write_tokens"] = None  # never reported in these shapes
    if shape < 0.5:  # as providers report it: both sides and their total
        prompt, completion = pick.choice(COUNTS[1:]), pick.choice(COUNTS[1:])
        counts.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)  # type: ignore[operator]
    elif shape < 0.6:  # a total only
        counts.update(prompt_tokens=None, completion_tokens=None, total_tokens=pick.choice(COUNTS[1:]))
    return counts


@pytest.mark.parametrize("observer", [scanner, sse_filter])
def test_the_fast_path_leaves_what_the_general_path_leaves(monkeypatch: pytest.MonkeyPatch, observer: Any) -> None:
    monkeypatch.setattr(spend_tracker, "_time", lambda: NOW)
    pick = random.Random(7)
    taken = 0
    try:
        for case in cases(3_000):
            counts = usages(pick)
            if observer is sse_filter and counts["total_tokens"] is None:
                counts["total_tokens"] = 0  # the usage-only chunk of a stream carries its total
            fast_world, general_world = World(case), World(case)
            trusted = observer(counts)
            assert trusted.__class__ in CHECKED_OBSERVERS
            plain = SurfaceUsage(**{name: getattr(trusted, name) for name in FIELDS})
            assert vars(plain) == {name: counts[name] for name in FIELDS}  # the observer read them all
            for _ in range(2):  # a block's second request, and the model's price memoised
                fast = fast_world.close(case, observer(counts))
                general = general_world.close(case, SurfaceUsage(**counts))
                assert fast_world.state(fast) == general_world.state(general), case
            taken += case["owed"] == 0 and counts["total_tokens"] is not None
        assert taken > 1_000  # most cases went the fast way (the rest: both went the general one)
    finally:
        install_outbox(None)


def test_clamping_and_unpriced_counts_are_those_of_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases the random ones may miss, by hand: a priced usage past ten times its worst case, an
    unpriced model (counted once per request, memoised or not), a usage of zero tokens."""
    monkeypatch.setattr(spend_tracker, "_time", lambda: NOW)
    base = dict(cases(1)[0], owed=0, status=200, client_left=False, lease=True, lease_tokens=True, lease_slots=True,
                lease_spend=True, lease_closed=True, last_in_flight=False, served_model=None, unpriced="zero")
    both = dict.fromkeys(FIELDS)
    shapes = [dict(both, prompt_tokens=100_000, completion_tokens=50_000, total_tokens=150_000),
              dict(both, total_tokens=0, prompt_tokens=0, completion_tokens=0), dict(both, total_tokens=9)]
    try:
        for model, worst, counts in itertools.product(("priced", "demo-unpriced"), (0, 1, 10**9), shapes):
            case = dict(base, model=model, worst=worst)
            fast_world, general_world = World(case), World(case)
            for _ in range(3):
                fast = fast_world.close(case, scanner(counts))
                general = general_world.close(case, SurfaceUsage(**counts))
                assert fast_world.state(fast) == general_world.state(general), case
            if model == "priced" and worst == 1 and counts["total_tokens"]:
                assert fast_world.gate.counters.spend_usage_clamped == 3 and fast.cost_nusd == 1
            if model == "demo-unpriced":
                assert fast_world.prices.counts.zero == 3 and fast.cost_nusd == 0
    finally:
        install_outbox(None)


def _check_counts(observer: Any) -> None:
    for name in FIELDS:
        value = getattr(observer, name)
        assert value is None or (value.__class__ is int and value >= 0), (name, value)


NASTY = (b"-5", b"1.5", b"1e3", b"true", b'"12"', b"null", b"12345678901234567890123", b"\xd9\xa3", b"[]", b"{}", b"7")


def test_checked_observers_only_ever_hold_counts() -> None:
    """Whatever a provider sends (numbers of every JSON shape in every usage field, cut anywhere), the
    counts ``CHECKED_OBSERVERS`` hold are None or plain ints >= 0: ``PriceBook.usage_cost`` need not
    check them."""
    pick = random.Random(11)
    names = (b"total_tokens", b"prompt_tokens", b"completion_tokens", b"cached_tokens", b"reasoning_tokens")
    for _ in range(3_000):
        members = b", ".join(b'"%s": %s' % (pick.choice(names), pick.choice(NASTY)) for _ in range(pick.randint(1, 5)))
        details = b'"prompt_tokens_details": {"cached_tokens": %s}' % pick.choice(NASTY)
        usage = b"{%s, %s}" % (members, details) if pick.random() < 0.5 else b"{%s}" % members
        document = b'{"choices": [], "usage": %s}' % usage
        for data in (document, b"data: " + document + b"\n\n" + b"data: [DONE]\n\n"):
            for observer in (UsageScanner(), SseUsageFilter()):
                cut = sorted(pick.sample(range(len(data)), min(3, len(data))))
                for start, end in itertools.pairwise([0, *cut, len(data)]):
                    if end > start:
                        observer.feed(data[start:end])
                observer.flush()
                _check_counts(observer)
                whole = type(observer)()
                whole.feed(data)
                whole.flush()
                _check_counts(whole)


def test_settle_counts_what_count_settled_and_tenant_tokens_add_count() -> None:
    """``QuotaGate.settle`` writes out ``QuotaCounters.count_settled`` and, for a usage with both sides,
    ``TenantTokens.add``: the counters are those the two calls leave, over every kind of settlement."""
    from gateway.quota.counters import QuotaCounters, TenantTokens

    pick = random.Random(3)
    gate = World(dict(cases(1)[0], unpriced="zero", store=None, lease=False)).gate
    counters, tenant_tokens = QuotaCounters(), TenantTokens(["acme"])
    for _ in range(5_000):
        estimate = pick.choice((0, 1, 36, 900))
        actual = pick.choice((None, -3, 0, 1, 36, 900, 5_000))
        prompt, completion = pick.choice((None, 0, 12)), pick.choice((None, 0, 30))
        reached = pick.random() < 0.8
        slot = pick.choice((0, 1))
        lease = Lease(Reservation(b"z", b"p", b"b", 10_000), Allowance(10**6, 10**6, 0, 0.0), 10**9, slot)
        lease.in_flight = 2
        admission = Admission(True, "admitted", None, (), None, estimate, slot, None, lease, True)
        gate.settle(admission, actual, prompt, completion, reached=reached, cost_nusd=None)
        charged = estimate if actual is None else max(actual, 0)
        counters.count_settled(estimate, charged)
        if prompt is not None or completion is not None:
            tenant_tokens.add(slot, prompt, completion, actual)
        assert gate.counters == counters
        assert gate.tenant_tokens.snapshot() == tenant_tokens.snapshot()
        assert lease.in_flight == 1 and lease.tokens_charged == charged - estimate
    install_outbox(None)
