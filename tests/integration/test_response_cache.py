"""The exact response cache (docs/cache.md), end to end in one worker's request path (tests/inprocess.py):
real mock providers on loopback (their served counts say what reached a provider), the session's real
Valkey for the quota and the cache, the ledger and the access line read back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.harness import candidate, envelope
from tests.inprocess import InProcessGateway, Provider, start_provider, value

FAST_RETRY = {"attempts": 1, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}
SHA = "sha256:"


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def keys() -> tuple[dict[str, Any], dict[str, str]]:
    """Two tenants' YAML keys (auth.keys) and the bearer secret of each, by tenant."""
    import hashlib

    secrets = {tenant: f"sk-{tenant}-{uuid.uuid4().hex}" for tenant in ("team-a", "team-b")}
    return ({"keys": [{"tenant": tenant, "key": SHA + hashlib.sha256(secret.encode()).hexdigest()}
                      for tenant, secret in secrets.items()]}, secrets)


async def gateway_for(tmp_path: Path, provider: Provider, valkey_url: str, cache: dict[str, Any] | None = None,
                      quota: bool = True, requests_a_day: int = 1000, lease: bool = False,
                      **extra: Any) -> InProcessGateway:
    overlay = envelope([candidate("m", provider.name)], "deterministic")
    config: dict[str, Any] = {"routing": {"retry": FAST_RETRY},
                              "cache": {"enabled": True, **({"backend": {"url": valkey_url}} if not quota else {}),
                                        **(cache or {})}, **extra}
    if quota:
        config["quota"] = {"backend": {"kind": "valkey", "url": valkey_url}, "lease": {} if lease else None,
                           "rules": [{"name": f"r-{uuid.uuid4().hex[:8]}",
                                      # GCRA gives a slot back every window / count: 1d / 1000 = 86.4 s, so
                                      # no slot comes back while a test runs (1m / 1000 gave one back every
                                      # 60 ms, and a loaded machine read 999 where the test asked 998).
                                      "requests": [{"window": "1d", "count": requests_a_day}],
                                      "budgets": [{"window": "1d", "tokens": 10_000_000}],
                                      "estimate": {"default_max_tokens": 10}}]}
    return await InProcessGateway.start(tmp_path, {provider.name: [provider.address]}, overlay,
                                        quota_url=valkey_url if quota else None, extra=config)


def body(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


def test_a_repeated_request_is_served_from_the_cache_without_tokens(tmp_path, valkey_url):
    """The second identical request reaches no provider, changes no token counter, costs 0, says hit, and
    counts against the request limit; its bytes are the first answer's."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url,
                                    pricing={"overrides": {"m": {"input": 1, "output": 2}}})
        try:
            question = body(uuid.uuid4().hex)
            first = await gateway.request("POST", "/v1/chat/completions", question)
            assert first.status == 200 and first.headers["x-gridgate-cache"] == "miss"
            await gateway.path.quota.drain()
            await until_stored(gateway)
            before = await gateway.used()
            slots = await request_slots(gateway)
            second = await gateway.request("POST", "/v1/chat/completions", question)
            assert second.status == 200 and second.headers["x-gridgate-cache"] == "hit"
            assert second.body == first.body and second.headers["content-type"] == first.headers["content-type"]
            assert provider.served == 1
            after = await gateway.used()
            assert after["used"] == before["used"] and after["reserved"] == 0
            lines = gateway.access_lines()
            assert [line.get("cache") for line in lines] == ["miss", "hit"]
            assert lines[1]["tokens_prompt"] is None and lines[1].get("cost_nusd", 0) == 0
            assert lines[1]["saved_tokens"] == lines[0]["tokens_prompt"] + lines[0]["tokens_completion"]
            assert (slots, await request_slots(gateway)) == (999, 998)  # the hit counted as a request
            samples = gateway.samples()  # "anonymous" is no configured tenant: counted under "other"
            assert value(samples, "gridgate_cache_hits_total", tenant="other") == 1
            assert value(samples, "gridgate_cache_misses_total", tenant="other") == 1
            assert lines[0]["cost_nusd"] > 0 and lines[1]["cost_nusd"] == 0
            assert lines[1]["saved_nusd"] == lines[0]["cost_nusd"]
            assert value(samples, "gridgate_cache_saved_nanousd_total", tenant="other") == lines[0]["cost_nusd"]
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


async def request_slots(gateway: InProcessGateway, tenant: str = "anonymous") -> int:
    """The request slots left of the tenant's first rule's first request limit, in the ledger."""
    report = await gateway.path.quota.quota_report(tenant)  # type: ignore[union-attr]
    return report["rules"][0]["requests"][0]["remaining"]


async def until_stored(gateway: InProcessGateway, count: int = 1) -> None:
    cache = gateway.path.cache
    assert cache is not None
    for _ in range(400):
        if cache.stored >= count:
            await cache.synced()  # written, and served: a skipped reply does not say so
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"stored {cache.stored} of {count}")


def test_tenants_never_read_each_others_answers(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        auth, secrets = keys()
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False, auth=auth)
        try:
            question = body(uuid.uuid4().hex)
            for tenant, state in (("team-a", "miss"), ("team-b", "miss"), ("team-a", "hit"), ("team-b", "hit")):
                answer = await gateway.request("POST", "/v1/chat/completions", question,
                                               [("authorization", f"Bearer {secrets[tenant]}")])
                assert answer.status == 200 and answer.headers["x-gridgate-cache"] == state, (tenant, answer)
                if state == "miss":
                    await until_stored(gateway, 1 if tenant == "team-a" else 2)
            assert provider.served == 2
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_no_store_bypass_errors_and_random_requests_are_never_stored(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)
        try:
            cases: list[tuple[dict[str, Any], list[tuple[str, str]], str]] = [
                (body(uuid.uuid4().hex), [("cache-control", "no-store")], "bypass"),
                (body(uuid.uuid4().hex), [("x-gridgate-cache", "bypass")], "bypass"),
                (body(uuid.uuid4().hex, temperature=0.8), [], "bypass"),
            ]
            for question, headers, state in cases:
                for _ in range(2):
                    answer = await gateway.request("POST", "/v1/chat/completions", question, headers)
                    assert answer.status == 200 and answer.headers["x-gridgate-cache"] == state
            assert provider.served == 6
            provider.state.settings.fail_next = 1  # an error answer: relayed, never stored
            question = body(uuid.uuid4().hex)
            failed = await gateway.request("POST", "/v1/chat/completions", question)
            assert failed.status == 503 and failed.headers["x-gridgate-cache"] == "miss"
            again = await gateway.request("POST", "/v1/chat/completions", question)
            assert again.status == 200 and again.headers["x-gridgate-cache"] == "miss"
            await until_stored(gateway)
            assert provider.served == 8 and gateway.path.cache.stored == 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_streamed_hit_replays_the_same_events(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=6)
        gateway = await gateway_for(tmp_path, provider, valkey_url)
        try:
            question = body(uuid.uuid4().hex, stream=True)
            first = await gateway.request("POST", "/v1/chat/completions", question)
            assert first.status == 200 and first.headers["x-gridgate-cache"] == "miss"
            assert first.body.endswith(b"data: [DONE]\n\n") and b'"usage"' not in first.body  # as asked
            await until_stored(gateway)
            second = await gateway.request("POST", "/v1/chat/completions", question)
            assert second.headers["x-gridgate-cache"] == "hit" and second.complete
            assert second.body == first.body and second.headers["content-type"].startswith("text/event-stream")
            assert second.headers.get("transfer-encoding") == "chunked"
            assert provider.served == 1
            assert gateway.access_lines()[1]["saved_tokens"] > 0  # its usage was read although not relayed
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_the_caches_valkey_down_passes_traffic(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, "valkey://127.0.0.1:1", quota=False)
        try:
            question = body(uuid.uuid4().hex)
            for _ in range(3):
                answer = await gateway.request("POST", "/v1/chat/completions", question)
                assert answer.status == 200 and answer.headers["x-gridgate-cache"] == "bypass"
            assert provider.served == 3 and gateway.path.cache.backend_errors >= 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_identical_requests_in_flight_share_one_upstream_call(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5, latency_ms=300)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)
        try:
            question = body(uuid.uuid4().hex)
            answers = await asyncio.gather(*(gateway.request("POST", "/v1/chat/completions", question)
                                             for _ in range(8)))
            assert all(answer.status == 200 for answer in answers)
            assert sorted(answer.headers["x-gridgate-cache"] for answer in answers) == ["hit"] * 7 + ["miss"]
            assert len({answer.body for answer in answers}) == 1
            assert provider.served == 1 and gateway.path.cache.coalesced == 7
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_failed_leader_releases_its_waiters(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5, latency_ms=200)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)
        try:
            provider.state.settings.fail_next = 1  # the leader's answer is an error
            question = body(uuid.uuid4().hex)
            answers = await asyncio.gather(*(gateway.request("POST", "/v1/chat/completions", question)
                                             for _ in range(4)))
            assert sorted(answer.status for answer in answers) == [200, 200, 200, 503]
            assert provider.served == 4  # each waiter went on its own
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_every_api_is_cached_and_replayed_exactly(tmp_path, valkey_url):
    """Embeddings (no temperature needed), Responses and Messages, plain and streamed: the hit is the
    miss's bytes; a Messages request with another anthropic-beta is another entry."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)
        anthropic = [("anthropic-version", "2023-06-01")]
        try:
            word = uuid.uuid4().hex
            cases: list[tuple[str, dict[str, Any], list[tuple[str, str]]]] = [
                ("/v1/embeddings", {"model": "m", "input": word}, []),
                ("/v1/responses", {"model": "m", "input": word, "temperature": 0}, []),
                ("/v1/responses", {"model": "m", "input": word, "temperature": 0, "stream": True}, []),
                ("/v1/messages", {"model": "m", "max_tokens": 16, "temperature": 0,
                                  "messages": [{"role": "user", "content": word}]}, anthropic),
                ("/v1/messages", {"model": "m", "max_tokens": 16, "temperature": 0, "stream": True,
                                  "messages": [{"role": "user", "content": word}]}, anthropic),
            ]
            for stored, (path, question, headers) in enumerate(cases, 1):
                first = await gateway.request("POST", path, question, headers)
                assert first.status == 200 and first.headers["x-gridgate-cache"] == "miss", (path, first)
                await until_stored(gateway, stored)
                second = await gateway.request("POST", path, question, headers)
                assert second.headers["x-gridgate-cache"] == "hit" and second.body == first.body, path
            assert provider.served == len(cases)
            path, question, headers = cases[3]
            beta = await gateway.request("POST", path, question, [*headers, ("anthropic-beta", "x-1")])
            assert beta.headers["x-gridgate-cache"] == "miss"
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_ticks_commands_leave_together_and_each_gets_its_own_reply(valkey_url):
    """gateway/valkey/tick_batch.py against the real Valkey: replies (and an error reply) in place, a
    detached command reported once, a dead server failing every command of the batch."""
    from gateway.valkey.client import create_client
    from gateway.valkey.tick_batch import TickBatch

    async def scenario() -> None:
        key = f"test:tick:{uuid.uuid4().hex}".encode()
        batch = TickBatch(create_client(valkey_url))
        heard: list[BaseException | None] = []
        batch.on_detached = heard.append
        batch.send(b"SET", key, b"v", b"PX", 10_000)
        futures = [batch.call(b"GET", key), batch.call(b"INCR", key), batch.call(b"GET", key + b":none")]
        got, wrong, none = await asyncio.gather(*futures, return_exceptions=True)
        assert (got, none, heard, batch.detached) == (b"v", None, [None], 0)
        assert isinstance(wrong, Exception)  # INCR on a string: its own error, the others unharmed
        await batch.client.aclose()
        dead = TickBatch(create_client("valkey://127.0.0.1:1"))
        dead.on_detached = heard.append
        dead.send(b"SET", key, b"v")
        results = await asyncio.gather(dead.call(b"GET", key), return_exceptions=True)
        assert isinstance(results[0], Exception) and isinstance(heard[-1], Exception) and dead.detached == 0
    run(scenario)


def test_hits_admitted_by_a_worker_held_block_count_one_request_each_and_no_tokens(tmp_path, valkey_url):
    """With blocks on (the default) a hit takes one request slot of the worker's block and settles at once
    (docs/cache.md): once the blocks are settled the ledger counts every request, hit or not, and only the
    miss's tokens."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, lease=True)
        quota_config = gateway.path.quota
        try:
            question = body(uuid.uuid4().hex)
            first = await gateway.request("POST", "/v1/chat/completions", question)
            assert first.headers["x-gridgate-cache"] == "miss"
            await until_stored(gateway)
            leased = quota_config.counters.leased
            for _ in range(30):
                hit = await gateway.request("POST", "/v1/chat/completions", question)
                assert hit.status == 200 and hit.headers["x-gridgate-cache"] == "hit" and hit.body == first.body
            assert provider.served == 1
            assert quota_config.counters.leased - leased >= 20  # most hits from a block, not each a round trip
            quota_config._leases.close()  # the blocks settled now (as at shutdown): what they did not use goes back
            await quota_config._batcher.settled(1.0)
            await quota_config.drain()
            report = await quota_config.quota_report("anonymous")
            assert report["rules"][0]["requests"][0]["remaining"] == 1000 - 31
            used = await gateway.used()
            assert used["reserved"] == 0
            assert used["used"] == first_tokens(gateway.access_lines()[0])
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def first_tokens(line: dict[str, Any]) -> int:
    return line["tokens_prompt"] + line["tokens_completion"]
