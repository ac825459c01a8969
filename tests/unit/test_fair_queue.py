"""FairQueue: interactive before batch, tenants in turn inside a class, FIFO per tenant, bounded."""

from __future__ import annotations

import random

import pytest

from gateway.request.fair_queue import FairQueue


def drain(queue: FairQueue) -> list:
    served = []
    while (item := queue.pop()) is not None:
        served.append(item)
    return served


def test_empty_queue_pops_nothing():
    queue: FairQueue[str] = FairQueue(4)
    assert queue.pop() is None and len(queue) == 0 and queue.size == 0


def test_one_tenant_is_served_first_in_first_out():
    queue: FairQueue[int] = FairQueue(10)
    for item in range(5):
        queue.push(item, "a")
    assert drain(queue) == [0, 1, 2, 3, 4]


def test_interactive_waiters_go_before_batch_waiters_queued_earlier():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("batch-1", "bulk", batch=True)
    queue.push("batch-2", "bulk", batch=True)
    queue.push("chat-1", "app")
    queue.push("batch-3", "other-bulk", batch=True)
    queue.push("chat-2", "app")
    assert drain(queue) == ["chat-1", "chat-2", "batch-1", "batch-3", "batch-2"]


def test_tenants_of_a_class_take_turns():
    queue: FairQueue[str] = FairQueue(10)
    for item in ("a1", "a2", "a3", "b1", "c1", "c2"):
        queue.push(item, item[0])
    assert drain(queue) == ["a1", "b1", "c1", "a2", "c2", "a3"]


def test_a_newcomer_waits_at_most_one_turn_behind_a_burst():
    queue: FairQueue[str] = FairQueue(100)
    for index in range(16):
        queue.push(f"burst-{index}", "bulk", batch=True)
    queue.push("first", "small", batch=True)
    assert drain(queue)[:3] == ["burst-0", "first", "burst-1"]


def test_a_tenant_that_stops_waiting_rejoins_at_the_end_of_the_ring():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("a1", "a")
    queue.push("b1", "b")
    queue.push("b2", "b")
    assert queue.pop() == "a1"  # a has nobody left: it leaves the ring
    queue.push("c1", "c")
    queue.push("a2", "a")  # back, behind c
    assert drain(queue) == ["b1", "c1", "a2", "b2"]


def test_capacity_bounds_waiters_of_every_class_together():
    queue: FairQueue[int] = FairQueue(3)
    assert queue.push(1, "a") and queue.push(2, "b", batch=True) and queue.push(3, "c")
    assert not queue.push(4, "d") and not queue.push(5, "d", batch=True)
    assert len(queue) == 3
    assert queue.pop() == 1
    assert queue.push(6, "d", batch=True)
    assert queue.remove(2, "b", batch=True)
    assert queue.push(7, "e")
    assert drain(queue) == [3, 7, 6]


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        FairQueue(0)


def test_removed_waiter_is_never_served_and_the_order_of_the_rest_holds():
    queue: FairQueue[str] = FairQueue(10)
    for item in ("a1", "a2", "a3", "b1", "c1"):
        queue.push(item, item[0])
    assert queue.remove("a2", "a")
    assert queue.remove("b1", "b")  # b's last waiter: b leaves the ring
    assert len(queue) == 3
    assert drain(queue) == ["a1", "c1", "a3"]


def test_removing_what_is_not_queued_changes_nothing():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("a1", "a")
    assert not queue.remove("a1", "a", batch=True)  # wrong class
    assert not queue.remove("a1", "b")  # wrong tenant
    assert not queue.remove("zz", "a")
    assert len(queue) == 1
    assert queue.pop() == "a1"
    assert not queue.remove("a1", "a")  # already served
    assert len(queue) == 0 and queue.pop() is None


def test_random_traffic_keeps_every_promise():
    """Against random pushes, pops and removals: nothing lost or served twice, FIFO per tenant, no batch
    waiter served while an interactive one waits, and a tenant's first waiter is served before any other
    tenant of its class gets a second turn."""
    rng = random.Random(7)
    queue: FairQueue[int] = FairQueue(40)
    waiting: dict[int, tuple[str, bool]] = {}  # item -> (tenant, batch)
    # A tenant's first waiter (pushed when that tenant had none): turns other tenants had since then.
    newcomers: dict[int, dict[str, int]] = {}
    last_served: dict[tuple[str, bool], int] = {}
    served: list[int] = []
    for item in range(5000):
        action = rng.random()
        if action < 0.5:
            tenant, batch = rng.choice("abcde"), rng.random() < 0.4
            alone = all(owner != (tenant, batch) for owner in waiting.values())
            if queue.push(item, tenant, batch):
                waiting[item] = (tenant, batch)
                if alone:
                    newcomers[item] = {}
            else:
                assert len(waiting) == 40
        elif action < 0.9:
            got = queue.pop()
            if got is None:
                assert not waiting
                continue
            tenant, batch = waiting.pop(got)
            if batch:
                assert all(waiting_batch for _, waiting_batch in waiting.values())
            assert last_served.get((tenant, batch), -1) < got  # FIFO per tenant and class
            last_served[tenant, batch] = got
            served.append(got)
            newcomers.pop(got, None)
            for first, turns in newcomers.items():
                if waiting[first][1] == batch and waiting[first][0] != tenant:
                    turns[tenant] = turns.get(tenant, 0) + 1
                    assert turns[tenant] <= 1, "another tenant had two turns before a newcomer's first"
        elif waiting:
            victim = rng.choice(list(waiting))
            tenant, batch = waiting.pop(victim)
            assert queue.remove(victim, tenant, batch)
            newcomers.pop(victim, None)
        assert len(queue) == len(waiting)
    assert len(served) == len(set(served)) > 1000
