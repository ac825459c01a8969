"""``GET /admin/spend`` (docs/keys.md, docs/pricing.md): spend from the daily rollups, grouped by day,
model, key or tenant, scope ``spend:read``.

The token check and scope live in ``pages.AdminApp``; the query and grouping in ``gateway.spend.report``;
the reads in the supervisor's ``SpendReporter``. Answers: 400 naming the parameter, 404 when no store
holds rollups (no quota block and no ``auth.store``), 503 when the store does not answer.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from gateway.admin.pages import AdminResponse, error_response, json_response
from gateway.spend.report import QueryProblem, SpendQuery

log = logging.getLogger("gridgate.admin")


class SpendSource(Protocol):
    """What the supervisor provides the page (``gateway.supervisor.spend.SpendReporter``)."""

    def enabled(self) -> bool: ...

    def query(self, query: dict[str, list[str]]) -> SpendQuery: ...

    async def report(self, query: SpendQuery) -> dict[str, Any]: ...


class SpendApi:
    def __init__(self, source: SpendSource) -> None:
        self._source = source

    async def handle(self, query: dict[str, list[str]]) -> AdminResponse:
        from gateway.valkey.client import BACKEND_ERRORS, describe_error

        if not self._source.enabled():
            return error_response(404, "spend reports need a store for their rollups: a quota block, or "
                                       "auth.store", "spend_reports_disabled")
        try:
            parsed = self._source.query(query)
        except QueryProblem as exc:
            return error_response(400, str(exc), "invalid_request")
        try:
            return json_response(200, await self._source.report(parsed))
        except BACKEND_ERRORS as exc:
            log.warning("admin: spend store unavailable: %s", describe_error(exc))
            return error_response(503, "the spend store is unavailable; retry later", "spend_store_unavailable",
                                  "server_error")
