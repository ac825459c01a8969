"""Prefix affinity through a real gateway and real mock providers (docs/routing.md, "Prefix affinity"):
requests that share a system prompt meet one provider, different ones spread, a provider that goes away
hands its prefixes on and gets them back, a session's binding wins."""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tests.harness import Client, candidate, envelope, metric_value, request

PREFIX = {"prefix_affinity": {"enabled": True}}


def three(handles) -> dict[str, list[str]]:
    return {name: [handle.address] for name, handle in handles.items()}


def overlay(names) -> dict:
    return envelope([candidate("m", name) for name in names], mode="roundRobin")


def system(n: int) -> dict:
    return {"role": "system", "content": f"You are assistant number {n}. " + "Follow the house rules. " * 40}


def ask(port: int, prompt: int, user: str, headers: list[tuple[str, str]] | None = None):
    client = Client(port)
    try:
        body = {"model": "m", "messages": [system(prompt), {"role": "user", "content": f"question of {user}"}]}
        return client.request("POST", "/v1/chat/completions", body, headers or [])
    finally:
        client.close()


def served_by(port: int, prompt: int, user: str = "u", headers: list[tuple[str, str]] | None = None) -> str:
    response = ask(port, prompt, user, headers)
    assert response.status == 200, response.body
    return response.headers["x-gridgate-provider"]


def test_equal_prefixes_meet_one_provider_and_different_ones_spread(providers, loopback_gateway_factory):
    gateway = loopback_gateway_factory(three(providers), overlay(providers), extra={"routing": PREFIX})
    homes: dict[int, set[str]] = {}
    for prompt in range(20):
        for user in range(4):
            response = ask(gateway.port, prompt, f"user-{user}")
            assert response.headers["x-gridgate-selection-mode"] == "prefix"
            homes.setdefault(prompt, set()).add(response.headers["x-gridgate-provider"])
    assert all(len(home) == 1 for home in homes.values()), homes
    spread = [next(iter(home)) for home in homes.values()]
    assert set(spread) == set(providers)  # 20 prefixes over three providers: every one gets some
    assert max(spread.count(name) for name in providers) <= 12


def test_off_by_default_the_group_picker_rotates(providers, loopback_gateway_factory):
    gateway = loopback_gateway_factory(three(providers), overlay(providers))
    picks = [ask(gateway.port, 1, f"user-{n}") for n in range(6)]
    assert {r.headers["x-gridgate-selection-mode"] for r in picks} == {"roundRobin"}
    assert len({r.headers["x-gridgate-provider"] for r in picks}) == 3


def test_provider_down_moves_the_prefix_and_it_comes_back(mock_provider, loopback_gateway_factory):
    handles = {name: mock_provider(name) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {**PREFIX, "retry": {"attempts": 3, "backoff": {"base": "1ms", "max": "5ms"}},
                         "cooling": {"default": "300ms", "max": "1s"}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    home = served_by(gateway.port, 7)
    admin = {"fail_rate": 1.0, "fail_status": 503, "retry_after": "1"}
    assert request("127.0.0.1", handles[home].port, "POST", "/admin/config", admin)[0] == 200
    first = ask(gateway.port, 7, "v")
    assert first.status == 200 and first.headers["x-gridgate-provider"] != home  # failed over
    while_down = {served_by(gateway.port, 7, f"w{n}") for n in range(5)}
    assert len(while_down) == 1 and home not in while_down  # the next of its ranking, every time
    assert request("127.0.0.1", handles[home].port, "POST", "/admin/config", {"fail_rate": 0.0})[0] == 200
    deadline = time.monotonic() + 5
    while served_by(gateway.port, 7, "x") != home:
        assert time.monotonic() < deadline, "the prefix never came back to its provider"
        time.sleep(0.1)
    assert {served_by(gateway.port, 7, f"y{n}") for n in range(4)} == {home}


def test_session_affinity_wins_over_the_prefix(providers, loopback_gateway_factory):
    extra = {"routing": {**PREFIX, "session_affinity": {"enabled": True}}}
    gateway = loopback_gateway_factory(three(providers), overlay(providers), extra=extra)
    session = [("X-Session-Id", "conversation-1")]
    bound = served_by(gateway.port, 0, headers=session)
    other = next(prompt for prompt in range(1, 40) if served_by(gateway.port, prompt) != bound)
    response = ask(gateway.port, other, "u", session)
    assert response.headers["x-gridgate-provider"] == bound
    assert response.headers["x-gridgate-affinity"] == "reused"


def cached_tokens(response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prefix_that_keeps_missing_is_re_placed_and_stays_where_it_hits(mock_provider, gateway_factory):
    handles = {name: mock_provider(name, prefix_cache=64) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {"prefix_affinity": {"enabled": True, "misses": 3}}}
    gateway = gateway_factory(three(handles), overlay(handles), workers=1, extra=extra)
    home = served_by(gateway.port, 3)  # a cold cache: one miss
    warm = ask(gateway.port, 3, "again")
    assert warm.headers["x-gridgate-provider"] == home and cached_tokens(warm) > 0  # the hit resets the count
    assert request("127.0.0.1", handles[home].port, "POST", "/admin/config", {"prefix_cache_ttl_ms": 0.001})[0] == 200
    path = [ask(gateway.port, 3, f"user-{n}") for n in range(8)]
    providers = [r.headers["x-gridgate-provider"] for r in path]
    assert providers[:3] == [home] * 3  # three misses in a row on its place...
    moved = providers[3]
    assert moved != home and providers[3:] == [moved] * 5  # ...move it one place on, where it stays
    assert [cached_tokens(r) for r in path[4:]] == [cached_tokens(warm)] * 4  # and hits
    events = {event: metric_value(gateway.admin_port, f'gridgate_prefix_affinity_total{{event="{event}"}}')
              for event in ("placed", "spilled", "hit", "miss", "moved")}
    # misses: the cold first, three on the expiring cache, the cold first at the new place; hits: the rest
    assert events == {"placed": 10, "spilled": 0, "hit": 5, "miss": 5, "moved": 1}


def test_a_hot_prefix_spills_its_overflow_only(mock_provider, loopback_gateway_factory):
    handles = {name: mock_provider(name, latency_ms=400) for name in ("p-a", "p-b", "p-c")}
    extra = {"workers": 1, "routing": {"prefix_affinity": {"enabled": True, "capacity": 4, "spill_at": 0.5}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    home = served_by(gateway.port, 5)
    with ThreadPoolExecutor(6) as pool:
        burst = list(pool.map(lambda n: served_by(gateway.port, 5, f"burst-{n}"), range(6)))
    assert Counter(burst) == {name: 2 for name in handles}  # two each (2 = 0.5 x 4): home first, then the ring
    assert Counter(burst)[home] == 2
    assert {served_by(gateway.port, 5, f"after-{n}") for n in range(3)} == {home}  # the spill did not move it


ANTHROPIC = [("anthropic-version", "2023-06-01")]


def post(port: int, path: str, body: dict, headers: list[tuple[str, str]] | None = None):
    client = Client(port)
    try:
        return client.request("POST", path, body, headers or [])
    finally:
        client.close()


def messages(port: int, prompt: int, user: str):
    body = {"model": "m", "max_tokens": 8, "system": system(prompt)["content"],
            "messages": [{"role": "user", "content": f"question of {user}"}]}
    return post(port, "/v1/messages", body, ANTHROPIC)


def test_messages_feed_back_their_cache_reads(mock_provider, loopback_gateway_factory, tmp_path):
    handles = {name: mock_provider(name, prefix_cache=64) for name in ("p-a", "p-b", "p-c")}
    log = tmp_path / "access.log"
    extra = {"routing": {"prefix_affinity": {"enabled": True, "misses": 2}},
             "access_log": {"enabled": True, "path": str(log), "evidence_sample": 1.0}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    first, second = messages(gateway.port, 9, "a"), messages(gateway.port, 9, "b")
    home = first.headers["x-gridgate-provider"]
    assert second.headers["x-gridgate-provider"] == home and second.headers["x-gridgate-selection-mode"] == "prefix"
    assert first.json()["usage"]["cache_read_input_tokens"] == 0 < second.json()["usage"]["cache_read_input_tokens"]
    assert request("127.0.0.1", handles[home].port, "POST", "/admin/config", {"prefix_cache_ttl_ms": 0.001})[0] == 200
    moved = [messages(gateway.port, 9, f"u{n}").headers["x-gridgate-provider"] for n in range(4)]
    assert moved[:2] == [home, home] and moved[2] != home and moved[3] == moved[2]
    responses = post(gateway.port, "/v1/responses", {"model": "m", "instructions": "be brief " * 50, "input": "q"})
    assert responses.status == 200 and responses.headers["x-gridgate-selection-mode"] == "prefix"
    deadline = time.monotonic() + 5
    while True:  # the access log writes its lines out in batches
        lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        evidence = [line["prefix"] for line in lines if line.get("path") == "/v1/messages"]
        if len(evidence) >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(evidence) == 6 and len({entry["hash"] for entry in evidence}) == 1
    assert [entry["moved"] for entry in evidence] == [0, 0, 0, 0, 1, 1]
    assert {entry["spilled"] for entry in evidence} == {0}


def test_a_slow_first_token_breaks_stickiness(mock_provider, loopback_gateway_factory):
    handles = {name: mock_provider(name) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {"prefix_affinity": {"enabled": True, "slow_first_token": "150ms"}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    home = served_by(gateway.port, 11)
    assert request("127.0.0.1", handles[home].port, "POST", "/admin/config", {"latency_ms": 300})[0] == 200
    assert served_by(gateway.port, 11, "slow") == home  # this answer is the slow one...
    moved = {served_by(gateway.port, 11, f"after-{n}") for n in range(3)}
    assert len(moved) == 1 and home not in moved  # ...and the prefix moved on


def stream_served_by(port: int, prompt: int, user: str) -> tuple[str, float, bytes]:
    """A streamed ask: the provider, the seconds until its head, and the whole body."""
    client = Client(port)
    try:
        body = {"model": "m", "stream": True,
                "messages": [system(prompt), {"role": "user", "content": f"question of {user}"}]}
        started = time.monotonic()
        response = client.request("POST", "/v1/chat/completions", body, [])
        assert response.status == 200, response.body
        return response.headers["x-gridgate-provider"], time.monotonic() - started, response.body
    finally:
        client.close()


def test_a_stream_whose_first_token_is_late_breaks_stickiness_though_its_head_is_quick(
        mock_provider, loopback_gateway_factory):
    handles = {name: mock_provider(name) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {"prefix_affinity": {"enabled": True, "slow_first_token": "150ms"}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    home, _, _ = stream_served_by(gateway.port, 12, "first")
    assert stream_served_by(gateway.port, 12, "again")[0] == home  # quick: it stays
    # The head and the role-only opening event leave at once; the first token 300 ms later.
    assert request("127.0.0.1", handles[home].port, "POST", "/admin/config", {"ttft_ms": 300})[0] == 200
    slow, _, body = stream_served_by(gateway.port, 12, "slow")
    assert slow == home and b"[DONE]" in body  # this stream is the slow one...
    moved = {stream_served_by(gateway.port, 12, f"after-{n}")[0] for n in range(3)}
    assert len(moved) == 1 and home not in moved  # ...and the prefix moved on


def test_a_stream_whose_first_token_is_quick_stays(mock_provider, loopback_gateway_factory):
    """Quick first tokens (20 ms, under the 150 ms bound): the prefix stays on its provider."""
    handles = {name: mock_provider(name, ttft_ms=20) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {"prefix_affinity": {"enabled": True, "slow_first_token": "150ms"}}}
    gateway = loopback_gateway_factory(three(handles), overlay(handles), extra=extra)
    homes = {stream_served_by(gateway.port, 13, f"u{n}")[0] for n in range(6)}
    assert len(homes) == 1


def test_two_workers_share_a_prefixs_spill_share_and_its_moves(mock_provider, gateway_factory):
    """Requests of one prefix that SO_REUSEPORT spreads over two workers: the spill share is the host's
    (one in flight on a provider with capacity 2 x spill_at 0.5, not one per worker), and a move learnt
    from misses on either worker is followed by both."""
    handles = {name: mock_provider(name, latency_ms=400, prefix_cache=64) for name in ("p-a", "p-b", "p-c")}
    extra = {"routing": {"prefix_affinity": {"enabled": True, "capacity": 2, "spill_at": 0.5, "misses": 2}}}
    gateway = gateway_factory(three(handles), overlay(handles), workers=2, extra=extra)
    home = served_by(gateway.port, 21)
    for _ in range(3):  # new connections land on both workers: each burst spills over the host's share
        with ThreadPoolExecutor(3) as pool:
            burst = list(pool.map(lambda n: served_by(gateway.port, 21, f"burst-{n}"), range(3)))
        assert Counter(burst) == {name: 1 for name in handles}, burst
    assert request("127.0.0.1", handles[home].port, "POST", "/admin/config", {"prefix_cache_ttl_ms": 0.001})[0] == 200
    path = [served_by(gateway.port, 21, f"user-{n}") for n in range(8)]
    moved = path[2]
    assert path[:2] == [home, home] and moved != home and path[2:] == [moved] * 6, path
    assert metric_value(gateway.admin_port, 'gridgate_prefix_affinity_total{event="moved"}') == 1
