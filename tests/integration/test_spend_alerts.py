"""Spend alerts delivered (docs/pricing.md, "Alerts"): a worker publishes an alert, its status pipe takes
it to the supervisor, and the supervisor posts it to a real local webhook with retries and backoff.

Here the alerts are published through the worker's test-only hook, so each test chooses how many arrive
and when: ``GRIDGATE_TEST_SPEND_ALERTS`` (workers/spend_tracker.py) holds alerts each worker publishes
with ``publish_alert`` at its first tick. Everything after ``publish_alert`` is the real path. Alerts
found by the ledger when real requests cross a budget's thresholds are tested end to end in
test_spend_e2e.py (webhook, metric and access log).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.harness import candidate, envelope, metric_value

ALERT = {"tenant": "team-a", "scope": "rule team-a", "budget": "$10.00/1d", "period_start": "2026-12-01T00:00:00Z",
         "threshold": 0.8, "spent_nusd": 8_000_000_000, "limit_nusd": 10_000_000_000}


class Webhook:
    """A local HTTP server that records the JSON bodies POSTed to it; ``status`` is what it answers.

    With ``listening=False`` its port is bound but refuses every connection until ``listen()``: a webhook
    that is down, then comes up on the same port. (A port found free and left unbound meanwhile could be
    taken by any process of the run, a gateway started in the test among them.)"""

    def __init__(self, status: int = 200, *, listening: bool = True) -> None:
        self.received: list[dict[str, Any]] = []
        self.status = status
        self.attempts = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server interface
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.attempts += 1
                if hook.status == 200:
                    hook.received.append({"body": json.loads(body), "auth": self.headers.get("Authorization")})
                self.send_response(hook.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
        self.server.server_bind()
        self.thread: threading.Thread | None = None
        if listening:
            self.listen()

    def listen(self) -> None:
        self.server.server_activate()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.server.shutdown()
        self.server.server_close()


def alerting_gateway(gateway_factory, providers, webhook: dict[str, Any], alerts: list[dict[str, Any]]):
    overlay = envelope([candidate("m", "provider-a")])
    return gateway_factory({"provider-a": [providers["provider-a"].address]}, overlay, workers=2,
                           extra={"pricing": {"alerts_webhook": webhook}},
                           env={"GRIDGATE_TEST_SPEND_ALERTS": json.dumps(alerts)})


def deliveries(gateway, outcome: str) -> float:
    return metric_value(gateway.admin_port, f'gridgate_spend_alert_deliveries_total{{outcome="{outcome}"}}')


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_webhook_receives_every_alert_of_every_worker(gateway_factory, providers):
    hook = Webhook()
    try:
        url = f"http://127.0.0.1:{hook.server.server_port}/alerts"
        second = {**ALERT, "tenant": "team-b", "threshold": 1.0}
        gateway = alerting_gateway(gateway_factory, providers, {"url": url, "headers": {"Authorization": "Bearer x"}},
                                   [ALERT, second])
        assert wait_for(lambda: len(hook.received) == 4), hook.received  # two alerts from each of two workers
        bodies = [entry["body"] for entry in hook.received]
        assert sorted(body["tenant"] for body in bodies) == ["team-a", "team-a", "team-b", "team-b"]
        assert {json.dumps(body, sort_keys=True) for body in bodies} == {
            json.dumps({"type": "gridgate.spend_alert", **alert}, sort_keys=True) for alert in (ALERT, second)}
        assert {entry["auth"] for entry in hook.received} == {"Bearer x"}
        assert wait_for(lambda: deliveries(gateway, "delivered") == 4)
        assert deliveries(gateway, "failed") == 0 and deliveries(gateway, "dropped") == 0
    finally:
        hook.stop()


def test_a_webhook_down_for_a_while_gets_the_alert_after_retries(gateway_factory, providers):
    hook = Webhook(status=503, listening=False)  # nothing listens there yet: connections are refused
    try:
        gateway = alerting_gateway(gateway_factory, providers,
                                   {"url": f"http://127.0.0.1:{hook.server.server_port}/", "retries": 30,
                                    "backoff": "100ms", "max_backoff": "400ms"}, [ALERT])
        time.sleep(1.5)  # a few attempts fail meanwhile
        assert deliveries(gateway, "delivered") == 0 and deliveries(gateway, "failed") == 0
        hook.listen()  # up, but failing: still retried
        assert wait_for(lambda: hook.attempts >= 2)
        hook.status = 200
        assert wait_for(lambda: len(hook.received) == 2)
        assert [entry["body"]["budget"] for entry in hook.received] == ["$10.00/1d", "$10.00/1d"]
        assert wait_for(lambda: deliveries(gateway, "delivered") == 2)
        assert deliveries(gateway, "failed") == 0
    finally:
        hook.stop()


def test_a_webhook_down_past_the_retries_counts_a_failure(gateway_factory, providers):
    hook = Webhook(listening=False)
    try:
        gateway = alerting_gateway(gateway_factory, providers,
                                   {"url": f"http://127.0.0.1:{hook.server.server_port}/", "retries": 2,
                                    "backoff": "100ms"}, [ALERT])
        assert wait_for(lambda: deliveries(gateway, "failed") == 2)  # one alert per worker, 3 attempts each
        assert deliveries(gateway, "delivered") == 0
        hook.listen()  # up again later: the failed alerts are gone, as counted
        time.sleep(1.0)
        assert hook.received == []
    finally:
        hook.stop()
