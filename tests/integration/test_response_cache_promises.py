"""The promises of docs/cache.md that tests/integration/test_response_cache.py left without a test that can
fail: an entry is never read by a request that says ``no-store`` or ``bypass``; answers over ``max_entry``,
cut streams, chat streams without their [DONE] and streams ending in an error event are never stored; an
alias and its target share entries; a seed or ``only_deterministic: false`` makes a request cacheable; an
entry dies with its TTL (and so do the workers' copies of it); waiters are bounded in time; a crashed
leader's claim holds nobody past its expiry; a hit takes no token estimate and is refused once the request
limit is spent; a miss and a hit cost the Valkey calls the docs say; with the cache off nothing says
``x-gridgate-cache``. One worker's request path in this process, real mock providers on loopback, the
session's real Valkey (the call counts: a Valkey of the test's own)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from tests.harness import candidate
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

            def token_counters() -> tuple[int, ...]:
                counters, tenants = quota.counters, quota.tenant_tokens
                return (counters.tokens_estimated, counters.tokens_actual, counters.tokens_refunded,
                        counters.tokens_overage, sum(tenants.tokens_in), sum(tenants.tokens_out))

            await quota.drain()  # the miss's settlement counted
            before = token_counters()
            assert before[1] > 0 and before[4] > 0  # the miss's prompt counted: the counters are live
            hit = await gateway.request("POST", CHAT, question)
            assert (hit.status, hit.headers["x-gridgate-cache"]) == (200, "hit")
            await quota.drain()
            assert token_counters() == before  # no estimate, no charge, no tokens in or out for the hit
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


# What this test's own counting clients send (their connection's AUTH and SETINFO, the reset itself).
# Not the cache's own calls: the counting's, and ``until_stored``'s sync (a PING on each connection, its
# replies turned on and off again on the one in CLIENT REPLY OFF).
_COUNTING = frozenset(("auth", "client|setinfo", "config|resetstat", "info", "hello", "ping", "client|reply"))


def commands_counted(url: str) -> dict[str, int]:
    """The calls of each command the Valkey at ``url`` served since its last ``CONFIG RESETSTAT``."""
    import valkey

    client = valkey.Valkey.from_url(url)
    try:
        return {name: stats["calls"] for name, stats in
                ((name.removeprefix("cmdstat_"), stats) for name, stats in client.info("commandstats").items())
                if name not in _COUNTING}
    finally:
        client.close()


def reset_counts(url: str) -> None:
    import valkey

    client = valkey.Valkey.from_url(url)
    try:
        client.config_resetstat()
    finally:
        client.close()


def test_what_a_miss_and_a_hit_cost_in_valkey_calls(tmp_path, keys_store):
    """docs/cache.md, "What a hit costs": a miss is one ``SET NX PX GET`` (the lookup and the claim) and
    one ``SET`` of the entry (on the connection in CLIENT REPLY OFF: nobody reads its reply); a hit one
    command (the same lookup, which finds the entry); a hit from the worker's local copy none. With
    coalescing off the lookup is a plain ``GET``. Counted by the cache's own Valkey (``INFO commandstats``),
    nothing else using it."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5)
        url = keys_store.url
        plain = tmp_path / "plain"
        plain.mkdir()
        claims = await gateway_for(tmp_path, provider, url, quota=False, cache={"local": None})
        gets = await gateway_for(plain, provider, url, quota=False, cache={"local": None, "coalesce": {"enabled": False}})
        try:
            for gateway, miss, hit in ((claims, {"set": 2}, {"set": 1}), (gets, {"get": 1, "set": 1}, {"get": 1})):
                await gateway.request("POST", CHAT, body(uuid.uuid4().hex))  # its connection made
                await until_stored(gateway)
                question = body(uuid.uuid4().hex)
                reset_counts(url)
                assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "miss"
                await until_stored(gateway, 2)
                assert commands_counted(url) == miss
                reset_counts(url)
                assert (await gateway.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "hit"
                assert commands_counted(url) == hit
        finally:
            await claims.close()
            await gets.close()
        (tmp_path / "copies").mkdir()
        copies = await gateway_for(tmp_path / "copies", provider, url, quota=False)
        try:
            question = body(uuid.uuid4().hex)
            await copies.request("POST", CHAT, question)
            await until_stored(copies)
            reset_counts(url)
            assert (await copies.request("POST", CHAT, question)).headers["x-gridgate-cache"] == "hit"
            assert commands_counted(url) == {}
        finally:
            await copies.close()
            provider.server.close()
    run(scenario)


def test_a_chat_stream_without_its_done_is_never_stored(tmp_path, valkey_url):
    """A provider whose chat streams end without ``data: [DONE]`` (the mock's ``no_done``): relayed, never
    stored, so each repeat reaches the provider (a whole stream is stored: test_response_cache.py)."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=5, nonconformance="no_done")
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)
        try:
            question = body(uuid.uuid4().hex, stream=True)
            answers = [await gateway.request("POST", CHAT, question) for _ in range(2)]
            assert all(answer.status == 200 and b"[DONE]" not in answer.body for answer in answers)
            assert [answer.headers["x-gridgate-cache"] for answer in answers] == ["miss", "miss"]
            await asyncio.sleep(0.05)
            assert provider.served == 2 and gateway.path.cache.stored == 0
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


MESSAGES_FAILED_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message","role":'
    b'"assistant","model":"m","content":[],"usage":{"input_tokens":5,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"text",'
    b'"text":""}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":"Hel"}}\n\n'
    b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n')


class FailingStreams:
    """A provider on loopback that answers every request 200 with a Messages stream that ends in an error
    event (as Anthropic's does when it fails mid-answer): whole, with its length, the connection kept."""

    def __init__(self) -> None:
        self.name = "failing"
        self.served = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> FailingStreams:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def address(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.served += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%b"
                             % (len(MESSAGES_FAILED_STREAM), MESSAGES_FAILED_STREAM))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_a_stream_that_ends_in_an_error_event_is_never_stored(tmp_path, valkey_url):
    """A Messages stream answered 200 that ends with ``event: error``: relayed as it came, never stored."""
    async def scenario() -> None:
        provider = await FailingStreams().start()
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)  # type: ignore[arg-type]
        try:
            question = {"model": "m", "max_tokens": 16, "temperature": 0, "stream": True,
                        "messages": [{"role": "user", "content": uuid.uuid4().hex}]}
            headers = [("anthropic-version", "2023-06-01")]
            answers = [await gateway.request("POST", "/v1/messages", question, headers) for _ in range(2)]
            assert all(answer.status == 200 and b"event: error" in answer.body for answer in answers), answers
            assert [answer.headers["x-gridgate-cache"] for answer in answers] == ["miss", "miss"]
            await asyncio.sleep(0.05)
            assert provider.served == 2 and gateway.path.cache.stored == 0
            assert [line.get("error") for line in gateway.access_lines()] == ["upstream_error_event"] * 2
        finally:
            await gateway.close()
            assert provider.server is not None
            provider.server.close()
    run(scenario)


def test_a_hit_of_an_answer_a_fallback_made_names_the_model_that_made_it(tmp_path, valkey_url):
    """Model m with the chain [n]: m's provider fails, n answers, and the answer is stored under m's key.
    The hit says the model that made it (``x-gridgate-model: n``, the access line's ``served_model``), as
    the miss did, with no moves of its own (``x-gridgate-fallback-hops: 0``), and reaches neither provider."""
    from tests.harness import envelope as overlay_of
    from tests.inprocess import InProcessGateway

    async def scenario() -> None:
        failing = await start_provider("p-m", tokens=5, fail_rate=1.0)
        serving = await start_provider("p-n", tokens=5)
        overlay = overlay_of([candidate("m", "p-m"), candidate("n", "p-n")], "deterministic")
        gateway = await InProcessGateway.start(
            tmp_path, {"p-m": [failing.address], "p-n": [serving.address]}, overlay,
            extra={"routing": {"retry": {"attempts": 2, "deadline": "10s", "backoff": {"base": "1ms", "max": "5ms"}}},
                   "models": {"fallbacks": {"m": {"chain": ["n"], "on": ["unavailable"]}}},
                   "cache": {"enabled": True, "backend": {"url": valkey_url}}})
        try:
            question = body(uuid.uuid4().hex)
            miss = await gateway.request("POST", CHAT, question)
            assert (miss.status, miss.headers["x-gridgate-cache"], miss.headers["x-gridgate-model"]) == (200, "miss", "n")
            await until_stored(gateway)
            served = (failing.served, serving.served)
            hit = await gateway.request("POST", CHAT, question)
            assert (hit.headers["x-gridgate-cache"], hit.body) == ("hit", miss.body)
            assert (hit.headers["x-gridgate-model"], hit.headers["x-gridgate-fallback-hops"]) == ("n", "0")  # no moves
            assert (failing.served, serving.served) == served
            lines = gateway.access_lines()
            assert [line.get("served_model") for line in lines] == ["n", "n"]
        finally:
            await gateway.close()
            failing.server.close()
            serving.server.close()
    run(scenario)


def test_identical_streams_in_flight_share_one_upstream_call_and_replay_its_events(tmp_path, valkey_url):
    """Streamed requests coalesce too: the waiters get the leader's stream, event for event, as hits."""
    async def scenario() -> None:
        provider = await start_provider("p", tokens=8, latency_ms=300)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False)
        try:
            question = body(uuid.uuid4().hex, stream=True)
            answers = await asyncio.gather(*(gateway.request("POST", CHAT, question) for _ in range(5)))
            assert sorted(answer.headers["x-gridgate-cache"] for answer in answers) == ["hit"] * 4 + ["miss"]
            assert all(answer.complete and answer.headers["content-type"].startswith("text/event-stream")
                       for answer in answers)
            (stream,) = {answer.body for answer in answers}
            assert stream.endswith(b"data: [DONE]\n\n") and stream.count(b"data: ") > 8
            assert provider.served == 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_waiters_of_a_leader_whose_answer_is_too_large_go_on_at_once(tmp_path, valkey_url):
    """The leader's answer is over ``max_entry``: not stored, so its waiters (on its worker) are released
    the moment it ends and go upstream on their own, long before their 20 s wait; none gets an error."""
    async def scenario() -> None:
        provider = await start_provider("p", latency_ms=300)
        gateway = await gateway_for(tmp_path, provider, valkey_url, quota=False,
                                    cache={"max_entry": 1500, "coalesce": {"wait": "20s"}})
        try:
            question = body(uuid.uuid4().hex)
            large = [("x-mock-tokens", "300")]
            started = time.monotonic()
            answers = await asyncio.gather(*(gateway.request("POST", CHAT, question, large) for _ in range(4)))
            assert [answer.status for answer in answers] == [200] * 4
            assert [answer.headers["x-gridgate-cache"] for answer in answers] == ["miss"] * 4
            assert time.monotonic() - started < 5
            assert provider.served == 4 and gateway.path.cache.stored == 0
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)
