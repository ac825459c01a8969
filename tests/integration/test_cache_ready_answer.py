"""A response cache hit answered from its ready bytes (gateway/cache/entry.py ``ReadyAnswer``: the head
template and the framed body made once per local copy, written in one piece) says exactly what the
general framing says: the same fields, the same body bytes (a stream's chunks and last chunk too), the
connection's keep-alive or close; the clients the ready bytes cannot answer (HTTP/1.0, a browser's CORS
fields) get the general framing. One worker's request path (tests/inprocess.py) on the session's Valkey."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from tests.inprocess import Client, InProcessGateway, start_provider
from tests.integration.test_response_cache import body, gateway_for, run, until_stored

ORIGIN = "https://app.example.com"


def wire(client: Client, version: str, question: dict[str, Any], headers: tuple[str, ...] = ()) -> None:
    payload = json.dumps(question).encode()
    head = [f"POST /v1/chat/completions HTTP/{version}", "host: gateway", "content-type: application/json",
            f"content-length: {len(payload)}", *headers]
    client.connection.data_received(("\r\n".join(head) + "\r\n\r\n").encode() + payload)


async def raw_answer(gateway: InProcessGateway, version: str, question: dict[str, Any],
                     headers: tuple[str, ...] = (), until_close: bool = False) -> tuple[bytes, list[str], bytes, Client]:
    """(start line, field lines, the body's wire bytes, the client) of one request's answer."""
    client = gateway.connect()
    wire(client, version, question, headers)
    if until_close:
        for _ in range(2000):
            if client.transport.closed:
                break
            await asyncio.sleep(0.005)
    else:
        await client.answered()
    head, _, rest = bytes(client.transport.out).partition(b"\r\n\r\n")
    start, *fields = head.decode("latin-1").split("\r\n")
    return start.encode(), fields, rest, client


def named(fields: list[str], name: str) -> list[str]:
    return [field for field in fields if field.lower().startswith(name + ":")]


def without(fields: list[str], *names: str) -> list[str]:
    return [field for field in fields if field.split(":", 1)[0].lower() not in names]


async def cached(tmp_path: Path, valkey_url: str, question: dict[str, Any], **extra: Any) -> tuple[InProcessGateway, Any]:
    provider = await start_provider("p", tokens=6)
    gateway = await gateway_for(tmp_path, provider, valkey_url, **extra)
    first = await gateway.request("POST", "/v1/chat/completions", question)
    assert first.status == 200 and first.headers["x-gridgate-cache"] == "miss"
    await until_stored(gateway)
    return gateway, provider


def test_a_ready_hit_has_the_general_framings_fields_and_bytes(tmp_path, valkey_url):
    """HTTP/1.1 (the ready bytes) and HTTP/1.0 (the general framing) hits of one entry: the same fields but
    the request id, the same body; the connection stays open for the next request."""
    async def scenario() -> None:
        question = body(uuid.uuid4().hex)
        gateway, provider = await cached(tmp_path, valkey_url, question)
        try:
            start, fields, payload, client = await raw_answer(gateway, "1.1", question)
            old_start, old_fields, old_payload, _ = await raw_answer(gateway, "1.0", question, until_close=True)
            assert start == old_start == b"HTTP/1.1 200 OK"
            assert named(fields, "x-gridgate-cache") == ["x-gridgate-cache: hit"]
            assert without(fields, "x-request-id") == without(old_fields, "x-request-id", "connection")
            assert named(fields, "content-length") == [f"content-length: {len(payload)}"]
            assert payload == old_payload and json.loads(payload)["object"] == "chat.completion"
            assert not client.transport.closed  # keep-alive: the next request on it is answered too
            client.transport.out.clear()
            wire(client, "1.1", question)
            again = await client.answered()
            assert again.headers["x-gridgate-cache"] == "hit" and again.body == payload
            assert provider.served == 1
            lines = gateway.access_lines()
            assert [line["cache"] for line in lines] == ["miss", "hit", "hit", "hit"]
            assert {line["bytes_out"] for line in lines[1:]} == {len(payload)}
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_ready_streamed_hit_is_the_general_framings_bytes(tmp_path, valkey_url):
    """A stream's ready hit and its general framing (an allowed origin's request: CORS fields) carry the
    same chunks byte for byte: the events in one chunk, then the last chunk."""
    async def scenario() -> None:
        question = body(uuid.uuid4().hex, stream=True)
        gateway, provider = await cached(tmp_path, valkey_url, question, cors={"allowed_origins": [ORIGIN]})
        try:
            _, fields, payload, _ = await raw_answer(gateway, "1.1", question)
            _, cors_fields, cors_payload, _ = await raw_answer(gateway, "1.1", question, (f"origin: {ORIGIN}",))
            assert payload == cors_payload and payload.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            assert named(fields, "transfer-encoding") == ["transfer-encoding: chunked"]
            assert named(cors_fields, "access-control-allow-origin") == [f"access-control-allow-origin: {ORIGIN}"]
            assert without(fields, "x-request-id") == without(cors_fields, "x-request-id", "access-control-allow-origin",
                                                              "access-control-expose-headers", "vary")
            assert provider.served == 1
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)


def test_a_ready_hit_asked_to_close_closes(tmp_path, valkey_url):
    async def scenario() -> None:
        question = body(uuid.uuid4().hex)
        gateway, provider = await cached(tmp_path, valkey_url, question)
        try:
            _, fields, payload, client = await raw_answer(gateway, "1.1", question, ("connection: close",),
                                                          until_close=True)
            assert named(fields, "connection") == ["connection: close"] and client.transport.closed
            assert named(fields, "x-gridgate-cache") == ["x-gridgate-cache: hit"] and payload
        finally:
            await gateway.close()
            provider.server.close()
    run(scenario)
