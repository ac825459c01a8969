"""The Valkey overlay source on its own (gateway/overlay/valkey_source.py), against real Valkey servers:
read at start, follow publish notifications, poll, reject bad documents, ride out an outage."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import valkey

from gateway.overlay.valkey_source import (
    OverlayCache,
    OverlaySourceError,
    ValkeyOverlaySource,
    digest_of,
    events_channel,
    redact_url,
)
from gateway.valkey.embedded import EmbeddedValkey
from tests.harness import candidate, envelope

SCOPE = {"network": "test-net", "local_site": "site-a"}


def overlay(*clusters: str, generation: int = 1, **options: Any) -> bytes:
    return json.dumps(envelope([candidate("m", c) for c in clusters], generation=generation, **options)).encode()


def revision_of(data: bytes) -> str:
    return json.loads(data)["revision"]["value"]


@pytest.fixture
def key() -> str:
    return f"gridgate:overlay:source-{uuid.uuid4().hex[:8]}"


def publish(store: valkey.Valkey, key: str, data: bytes, notify: bool = True) -> None:
    store.set(key, data)
    if notify:
        store.publish(events_channel(key), "new")  # a notice only; the key holds the document


async def eventually(predicate: Any, timeout: float = 3.0) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not predicate():
        if loop.time() - started > timeout:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)
    return loop.time() - started


def cached(path: Path) -> str | None:
    return revision_of(path.read_bytes()) if path.exists() else None


def test_follows_publishes_at_once_polls_for_silent_writes_and_keeps_last_known_good(
    tmp_path: Path, valkey_url: str, store: valkey.Valkey, key: str, caplog: pytest.LogCaptureFixture,
) -> None:
    cache_path = tmp_path / "cache.json"
    first, second, third = overlay("a"), overlay("a", "b"), overlay("b")
    publish(store, key, first)

    async def scenario() -> None:
        source = ValkeyOverlaySource(valkey_url, key, OverlayCache(str(cache_path), SCOPE), poll_interval=1.0)
        assert await source.open() == "valkey"
        assert cached(cache_path) == revision_of(first)
        follower = asyncio.create_task(source.run())
        try:
            await eventually(lambda: source.up)
            publish(store, key, second)
            took = await eventually(lambda: cached(cache_path) == revision_of(second))
            assert took < 0.5  # the notification, not the 1 s poll

            # Rejected (scope, digest, garbage): the cache keeps the last good document, each logged once.
            foreign = overlay("c", network="other-net", local_site="site-a")
            tampered = json.loads(third)
            tampered["content_digest"]["value"] = "0" * 64
            for bad in (foreign, json.dumps(tampered).encode(), b"{not json"):
                publish(store, key, bad)
                await eventually(lambda bad=bad: source.rejected is not None and source.rejected[0] == digest_of(bad))
            await asyncio.sleep(1.2)  # a poll re-reads the garbage: not logged or counted again
            assert cached(cache_path) == revision_of(second)
            assert source.outcomes["rejected"] == 3
            assert caplog.text.count("overlay source rejected the document") == 3
            assert "scope_mismatch" in caplog.text and "digest_mismatch" in caplog.text

            publish(store, key, third, notify=False)  # a silent SET: the poll finds it
            took = await eventually(lambda: cached(cache_path) == revision_of(third), timeout=2.5)
            assert took > 0.1
            assert source.outcomes["applied"] == 3  # the first (at open), the second, the third
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await source.close()

    with caplog.at_level(logging.INFO, logger="gridgate.overlay"):
        asyncio.run(scenario())


def test_same_revision_rerendered_refreshes_the_cache(tmp_path: Path, valkey_url: str, store: valkey.Valkey,
                                                      key: str) -> None:
    cache_path = tmp_path / "cache.json"
    publish(store, key, overlay("a", generation=1))

    async def scenario() -> None:
        source = ValkeyOverlaySource(valkey_url, key, OverlayCache(str(cache_path), SCOPE), poll_interval=1.0)
        await source.open()
        follower = asyncio.create_task(source.run())
        try:
            publish(store, key, overlay("a", generation=2))
            await eventually(lambda: json.loads(cache_path.read_bytes())["provenance"]["source_generation"] == 2)
            assert (source.outcomes["applied"], source.outcomes["refreshed"]) == (1, 1)  # the first at open, then the refresh
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await source.close()

    asyncio.run(scenario())


def test_start_without_valkey_serves_the_cache_else_the_fallback_file_else_fails(tmp_path: Path) -> None:
    dead = "valkey://127.0.0.1:1/0"
    cache_path = tmp_path / "cache.json"

    def open_source(fallback: str | None = None) -> str:
        source = ValkeyOverlaySource(dead, "k", OverlayCache(str(cache_path), SCOPE), timeout=0.5)

        async def run() -> str:
            try:
                return await source.open(fallback)
            finally:
                await source.close()
        return asyncio.run(run())

    with pytest.raises(OverlaySourceError) as info:
        open_source()
    message = str(info.value)
    assert message.startswith("routing.overlay_source: no overlay to serve: valkey://127.0.0.1:1/0 key k: "
                              "Valkey unreachable (")
    assert "no cached overlay (unreadable:" in message and "\n" not in message

    fallback = tmp_path / "fallback.json"
    fallback.write_bytes(overlay("a"))
    assert open_source(str(fallback)) == "overlay_file"
    assert cached(cache_path) == revision_of(overlay("a"))  # the fallback became the cache
    assert open_source() == "cache"  # the next start finds it

    cache_path.write_bytes(overlay("z", network="other-net"))  # a cache from another scope is no good
    with pytest.raises(OverlaySourceError, match="scope_mismatch"):
        open_source()


def test_an_outage_keeps_last_known_good_and_a_publish_after_recovery_is_picked_up(
    tmp_path: Path, key: str, caplog: pytest.LogCaptureFixture,
) -> None:
    server = EmbeddedValkey(tmp_path / "valkey", unix_socket=False)
    url = server.start()
    store = valkey.Valkey.from_url(url)
    cache_path = tmp_path / "cache.json"
    publish(store, key, overlay("a"))

    async def scenario() -> None:
        source = ValkeyOverlaySource(url, key, OverlayCache(str(cache_path), SCOPE), poll_interval=0.5)
        await source.open()
        follower = asyncio.create_task(source.run())
        try:
            await eventually(lambda: source.up)
            await asyncio.to_thread(server.stop)
            await eventually(lambda: not source.up)
            assert source.outages == 1 and cached(cache_path) == revision_of(overlay("a"))
            await asyncio.sleep(1.0)  # reconnect attempts with backoff: still one outage
            assert source.outages == 1
            assert await asyncio.to_thread(server.start) == url
            await asyncio.to_thread(publish, store, key, overlay("b"))
            await eventually(lambda: cached(cache_path) == revision_of(overlay("b")), timeout=3.0)
            assert source.up and source.outages == 1
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await source.close()

    try:
        with caplog.at_level(logging.INFO, logger="gridgate.overlay"):
            asyncio.run(scenario())
    finally:
        store.close()
        server.stop()
    assert caplog.text.count("unreachable") == 1
    assert "reachable again after" in caplog.text
    assert ":" + url.split(":")[2].split("@")[0] not in caplog.text  # the password never reaches a log


def test_redact_url_hides_credentials_and_options() -> None:
    assert redact_url("valkeys://user:secret@h:6380/2?ssl_cert_reqs=none") == "valkeys://***@h:6380/2"
    assert redact_url("unix:///run/valkey.sock") == "unix:///run/valkey.sock"


# -- a hostile writer of the key: oversized values and floods of notifications ----------------------


@pytest.fixture
def private_valkey(tmp_path: Path) -> Any:
    """A Valkey of this test alone, so its command and traffic counters are this test's."""
    server = EmbeddedValkey(tmp_path / "valkey", unix_socket=False)
    url = server.start()
    store = valkey.Valkey.from_url(url)
    try:
        yield url, store
    finally:
        store.close()
        server.stop()


READ_COMMANDS = ("get", "getrange", "strlen", "eval", "evalsha", "fcall")  # however a source reads a key


def reads_and_bytes_sent(store: valkey.Valkey) -> tuple[int, int]:
    """(reads of the key by the source, bytes Valkey sent to all its clients) since the last reset.

    A read uses each of these commands once at most (a script's own GET counts too), so the reads are
    the most calls of any of them."""
    stats = store.info("commandstats")
    calls = max(stats.get(f"cmdstat_{command}", {}).get("calls", 0) for command in READ_COMMANDS)
    return calls, store.info("stats")["total_net_output_bytes"]


def test_an_oversized_value_is_never_fetched_and_is_judged_once(
    tmp_path: Path, private_valkey: Any, key: str, caplog: pytest.LogCaptureFixture,
) -> None:
    url, store = private_valkey
    cache_path = tmp_path / "cache.json"
    good = overlay("a")
    publish(store, key, good)

    async def scenario() -> None:
        source = ValkeyOverlaySource(url, key, OverlayCache(str(cache_path), SCOPE), poll_interval=0.3,
                                     min_read_interval=0.05)
        await source.open()
        follower = asyncio.create_task(source.run())
        try:
            await eventually(lambda: source.up)
            huge = b"{" + b" " * (48 * 1024 * 1024) + b"}"  # 48 MiB, 24 times the bound
            await asyncio.to_thread(publish, store, key, huge)
            del huge
            await asyncio.to_thread(store.config_resetstat)
            for _ in range(20):  # notifications and polls: each a read of the key, none a fetch
                await asyncio.to_thread(store.publish, events_channel(key), "new")
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.7)  # two polls more
            reads, sent = await asyncio.to_thread(reads_and_bytes_sent, store)
            assert reads >= 3  # the source kept reading the key ...
            assert sent < 256 * 1024  # ... and not one of those reads brought the value along
            assert source.outcomes["rejected"] == 1  # judged once, not once per read
            assert source.rejected is not None and "too_large" in source.rejected[1]
            assert cached(cache_path) == revision_of(good)  # last-known-good keeps serving
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await source.close()

    with caplog.at_level(logging.INFO, logger="gridgate.overlay"):
        asyncio.run(scenario())
    assert caplog.text.count("overlay source rejected the document") == 1
    assert "too_large" in caplog.text and "(not read)" in caplog.text


def test_a_flood_of_notifications_costs_a_bounded_number_of_reads_and_the_last_document_wins(
    tmp_path: Path, private_valkey: Any, key: str,
) -> None:
    url, store = private_valkey
    cache_path = tmp_path / "cache.json"
    publish(store, key, overlay("a"))
    last = overlay("b", generation=2)
    min_interval = 0.2

    def flood(count: int) -> float:
        """``count`` notifications as fast as Valkey takes them, the new document SET halfway; seconds taken."""
        started = time.monotonic()
        pipe = store.pipeline(transaction=False)
        for index in range(count):
            if index == count // 2:
                pipe.set(key, last)
            pipe.publish(events_channel(key), "new")
            if index % 500 == 499:
                pipe.execute()
        pipe.execute()
        return time.monotonic() - started

    async def scenario() -> None:
        source = ValkeyOverlaySource(url, key, OverlayCache(str(cache_path), SCOPE), poll_interval=30.0,
                                     min_read_interval=min_interval)
        await source.open()
        follower = asyncio.create_task(source.run())
        try:
            await eventually(lambda: source.up)
            await asyncio.to_thread(store.config_resetstat)
            started = time.monotonic()
            took = await asyncio.to_thread(flood, 10_000)
            await eventually(lambda: cached(cache_path) == revision_of(last), timeout=5.0)
            await asyncio.sleep(2 * min_interval)  # a read still queued would have happened by now
            elapsed = time.monotonic() - started
            reads, _ = await asyncio.to_thread(reads_and_bytes_sent, store)
            # One read per min_interval while the flood lasts, one in flight, one queued behind it.
            assert 1 <= reads <= elapsed / min_interval + 2, (reads, took, elapsed)
            assert reads < 100
            assert source.outcomes["applied"] == 2 and source.outcomes["rejected"] == 0
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await source.close()

    asyncio.run(scenario())


class EndlessNotices:
    """valkey-py's pub/sub as a flood that never pauses sees it: a message every time it is asked."""

    def __init__(self) -> None:
        self.taken = 0

    async def get_message(self, timeout: float | None = 0.0) -> dict[str, Any]:
        self.taken += 1
        await asyncio.sleep(0)  # as a real read yields to the loop
        return {"type": "message", "data": b"new"}


def test_a_flood_that_never_pauses_still_gets_the_key_read_once_per_interval(tmp_path: Path) -> None:
    source = ValkeyOverlaySource("valkey://127.0.0.1:1/0", "k", OverlayCache(str(tmp_path / "c.json"), SCOPE),
                                 poll_interval=30.0, min_read_interval=0.1)

    async def scenario() -> tuple[float, int]:
        notices = EndlessNotices()
        loop = asyncio.get_running_loop()
        source._last_read = loop.time()
        started = loop.time()
        await asyncio.wait_for(source._wait_for_news(notices), timeout=2.0)  # returns: the read may happen
        return loop.time() - started, notices.taken

    waited, taken = asyncio.run(scenario())
    assert 0.1 <= waited < 0.5  # the minimum interval, then notices consumed for at most as long again
    assert taken > 10
