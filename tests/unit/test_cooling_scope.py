"""Cooling at the right scope (docs/routing.md, "Cooling"): which answers speak for the whole provider,
and endpoint cooling shared by the workers of a host through a real shared-memory segment. Two
``ProviderStates`` over one segment play two workers; the endpoints left out are fed to the real
balancers the request path uses."""

from __future__ import annotations

import time

import pytest

from gateway.cluster.balancers import build_balancer
from gateway.cluster.shared_view import SharedEndpointState
from gateway.config import Cooling
from gateway.metrics.catalogue import COUNTERS, ENDPOINT_COOLED, PROVIDER_COOLED
from gateway.metrics.writer import WorkerMetrics
from gateway.routing.cooling import Scope, cooling_scope, cooling_signals
from shm.counters import WorkerRow
from shm.providers import EndpointCooling, ProviderCells
from shm.segment import Segment
from workers.cooling import cool_for_answer
from workers.providers import ProviderStates


class Endpoint:
    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.weight = 1
        self.address = f"10.0.0.{slot}:8000"

    def __repr__(self) -> str:
        return f"Endpoint({self.slot})"


# Provider 0 has three endpoints (slots 0-2), provider 1 one (slot 3).
ENDPOINTS = [[Endpoint(0), Endpoint(1), Endpoint(2)], [Endpoint(3)]]


@pytest.fixture
def segment() -> Segment:
    segment = Segment.create(2, 8, {"providers": ProviderCells.required_bytes(2, 4)})
    segment.directory.assign([f"p/{e.slot}" for endpoints in ENDPOINTS for e in endpoints])
    for worker in (0, 1):
        segment.claim_worker_row(worker)
    return segment


def worker(segment: Segment, row: int) -> ProviderStates:
    cells = ProviderCells(segment.region("providers"), 2, 4)
    states = ProviderStates(cells, row, segment.rows_in_use, 2, lambda p: True, lambda p: 0,
                            endpoint_cooling=EndpointCooling(segment, row))
    for provider, endpoints in enumerate(ENDPOINTS):
        states.set_endpoints(provider, endpoints)
    return states


# --------------------------------------------------------------------------- which answers speak for the provider


@pytest.mark.parametrize(("headers", "expected"), [
    ([(b"retry-after", b"7")], (b"7", False)),
    ([(b"retry-after", b"7"), (b"x-ratelimit-remaining-requests", b"0")], (b"7", True)),
    ([(b"x-ratelimit-remaining-tokens", b" 0 ")], (None, True)),
    ([(b"x-ratelimit-remaining-requests", b"12"), (b"x-ratelimit-remaining-tokens", b"4000")], (None, False)),
    ([(b"anthropic-ratelimit-output-tokens-remaining", b"0"), (b"retry-after", b"30")], (b"30", True)),
    ([(b"retry-after", b"1"), (b"retry-after", b"9")], (b"1", False)),  # the first one, as before
    ([(b"x-ratelimit-limit-requests", b"0")], (None, False)),  # a limit of 0 is not "none left"
])
def test_cooling_signals_read_retry_after_and_a_provider_wide_limit(
        headers: list[tuple[bytes, bytes]], expected: tuple[bytes | None, bool]) -> None:
    assert cooling_signals(headers) == expected


def test_the_provider_cools_when_the_answer_says_so_or_no_endpoint_is_left() -> None:
    assert cooling_scope(False, 1, 3) == Scope.ENDPOINT
    assert cooling_scope(True, 1, 3) == Scope.PROVIDER
    assert cooling_scope(False, 3, 3) == Scope.PROVIDER
    assert cooling_scope(False, 1, 1) == Scope.PROVIDER  # a one-endpoint provider: as before


# --------------------------------------------------------------------------- shared by the workers of a host


def test_a_429_from_one_endpoint_cools_that_endpoint_in_every_worker_and_the_provider_stays(segment: Segment) -> None:
    first, second = worker(segment, 0), worker(segment, 1)
    now = time.monotonic()
    e0, e1, _ = ENDPOINTS[0]
    assert first.cool_endpoint(0, e0, 5.0, now) == Scope.ENDPOINT
    assert first.view.usable == [True, True]
    assert first.cooled_endpoints(0) == [e0]
    second.refresh(now)
    assert second.view.usable == [True, True]  # still selectable through its other endpoints
    assert second.cooled_endpoints(0) == [e0]
    assert second.cooled_endpoints(1) is None
    # Callers extend what they get (the attempt's exclusions): every call gives a fresh list.
    mine = second.cooled_endpoints(0)
    assert mine is not None
    mine.append(e1)
    assert second.cooled_endpoints(0) == [e0]
    second.refresh(now + 6.0)
    assert second.cooled_endpoints(0) is None  # its cooling is over


def test_the_provider_cools_once_every_endpoint_is_cooled_even_by_different_workers(segment: Segment) -> None:
    first, second = worker(segment, 0), worker(segment, 1)
    now = time.monotonic()
    e0, e1, e2 = ENDPOINTS[0]
    first.cool_endpoint(0, e0, 5.0, now)
    first.cool_endpoint(0, e1, 8.0, now)
    second.cool_endpoint(0, e2, 3.0, now)  # neither worker alone saw all three
    for states in (first, second):
        states.refresh(now + 0.1)
        assert states.view.usable == [False, True]
        assert states.cooled_endpoints(0) is None  # all cooled: if it is used anyway, any endpoint may serve
    # It comes back with its first endpoint (e2, after 3 s), which is then the only one to use.
    second.refresh(now + 3.5)
    assert second.view.usable == [True, True]
    assert second.cooled_endpoints(0) == [e0, e1]


def test_the_worker_that_cools_the_last_endpoint_cools_the_provider_at_once(segment: Segment) -> None:
    (states,) = (worker(segment, 0),)
    now = time.monotonic()
    for endpoint, seconds in zip(ENDPOINTS[0], (5.0, 4.0, 6.0), strict=True):
        scope = states.cool_endpoint(0, endpoint, seconds, now)
    assert scope == Scope.PROVIDER
    assert states.view.usable == [False, True]
    assert states.view.cooled_until[0] == pytest.approx(now + 4.0)  # until the first comes back


def test_an_answer_speaking_for_the_whole_provider_cools_it_everywhere(segment: Segment) -> None:
    first, second = worker(segment, 0), worker(segment, 1)
    now = time.monotonic()
    assert first.cool_endpoint(0, ENDPOINTS[0][1], 20.0, now, provider_wide=True) == Scope.PROVIDER
    second.refresh(now)
    assert (first.view.usable, second.view.usable) == ([False, True], [False, True])
    assert second.view.cooled_until[0] == pytest.approx(now + 20.0)


def test_a_one_endpoint_provider_cools_as_a_whole(segment: Segment) -> None:
    states = worker(segment, 0)
    assert states.cool_endpoint(1, ENDPOINTS[1][0], 5.0, time.monotonic()) == Scope.PROVIDER
    assert states.view.usable == [True, False]


@pytest.mark.parametrize("strategy", ["round_robin", "least_connections", "p2c", "random", "consistent_hash",
                                      "maglev"])
def test_every_balancer_leaves_the_cooled_endpoints_out(segment: Segment, strategy: str) -> None:
    states = worker(segment, 0)
    now = time.monotonic()
    e0, e1, e2 = ENDPOINTS[0]
    states.cool_endpoint(0, e1, 5.0, now)
    balancer = build_balancer(strategy, ENDPOINTS[0], SharedEndpointState(segment, 0), cluster="p")
    picks = {balancer.pick(b"key-%d" % n, states.cooled_endpoints(0)) for n in range(60)}
    assert picks <= {e0, e2} and picks


def test_cool_for_answer_counts_the_endpoint_and_the_provider(segment: Segment) -> None:
    states = worker(segment, 0)
    metrics = WorkerMetrics([0] * COUNTERS, ["p", "q"])
    cooling = Cooling()
    now, wall = time.monotonic(), time.time()
    scope = cool_for_answer(states, metrics, "p", 0, ENDPOINTS[0][0], b"2", False, cooling, now, wall)
    assert scope == Scope.ENDPOINT
    assert states.cooled_endpoints(0) == [ENDPOINTS[0][0]]
    assert (metrics.row[ENDPOINT_COOLED], metrics.row[PROVIDER_COOLED]) == (1, 0)
    scope = cool_for_answer(states, metrics, "q", 1, ENDPOINTS[1][0], None, False, cooling, now, wall)
    assert scope == Scope.PROVIDER
    assert (metrics.row[ENDPOINT_COOLED + 1], metrics.row[PROVIDER_COOLED + 1]) == (1, 1)
    assert states.view.cooled_until[1] == pytest.approx(now + float(cooling.default))


def test_a_dead_workers_endpoint_cooling_goes_with_its_row(segment: Segment) -> None:
    first, second = worker(segment, 0), worker(segment, 1)
    now = time.monotonic()
    first.cool_endpoint(0, ENDPOINTS[0][0], 60.0, now)
    segment.reset_worker_row(0)  # the supervisor, after worker 0 died
    second.refresh(now)
    assert second.cooled_endpoints(0) is None
    assert WorkerRow(segment, 0).counters(0) == [0] * 8
