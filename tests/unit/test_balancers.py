from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from gateway.cluster.balancers import build_balancer
from gateway.cluster.balancers.base import DOWN, FULL_PERMILLE, PROBE, ROUTABLE
from gateway.cluster.balancers.hashing import MAGLEV_TABLE_SIZE, hash_key, maglev_table
from gateway.cluster.balancers.weighted import smooth_weighted_cycle
from gateway.cluster.shared_view import SharedEndpointState
from shm.counters import WorkerRow
from shm.segment import Segment

ALL_STRATEGIES = ["round_robin", "least_connections", "p2c", "random", "consistent_hash", "maglev"]


@dataclass(eq=False, slots=True)
class Endpoint:
    """Any object with slot, weight and address will do; the balancer hands back the very object."""

    slot: int
    address: str
    weight: int = 1


class LocalState:
    """An in-process StateView: health set by the test, in-flight counts in a dict."""

    def __init__(self) -> None:
        self._generation = 0
        self._health: dict[int, tuple[int, int]] = {}
        self.inflight: defaultdict[int, int] = defaultdict(int)

    def set_health(self, slot: int, status: int, permille: int = FULL_PERMILLE) -> None:
        self._health[slot] = (status, permille)
        self._generation += 1

    def generation(self) -> int:
        return self._generation

    def slot_health(self, slot: int) -> tuple[int, int]:
        return self._health.get(slot, (ROUTABLE, FULL_PERMILLE))

    def mark_probe_sent(self, slot: int) -> None:
        self._health[slot] = (DOWN, FULL_PERMILLE)

    def inflight_reader(self, slots: Sequence[int]) -> Callable[[], Sequence[int]]:
        counts, order = self.inflight, tuple(slots)
        return lambda: [counts[s] for s in order]

    def inflight_getter(self, slot: int) -> Callable[[], int]:
        counts = self.inflight
        return lambda: counts[slot]


def _refs(*weights: int) -> list[Endpoint]:
    return [Endpoint(slot, f"10.0.0.{slot}:8000", w) for slot, w in enumerate(weights)]


def _build(strategy: str, endpoints: list[Endpoint], state, **options):
    return build_balancer(strategy, endpoints, state, hash_header="X-User-Id", **options)


def _picks(balancer, n: int, keys: bool = True) -> Counter[str]:
    return Counter(balancer.pick(b"key-%d" % i if keys else None).address for i in range(n))


# -- round robin ------------------------------------------------------------------------------

def test_round_robin_1_to_3_is_exact_over_every_cycle_and_interleaved() -> None:
    a, b = _refs(1, 3)
    balancer = _build("round_robin", [a, b], LocalState())
    sequence = [balancer.pick().slot for _ in range(40)]
    for start in range(0, 40, 4):
        assert sorted(sequence[start:start + 4]) == [0, 1, 1, 1]
    assert sequence[:4] == [1, 0, 1, 1]  # smooth: the light endpoint sits inside the cycle


def test_smooth_cycle_spreads_heavy_weights() -> None:
    cycle = smooth_weighted_cycle([5, 1, 1])
    assert Counter(cycle) == {0: 5, 1: 1, 2: 1}
    assert cycle == [0, 0, 1, 0, 2, 0, 0]


def test_round_robin_skips_excluded_endpoints_and_returns_none_when_all_are() -> None:
    refs = _refs(1, 1, 1)
    balancer = _build("round_robin", refs, LocalState())
    assert {balancer.pick(excluded={refs[1]}).slot for _ in range(9)} == {0, 2}
    assert balancer.pick(excluded=refs) is None


# -- least connections and p2c ----------------------------------------------------------------

def test_least_connections_picks_the_fewest_in_flight() -> None:
    state = LocalState()
    state.inflight.update({0: 5, 1: 2, 2: 7})
    balancer = _build("least_connections", _refs(1, 1, 1), state)
    assert {balancer.pick().slot for _ in range(50)} == {1}


def test_least_connections_ties_are_not_always_the_first() -> None:
    balancer = _build("least_connections", _refs(1, 1, 1, 1), LocalState())
    counts = _picks(balancer, 400)
    assert len(counts) == 4
    assert max(counts.values()) < 160  # idle cluster: ties spread at random


def test_least_connections_breaks_ties_by_weight_first() -> None:
    state = LocalState()
    state.inflight.update({0: 0, 1: 1})  # scores (0+1)/1 == (1+1)/2
    balancer = _build("least_connections", _refs(1, 2), state)
    assert {balancer.pick().slot for _ in range(50)} == {1}


def test_least_connections_sums_in_flight_over_every_worker_row() -> None:
    segment = Segment.create(max_workers=2, max_endpoints=4)
    slots = segment.directory.assign(["c/a:1", "c/b:1"])
    refs = [Endpoint(slots["c/a:1"], "a:1"), Endpoint(slots["c/b:1"], "b:1")]
    mine, other = WorkerRow(segment, 0), WorkerRow(segment, 1)
    segment.claim_worker_row(0)
    segment.claim_worker_row(1)
    other.inc_inflight(refs[0].slot)
    other.inc_inflight(refs[0].slot)
    mine.inc_inflight(refs[1].slot)
    balancer = _build("least_connections", refs, SharedEndpointState(segment, 0))
    assert balancer.pick() is refs[1]  # 1 (mine) < 2 (the other worker's)
    mine.inc_inflight(refs[1].slot)
    mine.inc_inflight(refs[1].slot)
    assert balancer.pick() is refs[0]


def test_p2c_prefers_the_less_loaded_endpoint() -> None:
    state = LocalState()
    state.inflight.update({0: 9, 1: 0, 2: 4, 3: 4})
    balancer = _build("p2c", _refs(1, 1, 1, 1), state)
    counts = Counter(balancer.pick().slot for _ in range(4000))
    assert counts[0] == 0  # the most loaded loses every duel it is drawn into
    assert counts[1] > 1700  # drawn in half of the duels, wins all of them


def test_p2c_draws_two_distinct_endpoints() -> None:
    state = LocalState()
    state.inflight.update({0: 3, 1: 0})
    balancer = _build("p2c", _refs(1, 1), state)
    assert {balancer.pick().slot for _ in range(200)} == {1}


# -- random -----------------------------------------------------------------------------------

def test_weighted_random_follows_weights() -> None:
    counts = _picks(_build("random", _refs(1, 3), LocalState()), 20000)
    assert counts["10.0.0.1:8000"] / 20000 == pytest.approx(0.75, abs=0.02)


# -- hashing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["consistent_hash", "maglev"])
def test_hashing_maps_a_key_to_one_endpoint_and_follows_weights(name: str) -> None:
    balancer = _build(name, _refs(3, 1), LocalState())
    assert balancer.key_header == b"x-user-id"
    assert len({balancer.pick(b"user-42").slot for _ in range(20)}) == 1
    heavy = sum(balancer.pick(b"user-%d" % i).slot == 0 for i in range(300))
    assert heavy / 300 == pytest.approx(0.75, abs=0.10)


@pytest.mark.parametrize("name", ["consistent_hash", "maglev"])
def test_hashing_moves_only_the_keys_of_an_unhealthy_endpoint(name: str) -> None:
    state = LocalState()
    balancer = build_balancer(name, _refs(1, 1, 1, 1), state)
    keys = [b"k%d" % i for i in range(2000)]
    before = {k: balancer.pick(k).slot for k in keys}
    state.set_health(2, DOWN)
    after = {k: balancer.pick(k).slot for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != 2)
    assert all(after[k] != 2 for k in keys)
    state.set_health(2, 0)
    assert {k: balancer.pick(k).slot for k in keys} == before


def test_hash_key_is_the_header_value_else_the_path() -> None:
    assert hash_key(b"alice", b"/v1/chat?x=1") == b"alice"
    assert hash_key(None, b"/v1/chat?x=1") == b"/v1/chat"


def _moved(old: list[str], new: list[str]) -> float:
    return sum(a != b for a, b in zip(old, new, strict=True)) / len(old)


@pytest.mark.parametrize("n", [5, 10])
def test_maglev_churn_when_adding_or_removing_one_of_n_stays_near_the_ideal(n: int) -> None:
    addresses = [f"10.1.0.{i}:443" for i in range(n + 1)]
    base = [addresses[e] for e in maglev_table(addresses[:n], [1] * n)]
    grown = [addresses[e] for e in maglev_table(addresses, [1] * (n + 1))]
    shrunk_set = addresses[1:n]
    shrunk = [shrunk_set[e] for e in maglev_table(shrunk_set, [1] * (n - 1))]
    assert len(base) == MAGLEV_TABLE_SIZE
    assert _moved(base, grown) < 1.10 * (1 / (n + 1))
    assert _moved(base, shrunk) < 1.10 * (1 / n)


def test_maglev_table_shares_follow_weights() -> None:
    counts = Counter(maglev_table(["a:1", "b:1", "c:1"], [1, 2, 1]))
    assert counts[1] / MAGLEV_TABLE_SIZE == pytest.approx(0.5, abs=0.01)


# -- health awareness -------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ALL_STRATEGIES, ids=str)
def test_every_strategy_skips_unhealthy_endpoints(spec) -> None:
    state = LocalState()
    balancer = _build(spec, _refs(1, 1, 1), state)
    state.set_health(1, DOWN)
    assert "10.0.0.1:8000" not in _picks(balancer, 300)
    assert not balancer.panic


@pytest.mark.parametrize("spec", ALL_STRATEGIES, ids=str)
def test_panic_mode_routes_across_all_when_none_is_healthy(spec, caplog: pytest.LogCaptureFixture) -> None:
    state = LocalState()
    balancer = _build(spec, _refs(1, 1, 1), state, cluster="provider-a")
    for slot in range(3):
        state.set_health(slot, DOWN)
    with caplog.at_level(logging.WARNING, logger="gridgate.balancing"):
        counts = _picks(balancer, 600)
        state.set_health(0, DOWN)  # another publish while still in panic: no second warning
        _picks(balancer, 10)
    assert len(counts) == 3
    assert balancer.panic and balancer.panic_entries == 1 and balancer.panic_picks == 610
    assert sum("panic" in r.getMessage() for r in caplog.records) == 1
    state.set_health(2, 0)
    assert set(_picks(balancer, 50)) == {"10.0.0.2:8000"}
    assert not balancer.panic


def test_slow_start_share_reduces_an_endpoint_weight() -> None:
    state = LocalState()
    balancer = _build("round_robin", _refs(1, 1), state)
    state.set_health(1, 0, 100)  # 10% of its weight while ramping
    counts = Counter(balancer.pick().slot for _ in range(110))
    assert counts == {0: 100, 1: 10}


def test_hash_slow_start_admits_a_growing_share_of_keys() -> None:
    state = LocalState()
    balancer = build_balancer("maglev", _refs(1, 1), state)
    keys = [b"k%d" % i for i in range(4000)]
    owned = [k for k in keys if balancer.pick(k).slot == 1]
    state.set_health(1, 0, 300)
    ramping = {k for k in owned if balancer.pick(k).slot == 1}
    assert 0.2 < len(ramping) / len(owned) < 0.4
    state.set_health(1, 0, 600)
    assert ramping <= {k for k in owned if balancer.pick(k).slot == 1}  # keys only move towards it


def test_half_open_probe_is_handed_out_once_ahead_of_the_strategy() -> None:
    state = LocalState()
    balancer = _build("round_robin", _refs(1, 1, 1), state)
    state.set_health(2, PROBE)
    assert balancer.pick().slot == 2
    assert 2 not in {balancer.pick().slot for _ in range(30)}
    assert state.slot_health(2)[0] == DOWN


def test_build_balancer_rejects_unknown_strategies_and_bad_endpoints() -> None:
    for strategy in ("fastest", "rendezvous"):
        with pytest.raises(ValueError, match="unknown load balancer strategy"):
            build_balancer(strategy, _refs(1), LocalState())
    with pytest.raises(ValueError, match="at least one endpoint"):
        build_balancer("round_robin", [], LocalState())
    with pytest.raises(ValueError, match="distinct"):
        build_balancer("round_robin", [Endpoint(1, "a:1"), Endpoint(1, "b:1")], LocalState())
    with pytest.raises(ValueError, match="weights"):
        build_balancer("random", [Endpoint(1, "a:1", 0)], LocalState())
    assert build_balancer("maglev", _refs(1), LocalState(), hash_header="X-Session").key_header == b"x-session"
    assert build_balancer("maglev", _refs(1), LocalState()).key_header is None


# -- the endpoint objects themselves --------------------------------------------------------------

@pytest.mark.parametrize("spec", ALL_STRATEGIES, ids=str)
def test_every_strategy_hands_back_the_objects_it_was_given(spec) -> None:
    refs = _refs(1, 2, 3)
    balancer = _build(spec, refs, LocalState())
    picked = [balancer.pick(b"key-%d" % i) for i in range(200)]
    assert all(any(p is r for r in refs) for p in picked)


@pytest.mark.parametrize("spec", ALL_STRATEGIES, ids=str)
def test_every_strategy_never_picks_an_excluded_endpoint(spec) -> None:
    refs = _refs(1, 2, 3, 1)
    state = LocalState()
    state.inflight.update({0: 0, 1: 4, 2: 1, 3: 2})
    balancer = _build(spec, refs, state)
    for tried in ([refs[0]], (refs[0], refs[2]), {refs[1], refs[2], refs[3]}):
        allowed = {r.slot for r in refs} - {r.slot for r in tried}
        picks = {balancer.pick(b"key-%d" % i, tried).slot for i in range(300)}
        assert picks and picks <= allowed
    assert {balancer.pick(b"key-%d" % i, refs[1:]).slot for i in range(50)} == {0}
    assert balancer.pick(b"key", refs) is None


def test_an_excluded_half_open_probe_stays_offered_for_a_later_pick() -> None:
    refs = _refs(1, 1, 1)
    state = LocalState()
    balancer = build_balancer("round_robin", refs, state)
    state.set_health(2, PROBE)
    assert balancer.pick(None, [refs[2]]).slot != 2
    assert balancer.pick().slot == 2
