"""The admin pages as pure routing: what each page answers for what the supervisor reports."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.admin.pages import AdminApp, MetricsExposition, ReportUnavailable


class Sources:
    """What a supervisor would report; each test sets the parts it needs."""

    def __init__(self, *, ready: tuple[bool, str] = (True, "ok"), quota: bool = True) -> None:
        self.ready = ready
        self.quota = quota

    def readiness(self) -> tuple[bool, str]:
        return self.ready

    def overlay_report(self) -> dict[str, Any]:
        raise KeyError("a bug in a report")

    def endpoints_report(self) -> dict[str, Any]:
        return {"clusters": []}

    def quota_enabled(self) -> bool:
        return self.quota

    async def quota_report(self, tenant: str) -> dict[str, Any]:
        if tenant == "down":
            raise ReportUnavailable("quota backend unavailable: connection refused")
        return {"tenant": tenant}


def get(sources: Sources, target: str, method: str = "GET") -> tuple[int, Any, list[tuple[str, str]]]:
    response = asyncio.run(AdminApp(sources, MetricsExposition()).handle(method, target))
    body = json.loads(response.body) if response.content_type == "application/json" else response.body
    return response.status, body, response.headers


def test_readyz_carries_the_reason_while_not_ready():
    assert get(Sources(), "/readyz")[:2] == (200, {"status": "ready"})
    assert get(Sources(ready=(False, "1 of 2 workers have not reported ready")), "/readyz")[:2] == (
        503, {"status": "not_ready", "reason": "1 of 2 workers have not reported ready"})


def test_unknown_pages_and_methods_get_openai_shaped_errors():
    status, body, _ = get(Sources(), "/nowhere")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body, headers = get(Sources(), "/healthz", method="DELETE")
    assert status == 405 and ("allow", "GET, HEAD") in headers
    assert set(body["error"]) == {"message", "type", "code"}


def test_a_failing_report_is_a_500_not_a_dead_listener():
    status, body, _ = get(Sources(), "/admin/overlay")
    assert status == 500 and body["error"]["code"] == "internal_error"
    assert "KeyError" not in body["error"]["message"]  # internals stay in the supervisor log


def test_quota_page_needs_quota_and_a_tenant_and_says_when_the_backend_is_down():
    assert get(Sources(quota=False), "/admin/quota?tenant=t")[0] == 404
    assert get(Sources(), "/admin/quota")[0] == 400
    assert get(Sources(), "/admin/quota?tenant=team-a")[:2] == (200, {"tenant": "team-a"})
    status, body, _ = get(Sources(), "/admin/quota?tenant=down")
    assert status == 503 and body["error"]["code"] == "quota_backend_unavailable"
