"""The response cache through a real gateway (supervisor, worker, managed keys, the bundled Valkey) and a
real mock provider: a key revoked after its answer was cached cannot read it (docs/cache.md)."""

from __future__ import annotations

import json
import uuid

from tests.harness import candidate, envelope, mock_served, request
from tests.integration.test_keys_e2e import TOKENS, admin


def test_a_key_revoked_after_its_answer_was_cached_cannot_read_it(gateway_factory, mock_provider, keys_store):
    handle = mock_provider("provider-a")
    extra = {"auth": {}, "admin": {"tokens": TOKENS}, "workers": 1,
             "quota": {"backend": {"kind": "valkey", "url": keys_store.url}, "lease": None,
                       "rules": [{"name": "r", "budgets": [{"window": "1m", "tokens": 1_000_000}]}]},
             "cache": {"enabled": True}}
    gateway = gateway_factory({"provider-a": [handle.address]}, envelope([candidate("m", "provider-a")]), extra=extra)
    status, created = admin(gateway, "POST", "/admin/keys", {"tenant": "team-c"})
    assert status == 201
    kid, secret = created["record"]["kid"], created["key"]
    body = {"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}], "temperature": 0}
    auth = [("Authorization", f"Bearer {secret}")]
    states = []
    for _ in range(3):
        status, headers, _ = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body, auth)
        assert status == 200
        states.append(dict(headers)["x-gridgate-cache"])
    assert states[0] == "miss" and states[-1] == "hit"  # (the second may race the store of the first)
    served = mock_served(handle)
    status, _ = admin(gateway, "POST", f"/admin/keys/{kid}/revoke")
    assert status == 200
    status, headers, data = request("127.0.0.1", gateway.port, "POST", "/v1/chat/completions", body, auth)
    assert status == 401 and json.loads(data)["error"]["code"] == "key_revoked"
    assert dict(headers).get("x-gridgate-cache") != "hit"
    assert mock_served(handle) == served
