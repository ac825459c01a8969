"""No cross-tenant bytes through the upstream pool: two tenants take turns over one pooled connection
(max_connections: 1) to a deliberately broken upstream (loadtest/broken_upstream.py) that sends bytes
beyond its own framing, early, late or unasked. Every client gets exactly its own answer, and the
connection that carried a broken answer never carries the other tenant's request."""

from __future__ import annotations

import time

import pytest

from gateway.identity.auth import hash_api_key
from loadtest.broken_upstream import BrokenUpstream
from tests.harness import Client, Response, candidate, envelope

KEYS = {"tenant-a": "sk-tenant-a", "tenant-b": "sk-tenant-b"}
ROUNDS = 3
# HEAD is not one of the API routes a gateway forwards by default where clusters list their extra routes.
EXTRA_ROUTES = {"allowed_routes": ["HEAD /v1/chat/completions"]}


@pytest.fixture
def upstream():
    server = BrokenUpstream("clean").start()
    yield server
    server.stop()


@pytest.fixture
def pooled_gateway(upstream, gateway_factory):
    return gateway_factory(
        {"broken": [upstream.address]}, envelope([candidate("m", "broken")]), workers=1,
        cluster_options={"max_connections": 1, "connect_timeout": "5s", **EXTRA_ROUTES},
        extra={"auth": {"keys": [{"tenant": tenant, "key": hash_api_key(key)} for tenant, key in KEYS.items()]}},
    )


def ask(client: Client, tenant: str, tag: str, behaviour: str = "clean", method: str = "POST") -> Response:
    headers = [("Authorization", f"Bearer {KEYS[tenant]}"), ("X-Model", "m"), ("X-Tag", tag),
               ("X-Behaviour", behaviour)]
    return client.request(method, "/v1/chat/completions", None if method == "HEAD" else b"{}", headers)


# behaviour of tenant A's answer -> (A's method, A's expected status and body (``{tag}`` is A's tag),
# seconds B waits after A's answer before sending)
CASES = {
    # early bytes: a whole second response right behind the answer, in the same write
    "extra_after_length": ("POST", 200, "answer:{tag}", 0.0),
    "extra_after_chunked": ("POST", 200, "answer:{tag}", 0.0),
    "no_content_with_body": ("POST", 204, "", 0.0),
    # late bytes: the body of a bodiless answer arrives 50 ms later, while B's request is on its way
    "head_late_body": ("HEAD", 200, "", 0.0),
    "no_content_late_body": ("POST", 204, "", 0.0),
    "not_modified_late_body": ("POST", 304, "", 0.0),
    # a 100 head declaring a body (the bytes parse as A's answer), the provider's real answer 50 ms later
    "informational_with_body": ("POST", 200, "leak:{tag}", 0.0),
    # framing in doubt, or not reusable by nature, then more bytes 50 ms later
    "length_and_chunked": ("POST", 200, "answer:{tag}", 0.0),
    "http10_keep_alive": ("POST", 200, "answer:{tag}", 0.0),
    "close_delimited": ("POST", 200, "answer:{tag}", 0.0),
    # stray bytes: a whole response arrives unasked while the connection sits idle in the pool
    "late_extra": ("POST", 200, "answer:{tag}", 0.5),
}


@pytest.mark.parametrize("behaviour", list(CASES))
def test_no_tenant_receives_bytes_of_another_tenants_answer(behaviour, upstream, pooled_gateway):
    method, status, body, pause = CASES[behaviour]
    a, b = Client(pooled_gateway.port), Client(pooled_gateway.port)
    try:
        for turn in range(ROUNDS):
            tag_a, tag_b = f"a{turn}", f"b{turn}"
            answer_a = ask(a, "tenant-a", tag_a, behaviour, method)
            time.sleep(pause)
            answer_b = ask(b, "tenant-b", tag_b)
            assert (answer_a.status, answer_a.body) == (status, body.format(tag=tag_a).encode()), turn
            assert (answer_b.status, answer_b.body) == (200, f"answer:{tag_b}".encode()), turn
            # The connection that carried the broken answer was closed, not handed to tenant B.
            assert upstream.stats.connection_of(tag_b) != upstream.stats.connection_of(tag_a)
    finally:
        a.close()
        b.close()
    # Every request reached the provider exactly once, in order: nothing lost, nothing sent twice.
    assert upstream.stats.tags() == [tag for turn in range(ROUNDS) for tag in (f"a{turn}", f"b{turn}")]


@pytest.mark.parametrize("behaviour", ["clean", "chunked"])
def test_clean_answers_keep_one_connection_for_both_tenants(behaviour, upstream, pooled_gateway):
    a, b = Client(pooled_gateway.port), Client(pooled_gateway.port)
    try:
        for turn in range(ROUNDS):
            assert ask(a, "tenant-a", f"a{turn}", behaviour).body == f"answer:a{turn}".encode()
            assert ask(b, "tenant-b", f"b{turn}", behaviour).body == f"answer:b{turn}".encode()
    finally:
        a.close()
        b.close()
    assert upstream.stats.connections == 1  # the rules close what is in doubt, not what is clean
