"""Provider state shared by the workers of a host through real shared-memory cells: latency samples
and their ageing (least_loaded), provider cooling. Two ``ProviderStates`` over one buffer play two
workers."""

from __future__ import annotations

import time

import pytest

from shm.providers import FIRST_BYTE_US, RECORD_WORDS, SAMPLED_AT_NS, ProviderCells
from workers.providers import ProviderStates

HALF_LIFE = 30.0


def workers(count: int = 2, providers: int = 3) -> list[ProviderStates]:
    cells = ProviderCells(memoryview(bytearray(ProviderCells.required_bytes(count, 8))), count, 8)
    return [ProviderStates(cells, row, lambda: count, providers, lambda p: True, lambda p: 0, half_life=HALF_LIFE)
            for row in range(count)]


def age(states: ProviderStates, provider: int, seconds: float) -> None:
    """Pretend this worker's latest sample of ``provider`` was taken ``seconds`` earlier."""
    states._row[provider * RECORD_WORDS + SAMPLED_AT_NS] -= int(seconds * 1e9)


def test_latency_is_combined_over_the_workers_that_measured() -> None:
    first, second = workers()
    first.observe_first_byte(0, 0.5)
    second.observe_first_byte(0, 0.1)
    first.refresh(time.monotonic())
    view = first.view
    assert view.latency[0] == pytest.approx(0.3, rel=1e-3)
    assert view.fresh[0] == pytest.approx(1.0, abs=1e-3)
    assert view.fresh[1] == 0.0  # never measured: the group's prior applies (gateway.routing.providers)


def test_an_idle_providers_latency_fades_toward_the_prior_by_its_half_life() -> None:
    first, second = workers()
    first.observe_first_byte(0, 0.4)
    age(first, 0, 2 * HALF_LIFE)
    first.refresh(time.monotonic())
    view = first.view
    assert view.latency[0] == pytest.approx(0.4, rel=1e-3)  # what was measured ...
    assert view.fresh[0] == pytest.approx(0.25, rel=1e-3)  # ... counts a quarter after two half-lives
    assert view.cost(0, 0.1) == pytest.approx(0.4 * 0.25 + 0.1 * 0.75, rel=1e-3)
    # A recent sample of another worker weighs more than this stale one.
    second.observe_first_byte(0, 0.1)
    first.refresh(time.monotonic())
    assert view.latency[0] == pytest.approx((0.4 * 0.25 + 0.1) / 1.25, rel=1e-3)


def test_a_sample_after_a_long_silence_replaces_the_stale_average() -> None:
    (states,) = workers(1)
    states.observe_first_byte(0, 2.0)
    age(states, 0, 10 * HALF_LIFE)
    states.refresh(time.monotonic())
    states.observe_first_byte(0, 0.1)
    average = states._row[FIRST_BYTE_US] / 1e6
    assert average == pytest.approx(0.1, abs=0.002)  # a plain moving average would still say 0.48
    states.observe_first_byte(0, 0.2)  # a fresh average moves by the usual weight
    assert states._row[FIRST_BYTE_US] / 1e6 == pytest.approx(0.1 + 0.2 * 0.1, abs=0.002)


def test_cooling_by_one_worker_is_seen_by_the_other() -> None:
    first, second = workers()
    now = time.monotonic()
    first.cool(1, 5.0, now)
    assert first.view.usable == [True, False, True]
    second.refresh(now)
    assert second.view.usable == [True, False, True]
    second.refresh(now + 6.0)
    assert second.view.usable == [True, True, True]
