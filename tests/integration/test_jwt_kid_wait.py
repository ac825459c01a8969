"""The worker-side wait on an unknown kid (``auth.jwt[].unknown_kid_wait``, docs/identity.md "Rotation"):
the IdP rotates to a new key and clients use tokens signed by it before the supervisor's scheduled
refresh: they are served within the bound, concurrent ones on one shared wait and one refetch, and a
pipelined request behind a waiting one is answered after it, in order. A real gateway (one worker), a
real mock provider, the test IdP on loopback, raw sockets for the pipelining."""

from __future__ import annotations

import json
import socket
import threading
import time

import h11

from tests.harness import candidate, chat, envelope
from tests.jwt_idp import LocalIdp, SigningKey, claims

HOURLY = {"min": "1h", "max": "1h", "default": "1h"}  # no scheduled refresh during the test


def _gateway(gateway_factory, provider, idp: LocalIdp, **issuer):
    entry = {"name": "corp", "issuer": idp.issuer, "audience": ["gridgate"], "oidc_discovery": True,
             "algorithms": ["ES256"], "tenant_claim": "org", "refresh": HOURLY, **issuer}
    return gateway_factory({"p": [provider.address]}, envelope([candidate("m", "p")]), workers=1,
                           extra={"auth": {"jwt": [entry]}})


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {token}")]


def _chat_request(token: str, request_id: str) -> bytes:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {token}\r\n"
            f"X-Request-Id: {request_id}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def _answers(sock: socket.socket, count: int) -> list[tuple[int, str, float]]:
    """(status, request id, seconds until it ended) of the next ``count`` answers on ``sock``."""
    conn, answers, started = h11.Connection(h11.CLIENT), [], time.monotonic()
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "gw")]))  # (the client side's state)
    conn.send(h11.EndOfMessage())
    status, request_id = 0, ""
    while len(answers) < count:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = sock.recv(65536)
            if not data:
                break
            conn.receive_data(data)
        elif isinstance(event, h11.Response):
            status = event.status_code
            request_id = dict(event.headers).get(b"x-request-id", b"").decode()
        elif isinstance(event, h11.EndOfMessage):
            answers.append((status, request_id, time.monotonic() - started))
            if conn.their_state is h11.MUST_CLOSE:
                break
            conn.start_next_cycle()
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "gw")]))
            conn.send(h11.EndOfMessage())
    return answers


def test_tokens_of_a_key_rotated_in_before_the_scheduled_refresh_are_served_on_one_shared_wait(
        gateway_factory, mock_provider):
    old, new = SigningKey("ES256", "k1"), SigningKey("ES256", "k2")
    with LocalIdp(old, max_age=3600) as idp:
        gateway = _gateway(gateway_factory, mock_provider("p"), idp, unknown_kid_wait="5s")
        assert chat(gateway.port, "m", headers=_bearer(old.sign(claims(idp.issuer)))).status == 200
        fetched = idp.jwks_fetches
        idp.keys = [old, new]  # rotated: the gateway's next scheduled refresh is an hour away
        tokens = [new.sign(claims(idp.issuer, sub=f"svc-{index}")) for index in range(8)]
        statuses: list[int] = []
        started = time.monotonic()
        threads = [threading.Thread(target=lambda t=token: statuses.append(chat(gateway.port, "m",
                                                                                headers=_bearer(t)).status))
                   for token in tokens]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        elapsed = time.monotonic() - started
        assert statuses == [200] * 8, statuses
        assert elapsed < 5.0, elapsed  # within the bound: the refetch, the file written and read
        assert idp.jwks_fetches == fetched + 1  # one refetch for all of them
    assert "Traceback" not in gateway.log()


def test_a_pipelined_request_behind_a_waiting_one_is_answered_after_it(gateway_factory, mock_provider):
    old, new, never = SigningKey("ES256", "k1"), SigningKey("ES256", "k2"), SigningKey("ES256", "k9")
    with LocalIdp(old, max_age=3600) as idp:
        gateway = _gateway(gateway_factory, mock_provider("p"), idp, unknown_kid_wait="3s")
        known = old.sign(claims(idp.issuer, sub="known"))
        assert chat(gateway.port, "m", headers=_bearer(known)).status == 200
        idp.keys = [old, new]
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            # Three requests in one write: the first waits for the kid, the two behind it wait their turn.
            sock.sendall(_chat_request(new.sign(claims(idp.issuer)), "first") + _chat_request(known, "second")
                         + _chat_request(known, "third"))
            answers = _answers(sock, 3)
        assert [(status, rid) for status, rid, _ in answers] == [(200, "first"), (200, "second"), (200, "third")]

        # A kid the IdP never publishes: 401 once the wait is over (the refetch budget is spent), and the
        # connection closes, unanswered requests behind it never read.
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            sock.sendall(_chat_request(never.sign(claims(idp.issuer)), "unknown") + _chat_request(known, "after"))
            answers = _answers(sock, 2)
        assert [(status, rid) for status, rid, _ in answers] == [(401, "unknown")], answers
        assert 2.9 <= answers[0][2] < 5.0, answers
    assert "Traceback" not in gateway.log()
