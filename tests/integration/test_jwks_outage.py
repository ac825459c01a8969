"""The IdP down for 60 s (docs/identity.md, "Keys off the request path"): traffic with a token already
verified and with fresh tokens signed by a known key keeps flowing without one failure, while every
refresh fails (the key set's max-age, 5 s, is far shorter than the outage: counted, logged once), and
after the IdP is back a key it publishes then is used. A real gateway (one worker), a real mock provider,
the test IdP on loopback: its port closed for 25 s, then answering 503 for 20 s, then hanging for 15 s (the
fetches time out).

Real time, by design (the outage of the issue is 60 s): the test mostly sleeps, at 5 requests a second."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tests.harness import candidate, chat, envelope, metric_value, mock_served, wait_until
from tests.integration.test_jwks_feed import _fetches
from tests.jwt_idp import LocalIdp, SigningKey, claims

REFRESH = {"min": "1s", "max": "1m", "default": "5s", "early": 0.2, "retry": "2s", "timeout": "1s"}
PHASES = (("stopped", 25.0), ("down", 20.0), ("hang", 15.0))  # 60 s in all
RATE_S = 0.2  # 5 requests a second


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {token}")]


class Traffic:
    """5 requests a second on a thread, alternating a token verified before the outage (the worker's
    cache) and a fresh one (a new ``jti``: verified in full against the kept key set)."""

    def __init__(self, port: int, issuer: str, key: SigningKey) -> None:
        self.port, self.issuer, self.key = port, issuer, key
        self.reused = key.sign(claims(issuer, sub="reuser", lifetime=900))
        self.results: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        fresh = False
        while not self._stop.is_set():
            token = self.key.sign(claims(self.issuer, sub="fresh", jti=uuid.uuid4().hex)) if fresh else self.reused
            try:
                status = chat(self.port, "m", headers=_bearer(token)).status
            except OSError as exc:  # counted as a failure, never lost
                status = -1
                print("request failed:", exc)
            self.results.append(("fresh" if fresh else "reused", status))
            fresh = not fresh
            self._stop.wait(RATE_S)

    def __enter__(self) -> Traffic:
        self.port_check = chat(self.port, "m", headers=_bearer(self.reused)).status  # verified before the outage
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _up(gateway) -> float:
    return metric_value(gateway.admin_port, 'gridgate_jwks_up{issuer="corp"}')


@pytest.mark.timeout(180)
def test_sixty_seconds_without_the_idp_fail_no_request_and_a_key_published_after_is_used(gateway_factory,
                                                                                         mock_provider):
    key, later = SigningKey("ES256", "k1"), SigningKey("ES256", "k2")
    provider = mock_provider("p")
    with LocalIdp(key, max_age=5) as idp:
        entry = {"name": "corp", "issuer": idp.issuer, "audience": ["gridgate"], "oidc_discovery": True,
                 "algorithms": ["ES256"], "tenant_claim": "org", "refresh": REFRESH}
        gateway = gateway_factory({"p": [provider.address]}, envelope([candidate("m", "p")]), workers=1,
                                  extra={"auth": {"jwt": [entry]}})
        served = mock_served(provider)
        with Traffic(gateway.port, idp.issuer, key) as traffic:
            assert traffic.port_check == 200
            wait_until(lambda: len(traffic.results) >= 10, "traffic before the outage")
            failed_before = _fetches(gateway, "failed")
            started = time.monotonic()
            for mode, seconds in PHASES:
                if mode == "stopped":
                    idp.stop_serving()
                else:
                    idp.resume_serving()
                    idp.mode = mode
                time.sleep(seconds)
                assert _up(gateway) == 0, f"the issuer still up after {time.monotonic() - started:.0f} s ({mode})"
            outage_s = time.monotonic() - started
            failed = _fetches(gateway, "failed") - failed_before
            during = len(traffic.results)
            idp.mode = "ok"
            wait_until(lambda: _up(gateway) == 1, "the key set fetched again", timeout=15)

            # Back: the IdP publishes a new key and signs with it; the gateway has it at its next refresh
            # (max-age 5 s), with no unknown kid seen before.
            applied = _fetches(gateway, "applied")
            idp.keys = [key, later]
            wait_until(lambda: _fetches(gateway, "applied") > applied, "the set with the new key fetched", timeout=15)
            time.sleep(0.6)  # the worker's next look at the file (every 250 ms)
            newest = later.sign(claims(idp.issuer, sub="after"))
            assert chat(gateway.port, "m", headers=_bearer(newest)).status == 200
            count = len(traffic.results)
            wait_until(lambda: len(traffic.results) >= count + 10, "traffic after the outage")

    statuses = [status for _, status in traffic.results]
    assert outage_s >= 60
    assert set(statuses) == {200}, [result for result in traffic.results if result[1] != 200]
    kinds = {kind for kind, _ in traffic.results[:during]}
    assert kinds == {"fresh", "reused"} and during >= 0.8 * 60 / RATE_S, during  # ~5/s through the outage
    assert mock_served(provider) - served == len(statuses) + 2  # the check before, the new key's after
    # A refresh every retry (2 s) plus up to its timeout (1 s) while the IdP hung: each one failed, counted.
    assert 15 <= failed <= 60 / 2 + 1, failed
    log = gateway.log()
    assert log.count("key set fetch failed") == 1, log  # one line per change of state, not per retry
    assert log.count("key set fetched again") == 1, log
    assert "Traceback" not in log
