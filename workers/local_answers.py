"""The routes the gateway answers itself, each with its own handler, chosen from the head's route kind
(``gateway.request.routes``): a request of these kinds runs no step of the proxied path.

- ``MODELS``: ``GET /v1/models`` (the models the caller may use) and ``GET /v1/models/{id}``, from the
  serving overlay (docs/models.md);
- ``KEY``: ``GET /v1/gridgate/key``, the caller's own key and what its limits have left (docs/keys.md).

Answered before this module: a CORS preflight (workers/cors_gate.py, at the head, before the key is
checked) and a malformed or refused head (workers/server.py). The health and readiness pages are the
supervisor's, on the admin listener (gateway/admin/), never a worker's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import unquote_to_bytes

from gateway.http.errors import ErrorReply
from gateway.quota.gate import QuotaGate
from gateway.quota.report import QuotaBackendUnavailable, spend_of
from gateway.request.routes import KEY, MODELS
from gateway.routing.plan import model_not_found
from gateway.routing.tenants import Policy
from workers.head_gate import Admitted
from workers.key_gate import key_answer
from workers.model_access import may_use
from workers.outcomes import Outcomes
from workers.overlay_follower import OverlayFollower
from workers.request_record import RequestRecord

# A gateway-made answer to a request of its route kind.
LocalAnswer = Callable[[RequestRecord, Admitted, Policy], Awaitable[None]]
_JSON_HEADER = (b"content-type", b"application/json")
_MODELS_PATH = b"/v1/models"
_MODEL_PREFIX = b"/v1/models/"


class LocalAnswers:
    """One per worker: ``by_kind`` maps a route kind to its handler."""

    def __init__(self, *, overlay: OverlayFollower, quota: QuotaGate | None, outcomes: Outcomes) -> None:
        self.overlay = overlay
        self.quota = quota
        self.outcomes = outcomes
        self.by_kind: dict[int, LocalAnswer] = {MODELS: self.models, KEY: self.key}

    async def models(self, record: RequestRecord, admitted: Admitted, policy: Policy) -> None:
        """The model list the caller may use (a managed key's ``models`` narrow its tenant's), or one
        model object; 404 ``model_not_found`` for a model not served or not allowed."""
        target = record.exchange.target.split(b"?", 1)[0]
        managed = admitted.managed
        if target == _MODELS_PATH:
            body = self.overlay.models_body(policy, None if managed is None or managed.models is None
                                            else managed.allows_model)
        else:
            model = unquote_to_bytes(target[len(_MODEL_PREFIX):]).decode("utf-8", "replace")
            body = None
            if target.startswith(_MODEL_PREFIX):
                body = self.overlay.model_body(model, lambda name: may_use(policy, managed, name))
            if body is None:
                return self.outcomes.refuse(record, model_not_found("inference_model", model))
        self._answer(record, body)

    async def key(self, record: RequestRecord, admitted: Admitted, policy: Policy) -> None:
        """The caller's own key; 401 without one. ``remaining`` is the quota's reading of the key's
        limits and its tenant's rules (one ledger call), null without a quota block or when its backend
        does not answer in time."""
        key = admitted.key
        if key is None:
            return self.outcomes.refuse(record, ErrorReply(401, "invalid_api_key", "GET /v1/gridgate/key "
                                                           "needs an API key: auth is not configured"))
        remaining = spend = None
        if self.quota is not None:
            try:
                report = await self.quota.key_report(key)
                remaining = {"rules": report["rules"], "keys": report["keys"]}
                spend = spend_of(report)
            except QuotaBackendUnavailable:
                pass
        if not record.exchange.client_gone:
            self._answer(record, key_answer(key, admitted.managed, remaining=remaining, spend=spend))

    @staticmethod
    def _answer(record: RequestRecord, body: bytes) -> None:
        record.status = 200
        record.exchange.respond(200, [_JSON_HEADER, (b"x-request-id", record.request_id)], body)
