"""Keys off the request path (docs/identity.md): the supervisor fetches a local IdP's discovery document and
JWKS and the workers follow what it writes. Key rotation mid-traffic fails no request, the IdP down or
answering garbage leaves traffic unaffected (the last good set serves; counted), an unknown kid refetches
at most once per 30 s, and two gateways share one budget for one JWT tenant.

Periods are shortened for the tests (``refresh`` of 1 s, an outage of a few seconds instead of 60 s): the
mechanism is the same at any period."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from tests.harness import candidate, chat, envelope, metric_value, mock_served, wait_until
from tests.jwt_idp import LocalIdp, SigningKey, claims

FAST = {"min": "1s", "max": "1s", "default": "1s", "early": 0.0, "retry": "1s", "timeout": "2s"}


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {token}")]


def _gateway(gateway_factory, provider, idp: LocalIdp, *, workers: int = 2, refresh: dict | None = None,
             extra: dict[str, Any] | None = None, **issuer: Any):
    entry = {"name": "corp", "issuer": idp.issuer, "audience": ["gridgate"], "oidc_discovery": True,
             "algorithms": ["RS256", "ES256"], "tenant_claim": "org", "refresh": refresh or FAST, **issuer}
    return gateway_factory({"p": [provider.address]}, envelope([candidate("m", "p")]), workers=workers,
                           extra={"auth": {"jwt": [entry]}, **(extra or {})})


class Traffic:
    """Requests in a loop on a thread, each with a token of the key the test currently signs with."""

    def __init__(self, port: int, issuer: str, key: SigningKey) -> None:
        self.port, self.issuer, self.key = port, issuer, key
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            token = self.key.sign(claims(self.issuer, jti=uuid.uuid4().hex))  # a fresh token: verified each time
            self.statuses.append(chat(self.port, "m", headers=_bearer(token)).status)
            time.sleep(0.02)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _fetches(gateway, outcome: str) -> float:
    return metric_value(gateway.admin_port, f'gridgate_jwks_fetches_total{{issuer="corp",outcome="{outcome}"}}')


def test_key_rotation_mid_traffic_fails_no_request(gateway_factory, mock_provider):
    old, new = SigningKey("RS256", "k1"), SigningKey("ES256", "k2")
    with LocalIdp(old, max_age=1) as idp:
        gateway = _gateway(gateway_factory, mock_provider("p"), idp)
        with Traffic(gateway.port, idp.issuer, old) as traffic:
            wait_until(lambda: len(traffic.statuses) >= 20, "traffic with the old key")
            idp.keys = [old, new]  # the IdP publishes the next key before it signs with it
            applied = _fetches(gateway, "applied")
            wait_until(lambda: _fetches(gateway, "applied") > applied, "the set with the new key fetched")
            time.sleep(0.6)  # the workers' next look at the file (every 250 ms)
            traffic.key = new  # the IdP signs with the new key from now on
            count = len(traffic.statuses)
            wait_until(lambda: len(traffic.statuses) >= count + 20, "traffic with the new key")
            idp.keys = [new]  # and retires the old one
            applied = _fetches(gateway, "applied")
            wait_until(lambda: _fetches(gateway, "applied") > applied, "the set without the old key fetched")
            count = len(traffic.statuses)
            wait_until(lambda: len(traffic.statuses) >= count + 20, "traffic after the old key left")
        assert len(traffic.statuses) >= 60 and set(traffic.statuses) == {200}, traffic.statuses
        stale = old.sign(claims(idp.issuer))
        refused = chat(gateway.port, "m", headers=_bearer(stale))
        assert refused.status == 401 and "(kid)" in refused.json()["error"]["message"]


def test_the_idp_down_or_answering_garbage_leaves_traffic_unaffected(gateway_factory, mock_provider):
    key = SigningKey("RS256", "k1")
    provider = mock_provider("p")
    with LocalIdp(key, max_age=1) as idp:
        gateway = _gateway(gateway_factory, provider, idp)
        served = mock_served(provider)
        with Traffic(gateway.port, idp.issuer, key) as traffic:
            wait_until(lambda: len(traffic.statuses) >= 10, "traffic")
            idp.mode = "down"
            wait_until(lambda: _fetches(gateway, "failed") >= 2, "failed fetches while the IdP is down")
            time.sleep(2)
            idp.mode = "garbage"
            failed = _fetches(gateway, "failed")
            wait_until(lambda: _fetches(gateway, "failed") >= failed + 2, "garbage refused")
            assert metric_value(gateway.admin_port, 'gridgate_jwks_up{issuer="corp"}') == 0
            time.sleep(1)
            idp.mode = "ok"
            wait_until(lambda: metric_value(gateway.admin_port, 'gridgate_jwks_up{issuer="corp"}') == 1, "up again")
        assert len(traffic.statuses) >= 40 and set(traffic.statuses) == {200}, traffic.statuses
        assert mock_served(provider) - served == len(traffic.statuses)
        log = gateway.log()
        assert log.count("key set fetch failed") == 1, log  # logged once per change of state
        assert log.count("key set fetched again") == 1, log


def test_an_unknown_kid_refetches_at_most_once_per_30_seconds(gateway_factory, mock_provider):
    first, second, third = SigningKey("RS256", "k1"), SigningKey("RS256", "k2"), SigningKey("RS256", "k3")
    slow = {"min": "1h", "max": "1h", "default": "1h"}
    with LocalIdp(first, max_age=3600) as idp:
        gateway = _gateway(gateway_factory, mock_provider("p"), idp, workers=1, refresh=slow)  # waits 2 s
        assert chat(gateway.port, "m", headers=_bearer(first.sign(claims(idp.issuer)))).status == 200
        fetched = idp.jwks_fetches
        idp.keys = [first, second]  # rotated without the gateway knowing: no refresh due for an hour
        token = second.sign(claims(idp.issuer))
        started = time.monotonic()
        assert chat(gateway.port, "m", headers=_bearer(token)).status == 200  # waited for the refetch it asked
        assert time.monotonic() - started < 2.0
        assert idp.jwks_fetches == fetched + 1
        idp.keys = [first, second, third]
        other = third.sign(claims(idp.issuer))
        for _ in range(3):  # new (or made-up) kids within 30 s: no further fetch; 401 once the wait is over
            started = time.monotonic()
            refused = chat(gateway.port, "m", headers=_bearer(other))
            assert refused.status == 401 and "(kid)" in refused.json()["error"]["message"]
            assert 1.9 <= time.monotonic() - started < 4.0
        assert idp.jwks_fetches == fetched + 1

    # unknown_kid_wait: 0 is today's immediate 401; the refetch it asked for admits the token next time.
    with LocalIdp(first, max_age=3600) as idp:
        gateway = _gateway(gateway_factory, mock_provider("p"), idp, workers=1, refresh=slow, unknown_kid_wait="0s")
        fetched = idp.jwks_fetches
        idp.keys = [first, second]
        token = second.sign(claims(idp.issuer))
        started = time.monotonic()
        assert chat(gateway.port, "m", headers=_bearer(token)).status == 401  # unknown kid: asks for a refetch
        assert time.monotonic() - started < 1.0
        wait_until(lambda: chat(gateway.port, "m", headers=_bearer(token)).status == 200, "refetched on the kid")
        assert idp.jwks_fetches == fetched + 1
        other = third.sign(claims(idp.issuer))
        for _ in range(20):
            assert chat(gateway.port, "m", headers=_bearer(other)).status == 401
        time.sleep(1.5)
        assert idp.jwks_fetches == fetched + 1


def test_two_gateways_share_one_budget_for_one_jwt_tenant(gateway_factory, mock_provider, valkey_url):
    key = SigningKey("ES256", "e1")
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    quota = {"backend": {"kind": "valkey", "url": valkey_url}, "reservation_timeout": "10s", "lease": None,
             "rules": [{"name": f"r-{tenant}", "match": {"tenant": tenant}, "requests": [{"window": "1m", "count": 5}]}]}
    provider = mock_provider("p")
    with LocalIdp(key) as idp:
        gateways = [_gateway(gateway_factory, provider, idp, workers=1, extra={"quota": quota}) for _ in range(2)]
        served = mock_served(provider)
        statuses = []
        for index in range(12):  # a fresh token each time, different subjects: one tenant's budget
            token = key.sign(claims(idp.issuer, org=tenant, sub=f"svc-{index}"))
            statuses.append(chat(gateways[index % 2].port, "m", headers=_bearer(token)).status)
        assert statuses.count(200) == 5 and statuses.count(429) == 7, statuses
        assert mock_served(provider) - served == 5
