"""Cooling at the right scope through a real gateway, two workers and real mock providers
(docs/routing.md, "Cooling"): a 429 from one endpoint of a provider cools that endpoint on every
worker, and the provider keeps serving through its other endpoint.

The request path's side: the relay reads the answer's head with
``gateway.routing.cooling.cooling_signals``, the request's close cools with
``workers.cooling.cool_for_answer``, and each attempt leaves ``ProviderStates.cooled_endpoints`` out.
"""

from __future__ import annotations

import threading
import time

from tests.harness import chat, mock_served, request
from tests.integration.test_failover import FAST_RETRY, deterministic


def admin_config(handle, **settings) -> None:
    status, _, body = request("127.0.0.1", handle.port, "POST", "/admin/config", settings)
    assert status == 200, body


def test_a_429_from_one_endpoint_cools_that_endpoint_on_every_worker_and_the_provider_keeps_serving(
        mock_provider, gateway_factory):
    limited = mock_provider("limited-replica", fail_rate=1.0, fail_status=429, retry_after="30")
    healthy = mock_provider("healthy-replica")
    other = mock_provider("other")
    gateway = gateway_factory({"provider": [limited.address, healthy.address], "other": [other.address]},
                              deterministic("provider", "other"), workers=2, extra=FAST_RETRY)
    # Round robin inside the provider: within a few requests a worker tries the limited replica, whose
    # 429 is held back and the request served by the next provider.
    for _ in range(8):
        if chat(gateway.port, "m").headers["x-gridgate-provider"] == "other":
            break
    else:
        raise AssertionError("the limited replica was never tried")
    time.sleep(0.3)  # every worker refreshes its view of the shared cells within 0.1 s
    limited_before, healthy_before = mock_served(limited), mock_served(healthy)
    answers = [chat(gateway.port, "m") for _ in range(10)]  # fresh connections: both workers answer
    assert [(r.status, r.headers["x-gridgate-provider"], r.headers["x-gridgate-attempts"]) for r in answers] == [
        (200, "provider", "1")] * 10
    assert mock_served(limited) == limited_before  # cooled on every worker: no request reached it
    assert mock_served(healthy) == healthy_before + 10


class RateLimitedReplica:
    """An endpoint answering every request 429 with the provider's credential out of requests."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner = self
        self.answered = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                owner.answered += 1
                body = b'{"error": {"message": "Rate limit reached for requests", "type": "requests"}}'
                self.send_response(429)
                for name, value in (("Retry-After", "30"), ("x-ratelimit-limit-requests", "500"),
                                    ("x-ratelimit-remaining-requests", "0"), ("Content-Type", "application/json"),
                                    ("Content-Length", str(len(body)))):
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_429_saying_the_providers_credential_is_out_of_requests_cools_the_whole_provider(
        mock_provider, gateway_factory):
    replica = RateLimitedReplica()
    healthy = mock_provider("healthy-replica")
    other = mock_provider("other")
    try:
        gateway = gateway_factory({"provider": [replica.address, healthy.address], "other": [other.address]},
                                  deterministic("provider", "other"), workers=2, extra=FAST_RETRY)
        for _ in range(8):
            if replica.answered:
                break
            chat(gateway.port, "m")
        assert replica.answered, "the rate-limited replica was never tried"
        time.sleep(0.3)
        healthy_before = mock_served(healthy)
        answers = [chat(gateway.port, "m") for _ in range(6)]
        # Every endpoint shares the credential: its healthy sibling would be refused too, so the
        # provider is skipped as a whole on every worker.
        assert {(r.status, r.headers["x-gridgate-provider"]) for r in answers} == {(200, "other")}
        assert mock_served(healthy) == healthy_before
    finally:
        replica.close()
