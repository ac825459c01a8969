"""The console's tenants and keys page (docs/console.md#pages): what it shows and the key changes it
makes, all through the admin API (``AdminApp.dispatch_as``) as the signed-in token, so the scopes,
the checks and the audit log are the API's own. A scope the token lacks hides that part of the page.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from gateway.admin.console.chart import spend_chart
from gateway.admin.pages import AdminApp, AdminResponse
from gateway.admin.tokens import Caller

ACTIONS = ("block", "unblock", "revoke", "rotate")
MAX_TENANTS = 20  # tenants whose budgets and spend the page reads on each refresh
CHART_DAYS = 14


class KeysPage:
    def __init__(self, admin: AdminApp, clock: Callable[[], float] = time.time) -> None:
        self._admin = admin
        self._clock = clock

    async def view(self, caller: Caller) -> dict[str, Any]:
        scopes = caller.scopes
        view: dict[str, Any] = {"can_read": "keys:read" in scopes, "can_write": "keys:write" in scopes,
                                "can_spend": "spend:read" in scopes, "can_quota": "quota:read" in scopes,
                                "problems": [], "tenants": [], "spend": None}
        records: list[dict[str, Any]] = []
        if view["can_read"]:
            records = await self._read(caller, "/admin/keys?limit=1000", view["problems"], [])
            if isinstance(records, dict):
                records = records.get("data", [])
        today = datetime.fromtimestamp(self._clock(), UTC).date()
        if view["can_spend"]:
            view["spend"] = await self._spend(caller, "", today, view["problems"])
        tenants = sorted({record["tenant"] for record in records})
        for tenant in tenants[:MAX_TENANTS]:
            budgets = await self._budgets(caller, tenant, view["problems"]) if view["can_quota"] else None
            key_rows = [_key_row(r) for r in records if r["tenant"] == tenant]
            if budgets is not None:  # each managed key's own limits beside it, the tenant's rules above
                for row in key_rows:
                    row["left"] = [b for b in budgets if b["owner"] == f"key {row['kid']}"]
                budgets = [b for b in budgets if b["owner"] not in {f"key {row['kid']}" for row in key_rows}]
            view["tenants"].append({
                "name": tenant, "key_rows": key_rows, "budgets": budgets,
                "spend": await self._spend(caller, tenant, today, view["problems"]) if view["can_spend"] else None,
            })
        for tenant in tenants[MAX_TENANTS:]:
            view["tenants"].append({"name": tenant, "key_rows": [_key_row(r) for r in records if r["tenant"] == tenant],
                                    "budgets": None, "spend": None})
        return view

    async def _read(self, caller: Caller, target: str, problems: list[str], default: Any) -> Any:
        answer = await self._admin.dispatch_as(caller, "GET", target)
        if answer.status == 200:
            return msgspec.json.decode(answer.body)
        if answer.status != 404:  # 404: that part is off in this config (no quota, no store)
            problems.append(_message(answer))
        return default

    async def _spend(self, caller: Caller, tenant: str, today: Any, problems: list[str]) -> dict[str, Any] | None:
        since = datetime.fromordinal(today.toordinal() - CHART_DAYS + 1).date().isoformat()
        query = f"/admin/spend?group_by=day&from={since}&to={today.isoformat()}" + (f"&tenant={tenant}" if tenant else "")
        report = await self._read(caller, query, problems, None)
        return None if report is None else spend_chart(report["data"], today, CHART_DAYS)

    async def _budgets(self, caller: Caller, tenant: str, problems: list[str]) -> list[dict[str, Any]] | None:
        report = await self._read(caller, f"/admin/quota?tenant={tenant}", problems, None)
        return None if report is None else budget_rows(report)

    async def act(self, caller: Caller, path: str, form: dict[str, str]) -> tuple[AdminResponse, dict[str, Any]]:
        """A key change from a form: (the admin API's answer, a notice for the page). A created or rotated
        key's plaintext is in the notice, shown on the answer to this request and never again."""
        if path == "/console/keys/create":
            body = create_body(form)
            answer = await self._admin.dispatch_as(caller, "POST", "/admin/keys", msgspec.json.encode(body))
            done = "created"
        else:
            kid, _, action = path.removeprefix("/console/keys/").partition("/")
            if action not in ACTIONS:
                raise LookupError(path)
            body = {"grace": form["grace"]} if action == "rotate" and form.get("grace") else {}
            answer = await self._admin.dispatch_as(caller, "POST", f"/admin/keys/{kid}/{action}",
                                                   msgspec.json.encode(body))
            done = {"block": "blocked", "unblock": "unblocked", "revoke": "revoked", "rotate": "rotated"}[action]
        if answer.status >= 400:
            return answer, {"problem": _message(answer)}
        result = msgspec.json.decode(answer.body)
        record = result.get("record", result)
        return answer, {"done": done, "kid": record["kid"], "tenant": record["tenant"], "key": result.get("key")}


def create_body(form: dict[str, str]) -> dict[str, Any]:
    """``POST /admin/keys``'s body from the create form (empty fields left out: the API's defaults)."""
    body: dict[str, Any] = {"tenant": form.get("tenant", "").strip()}
    if alias := form.get("alias", "").strip():
        body["alias"] = alias
    if models := [glob.strip() for glob in form.get("models", "").split(",") if glob.strip()]:
        body["models"] = models
    if rpm := form.get("rpm", "").strip():
        body["limits"] = {"requests": [{"window": "1m", "count": int(rpm) if rpm.isdigit() else rpm}]}
    if expires := form.get("expires_at", "").strip():
        body["expires_at"] = expires
    return body


def budget_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """``/admin/quota``'s rules and keys as one row per limit: what it allows, what is left, when it resets."""
    rows = []
    for entry in (*report.get("rules", []), *report.get("keys", [])):
        owner = f"rule {entry['rule']}" if "rule" in entry else f"key {entry['key']}"
        for window in entry.get("windows", []):
            rows.append({"owner": owner, "what": f"tokens / {window['window_s']} s", "limit": window["limit"],
                         "remaining": window["remaining"], "reset_s": round(window["reset_s"])})
        for limit in entry.get("requests", []):
            rows.append({"owner": owner, "what": f"requests / {limit['window_s']} s", "limit": limit["count"],
                         "remaining": limit["remaining"], "reset_s": round(limit["full_in_s"])})
        for spend in entry.get("spend", []):
            rows.append({"owner": owner, "what": f"USD / {spend['period']}", "limit": spend["usd"],
                         "remaining": f"${spend['remaining_nusd'] / 1e9:.4f}", "reset_s": round(spend["reset_s"])})
    return rows


def _key_row(record: dict[str, Any]) -> dict[str, Any]:
    limits = record.get("limits") or {}
    parts = [f"{r['count']} req / {r['window']}" for r in limits.get("requests") or []]
    parts += [f"{t['tokens']} tokens / {t['window']}" for t in limits.get("budgets") or []]
    parts += [f"${s['usd']} / {s['period']}" for s in limits.get("spend") or []]
    if limits.get("max_in_flight"):
        parts.append(f"{limits['max_in_flight']} in flight")
    return {"kid": record["kid"], "alias": record.get("alias"), "status": record["status"],
            "models": ", ".join(record.get("models") or []) or "tenant's",
            "limits": "; ".join(parts) or "-", "expires_at": record.get("expires_at"),
            "last_used_at": record.get("last_used_at"), "created_by": record.get("created_by"), "left": None}


def _message(answer: AdminResponse) -> str:
    try:
        return str(msgspec.json.decode(answer.body)["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return f"the admin API answered {answer.status}"
