"""The router's inline check of a remembered binding (gateway/routing/router.py, ``_affine``) decides as a
read of shared memory would, whatever other workers do to the session's record meanwhile."""

from __future__ import annotations

import mmap
import random

from gateway.overlay.snapshot import Snapshot, snapshot_from_object
from gateway.routing import RouteDecision, Router
from shm.affinity import WAYS, AffinityTable

MODEL = "inference_model"
CAPACITY = 2 * WAYS  # two buckets: other sessions evict bindings often
TTL = 10.0


def _snapshot() -> Snapshot:
    return snapshot_from_object({
        "local_site": "here", "selection_policy": {"mode": "roundRobin"},
        "candidates": [{"kind": MODEL, "name": "m", "site": "s", "cluster": c, "stable_id": c.upper(),
                        "selection_group": 0} for c in ("a", "b", "c")],
    })


class _Host:
    """One host's shared table: this worker's router over it, and another worker's attachment."""

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, AffinityTable.required_bytes(CAPACITY))
        self.table = AffinityTable(memoryview(self.memory), CAPACITY)
        self.router = Router(affinity=self.table, affinity_ttl_s=TTL)
        self.other = AffinityTable(memoryview(self.memory), CAPACITY)


def test_remembered_bindings_decide_as_fresh_reads_do_while_another_worker_rebinds_and_evicts() -> None:
    snapshot = _snapshot()
    fast, general = _Host(), _Host()  # general: forgets before every route, so it always reads the record
    stable = {}
    for cluster in ("a", "b", "c"):
        pinned = fast.router.pinned(snapshot, MODEL, "m", cluster)
        assert isinstance(pinned, RouteDecision)
        stable[cluster] = (pinned.candidate.stable_id_hash, pinned.plan.capability_hash)
    rng = random.Random(7)
    sessions = [b"s%d" % i for i in range(6)]
    now, reused, moved = 0.0, 0, 0
    for _ in range(3000):
        now += rng.choice((0.0, 0.01, 0.5, 3.0))
        action = rng.random()
        session = rng.choice(sessions)
        if action < 0.2:  # another worker moves the session (a failover there), maybe to a short binding
            stable_id, capability = stable[rng.choice("abc")]
            expires = now + rng.choice((TTL, 0.5))
            for host in (fast, general):
                host.other.bind(session, stable_id, capability, expires)
            moved += 1
        elif action < 0.3:  # another worker binds a new session, evicting from a full bucket
            for host in (fast, general):
                host.other.bind(b"other-%d" % rng.randrange(1000), *stable["b"], now + TTL)
        else:
            general.table.seen.clear()
            expected = general.router.route(snapshot, MODEL, "m", session, now)
            got = fast.router.route(snapshot, MODEL, "m", session, now)
            assert isinstance(got, RouteDecision) and isinstance(expected, RouteDecision)
            assert (got.cluster, got.affinity) == (expected.cluster, expected.affinity)
            reused += got.affinity == "reused"
    assert reused > 500 and moved > 300  # both the remembered case and the changed records were exercised
    assert fast.table.seen  # and the fast host did remember bindings


def test_a_remembered_binding_is_not_used_once_its_record_changes() -> None:
    snapshot = _snapshot()
    host = _Host()
    first = host.router.route(snapshot, MODEL, "m", b"s", 0.0)
    assert isinstance(first, RouteDecision) and (first.cluster, first.affinity) == ("a", "new")
    again = host.router.route(snapshot, MODEL, "m", b"s", 1.0)
    assert isinstance(again, RouteDecision) and again.affinity == "reused"
    assert b"s" in host.table.seen  # the next request takes the inline path
    moved = host.router.pinned(snapshot, MODEL, "m", "c")
    assert isinstance(moved, RouteDecision)
    host.other.bind(b"s", moved.candidate.stable_id_hash, moved.plan.capability_hash, 5.0)
    after = host.router.route(snapshot, MODEL, "m", b"s", 2.0)
    assert isinstance(after, RouteDecision) and (after.cluster, after.affinity) == ("c", "reused")
    expired = host.router.route(snapshot, MODEL, "m", b"s", 5.0)
    assert isinstance(expired, RouteDecision) and expired.affinity == "new"
