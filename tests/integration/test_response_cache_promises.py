"""The promises of docs/cache.md that tests/integration/test_response_cache.py left without a test that can
fail: an entry is never read by a request that says ``no-store`` or ``bypass``, answers over ``max_entry``
and cut streams are never stored, an alias and its target share entries, a seed or ``only_deterministic:
false`` makes a request cacheable, an entry dies with its TTL (and so do the workers' copies of it),
waiters are bounded in time, a crashed leader's claim holds nobody past its expiry, a hit takes no token estimate and is refused once the request limit is spent,
and with the cache off nothing says ``x-gridgate-cache``. One worker's request path in this process, real
mock providers on loopback, the session's real Valkey."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from tests.inprocess import start_provider
from tests.integration.test_response_cache import body, gateway_for, request_slots, run, until_stored

CHAT = "/v1/chat/completions"


def test_no_store_and_bypass_never_read_an_entry_that_is_there(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)
        try:
            question = body(uuid.uuid4().hex)
            first = await gateway.request("POST", CHAT, question)
            await until_stored(gateway)
            assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "hit"
            for header in (("cache-control", "no-store"), ("cache-control", "max-age=0, No-Store"),
                           ("x-gridgate-cache", "bypass"), ("x-gridgate-cache", "BYPASS")):
                answer = await gateway.request("POST", CHAT, question, [header])
                assert (answer.status, answer.headers["x-gridgate-cache"]) == (200, "bypass"), header
                assert answer.body != first.body  # the provider's new answer (another id), not the entry
            assert provider.served == 5 and gateway.path.cache.stored == 1  # the bypasses stored nothing
            again = await gateway.request("POST", CHAT, question)
            assert (again.headers["x-gridgate-cache"], again.body) == ("hit", first.body)  # not overwritten
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_answers_over_max_entry_are_never_stored(tmp_path, valkey_url):
    """With a 1,500-byte cap: a 2-token answer is stored, a 300-token one (plain or streamed) is relayed
    whole and never stored; each of its repeats reaches the provider again."""
    cap = 1500
    async def scenario() -> None:
        provider = await start_provider("p")
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False, cache={"max_entry": cap})
        try:
            small = body(uuid.uuid4().hex, max_tokens=2)
            first = await gateway.request("POST", CHAT, small, [("x-mock-tokens", "2")])
            assert len(first.body) < cap // 2
            await until_stored(gateway)
            assert (await gateway.request("POST", CHAT, small, [("x-mock-tokens", "2")])).headers["x-gridgate-cache"] == "hit"
            for question in (body(uuid.uuid4().hex), body(uuid.uuid4().hex, stream=True)):
                served = provider.served
                answers = [await gateway.request("POST", CHAT, question, [("x-mock-tokens", "300")]) for _ in range(2)]
                assert all(answer.status == 200 and answer.complete for answer in answers)
                assert len(answers[0].body) > cap  # relayed whole: the cap limits the cache, not the answer
                assert [answer.headers["x-gridgate-cache"] for answer in answers] == ["miss", "miss"]
                assert provider.served == served + 2
            await asyncio.sleep(0.05)
            assert gateway.path.cache.stored == 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_cut_stream_is_never_stored(tmp_path, valkey_url):
    """The provider resets the connection mid-stream: the client's stream is cut (no [DONE]), nothing is
    stored, and the repeat goes to the provider (its own claim released: no wait for the cut leader)."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=20, tokens_per_s=400)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False, cache={"coalesce": {"wait": "20s"}})
        try:
            question = body(uuid.uuid4().hex, stream=True)
            provider.state.settings.mid_reset_rate = 1.0
            cut = await gateway.request("POST", CHAT, question)
            assert cut.headers["x-gridgate-cache"] == "miss" and b"[DONE]" not in cut.body
            assert provider.state.faults["reset_mid"] + provider.state.faults["reset_mid_close"] >= 1
            provider.state.settings.mid_reset_rate = 0.0
            started = time.monotonic()
            whole = await gateway.request("POST", CHAT, question)
            assert time.monotonic() - started < 5  # not held by the cut leader's 20 s claim
            assert whole.headers["x-gridgate-cache"] == "miss" and whole.body.endswith(b"data: [DONE]\n\n")
            await until_stored(gateway)
            hit = await gateway.request("POST", CHAT, question)
            assert (hit.headers["x-gridgate-cache"], hit.body) == ("hit", whole.body)
            assert gateway.path.cache.stored == 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_an_alias_and_its_target_share_entries(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False,
                                    models={"aliases": {"fast": "m", "quick": {"target": "m"}}})
        try:
            question = body(uuid.uuid4().hex)
            first = await gateway.request("POST", CHAT, {**question, "model": "fast"})
            assert first.status == 200 and first.headers["x-gridgate-cache"] == "miss"
            await until_stored(gateway)
            for model in ("m", "quick", "fast"):
                answer = await gateway.request("POST", CHAT, {**question, "model": model})
                assert (answer.headers["x-gridgate-cache"], answer.body) == ("hit", first.body), model
            assert provider.served == 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_seed_or_only_deterministic_false_makes_a_request_cacheable(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        for name in ("strict", "loose"):
            (tmp_path / name).mkdir()
        strict = await gateway_for(tmp_path / "strict", provider, valkey_url, quota=False)
        loose = await gateway_for(tmp_path / "loose", provider, valkey_url, quota=False,
                                  cache={"only_deterministic": False})
        try:
            seeded = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "seed": 7,
                      "temperature": 0.9}
            free = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}]}  # no temperature
            states = [(await strict.request("POST", CHAT, seeded)).headers["x-gridgate-cache"]]
            await until_stored(strict)
            states.append((await strict.request("POST", CHAT, seeded)).headers["x-gridgate-cache"])
            states.append((await strict.request("POST", CHAT, free)).headers["x-gridgate-cache"])
            states.append((await loose.request("POST", CHAT, free)).headers["x-gridgate-cache"])
            await until_stored(loose)
            states.append((await loose.request("POST", CHAT, free)).headers["x-gridgate-cache"])
            assert states == ["miss", "hit", "bypass", "miss", "hit"]
            assert provider.served == 3
        finally:
            await strict.close()
            await loose.close()
            provider.server.close()
    run(scenario)


def test_an_entry_and_the_workers_copies_of_it_die_with_its_ttl(tmp_path, valkey_url):
    """ttl 1s, local copies on (their own ttl a minute): a hit at once, a miss once the second is over."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False, cache={"ttl": "1s"})
        try:
            question = body(uuid.uuid4().hex)
            await gateway.request("POST", CHAT, question)
            await until_stored(gateway)
            assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "hit"
            assert gateway.path.cache.local_hits == 1  # from the worker's copy
            await asyncio.sleep(1.2)
            assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "miss"
            assert provider.served == 2
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_waiters_are_bounded_in_time(tmp_path, valkey_url):
    """A leader slower than ``coalesce.wait`` (2 s against 150 ms): its waiters stop waiting after
    150 ms and go upstream on their own (misses), none with an error, all done long before the leader."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False, cache={"coalesce": {"wait": "150ms"}})
        try:
            question = body(uuid.uuid4().hex)
            slow = [("x-mock-latency-ms", "2000")]
            leader = asyncio.ensure_future(gateway.request("POST", CHAT, question, slow))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            waiters = await asyncio.gather(*(gateway.request("POST", CHAT, question) for _ in range(3)))
            waited = time.monotonic() - started
            assert [(answer.status, answer.headers["x-gridgate-cache"]) for answer in waiters] == [(200, "miss")] * 3
            assert 0.14 <= waited < 1.5, waited  # the bound, then their own quick answers: not the leader's 2 s
            assert (await leader).status == 200 and provider.served == 4
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_hit_takes_no_token_estimate_and_is_refused_once_the_request_limit_is_spent(tmp_path, valkey_url):
    """Request limit 2 a day: the miss and one hit take the two slots; the next repeat is refused with 429
    before the cache answers it (the hit counts against request limits). The hit reserved no tokens: the
    gate's estimated tokens did not move."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, requests_a_day=2)
        try:
            question = body(uuid.uuid4().hex)
            assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "miss"
            await until_stored(gateway)
            quota = gateway.path.quota
            estimated = quota.counters.tokens_estimated
            hit = await gateway.request("POST", CHAT, question)
            assert (hit.status, hit.headers["x-gridgate-cache"]) == (200, "hit")
            assert quota.counters.tokens_estimated == estimated  # no token estimate reserved for the hit
            assert await request_slots(gateway) == 0
            refused = await gateway.request("POST", CHAT, question)
            assert refused.status == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded", refused
            assert refused.headers.get("x-gridgate-cache") != "hit"
            assert provider.served == 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_with_the_cache_off_nothing_says_x_gridgate_cache(tmp_path, valkey_url):
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False, cache={"enabled": False})
        try:
            question = body(uuid.uuid4().hex)
            answers = [await gateway.request("POST", CHAT, question) for _ in range(2)]
            assert [answer.status for answer in answers] == [200, 200]
            assert all("x-gridgate-cache" not in answer.headers for answer in answers)
            assert gateway.path.cache is None and provider.served == 2
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_crashed_leaders_claim_holds_nobody_past_its_expiry(tmp_path, valkey_url, store):
    """Another host's leader claimed the key (its marker, ``PX`` 400 ms) and died: a request for that key
    waits, and goes upstream on its own once the marker has expired (not after its own 20 s wait); the next
    one leads, and its answer is stored."""
    from gateway.cache.key import cache_key
    from gateway.config.cache import Cache
    from workers.response_cache import PENDING

    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False, cache={"coalesce": {"wait": "20s"}})
        try:
            question = body(uuid.uuid4().hex)
            key = cache_key(Cache(enabled=True), "chat_completions", "anonymous", "m", json.dumps(question).encode(), {})
            assert key is not None
            store.set(key.key, PENDING + b"4242:1", px=400)  # the dead leader's claim
            started = time.monotonic()
            alone = await gateway.request("POST", CHAT, question)
            waited = time.monotonic() - started
            assert (alone.status, alone.headers["x-gridgate-cache"]) == (200, "miss")
            assert 0.3 <= waited < 3, waited
            assert provider.served == 1 and gateway.path.cache.stored == 0  # on its own: not stored
            leader = await gateway.request("POST", CHAT, question)
            assert leader.headers["x-gridgate-cache"] == "miss"
            await until_stored(gateway)
            assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "hit"
            assert provider.served == 2
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)
