"""Prefix affinity's ranking (docs/routing.md, "Prefix affinity"): a provider that goes away takes only
its own prefixes along, each to the next provider of its ranking (so they spread over the others, no herd
onto one), every other prefix stays where it was; past every provider's share the least loaded takes the
next request; a pinned route is never placed by prefix; a dead worker's requests in flight leave the host's
share; the route evidence says how far each request spilled. Real gateways, mock providers on loopback."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tests.harness import request
from tests.integration.test_prefix_affinity import PREFIX, ask, overlay, served_by, three
from tests.integration.test_selection import auth, bearer

PROMPTS = range(24)


def test_a_provider_that_goes_away_takes_only_its_own_prefixes_along(mock_provider, loopback_gateway_factory):
    handles = {name: mock_provider(name) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {**PREFIX, "retry": {"attempts": 3, "backoff": {"base": "1ms", "max": "5ms"}},
                         "cooling": {"default": "30s", "max": "30s"}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    homes = {prompt: served_by(gateway.port, prompt) for prompt in PROMPTS}
    gone = max(set(homes.values()), key=list(homes.values()).count)  # the provider with most prefixes
    assert 0 < list(homes.values()).count(gone) < len(PROMPTS)
    failing = {"fail_rate": 1.0, "fail_status": 503, "retry_after": "30"}
    assert request("127.0.0.1", handles[gone].port, "POST", "/admin/config", failing)[0] == 200
    served_by(gateway.port, next(p for p in PROMPTS if homes[p] == gone), "cools it")  # fails over: cooled
    after = {prompt: served_by(gateway.port, prompt, "again") for prompt in PROMPTS}
    assert {p: after[p] for p in PROMPTS if homes[p] != gone} == {p: homes[p] for p in PROMPTS if homes[p] != gone}
    assert all(after[p] != gone for p in PROMPTS)
    moved = [after[p] for p in PROMPTS if homes[p] == gone]
    assert set(moved) == set(handles) - {gone}  # spread by their rankings over both others: no herd
    stable = {prompt: served_by(gateway.port, prompt, "once more") for prompt in PROMPTS}
    assert stable == after  # each moved prefix keeps its next place


def test_when_every_provider_is_at_its_share_the_least_loaded_takes_the_next(mock_provider, loopback_gateway_factory):
    """Share 1 in flight per provider (capacity 2 x spill_at 0.5), nine requests of one prefix at once: the
    first three fill the ranking one each; past that every provider is at its share and the least loaded
    takes each next one, so they stay even (three each), not piled on the prefix's place."""
    handles = {name: mock_provider(name, latency_ms=600) for name in ("p-a", "p-b", "p-c")}
    extra = {"workers": 1, "routing": {"prefix_affinity": {"enabled": True, "capacity": 2, "spill_at": 0.5}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    home = served_by(gateway.port, 8)
    with ThreadPoolExecutor(9) as pool:
        burst = Counter(pool.map(lambda n: served_by(gateway.port, 8, f"burst-{n}"), range(9)))
    assert burst == {name: 3 for name in handles}, burst
    assert served_by(gateway.port, 8, "after") == home  # the spill did not move it


def test_a_pinned_route_is_never_placed_by_prefix(providers, loopback_gateway_factory):
    """A tenant that may pin sends a prefix's request to another provider than its place: it goes where
    pinned (mode ``pinned``), and the prefix's next unpinned request is still at its place."""
    tenants = [{"tenant": "ops", "may_pin": True}]
    gateway = loopback_gateway_factory(three(providers), overlay(providers),
                                       extra={"routing": PREFIX, "auth": auth(), "tenants": tenants})
    home = served_by(gateway.port, 4, headers=bearer("ops"))
    elsewhere = next(name for name in providers if name != home)
    pinned = ask(gateway.port, 4, "pinned", [*bearer("ops"), ("X-Gridgate-Pin", elsewhere)])
    assert pinned.status == 200
    assert (pinned.headers["x-gridgate-provider"], pinned.headers["x-gridgate-selection-mode"]) == (elsewhere, "pinned")
    again = ask(gateway.port, 4, "after", bearer("ops"))
    assert (again.headers["x-gridgate-provider"], again.headers["x-gridgate-selection-mode"]) == (home, "prefix")


def test_a_dead_workers_requests_in_flight_are_cleared_from_the_host_share(mock_provider, gateway_factory):
    """Share 1 in flight per provider. The prefix's one request in flight on its place dies with its worker
    (SIGKILL): the supervisor clears that worker's in-flight cells, so the new worker's next request of the
    prefix goes to its place again, not spilled as if the dead request were still there."""
    import os
    import signal
    import threading

    from tests.harness import mock_in_flight, wait_until

    handles = {name: mock_provider(name) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {"prefix_affinity": {"enabled": True, "capacity": 2, "spill_at": 0.5}}}
    gateway = gateway_factory(three(handles), overlay(handles), workers=1, extra=extra)
    home = served_by(gateway.port, 31)

    def doomed() -> None:
        try:
            ask(gateway.port, 31, "doomed", [("X-Mock-Latency-Ms", "5000")])
        except Exception:
            pass  # its worker is killed: the connection drops

    threading.Thread(target=doomed, daemon=True).start()
    wait_until(lambda: mock_in_flight(handles[home]) == 1, "the request in flight on its place", timeout=5)
    (pid,) = gateway.worker_pids()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: (pids := gateway.worker_pids()) and pids != [pid], "a new worker", timeout=10)
    gateway.wait_ready()
    assert served_by(gateway.port, 31, "after") == home


def test_the_route_evidence_says_which_requests_spilled(mock_provider, loopback_gateway_factory, tmp_path):
    """Three requests of one prefix at once at share 1: the access lines' ``prefix`` evidence has one hash
    and ``spilled``, the places each request went past its place (docs/operations.md): 0 for the two at the
    place, 1 and 2 for the two that spilled, each on a provider of its own."""
    import json
    import time

    handles = {name: mock_provider(name, latency_ms=500) for name in ("p-a", "p-b", "p-c")}
    log = tmp_path / "access.log"
    extra = {"workers": 1, "routing": {"prefix_affinity": {"enabled": True, "capacity": 2, "spill_at": 0.5}},
             "access_log": {"enabled": True, "path": str(log), "evidence_sample": 1.0}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    home = served_by(gateway.port, 17)
    with ThreadPoolExecutor(3) as pool:
        burst = list(pool.map(lambda n: served_by(gateway.port, 17, f"burst-{n}"), range(3)))
    assert sorted(burst) == sorted(handles)
    deadline = time.monotonic() + 5
    while True:  # the access log writes its lines out in batches
        lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if len(lines) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    evidence = [(line["provider"] if "provider" in line else line.get("cluster"), line["prefix"]) for line in lines]
    assert len(evidence) == 4 and len({entry["hash"] for _, entry in evidence}) == 1
    assert sorted(entry["spilled"] for _, entry in evidence) == [0, 0, 1, 2]
    assert {provider for provider, entry in evidence if entry["spilled"] == 0} == {home}
    assert len({provider for provider, entry in evidence if entry["spilled"]}) == 2
