"""What the console's providers and endpoints pages show, as plain data (the templates render it and
``/console/api/<page>`` answers it as JSON). Pure: built from the serving overlay's snapshot and the
``/admin/endpoints`` and ``/admin/overlay`` documents.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.admin.console.traffic import Shares
from gateway.overlay.snapshot import Snapshot
from gateway.pricing.units import format_usd

_UP = frozenset({"healthy", "slow_start", "half_open"})


def cluster_totals(endpoints_doc: dict[str, Any]) -> dict[str, int]:
    """Cumulative requests per cluster, all endpoints and workers together (for ``TrafficShare``)."""
    return {cluster["name"]: sum(e.get("requests", 0) for e in cluster["endpoints"])
            for cluster in endpoints_doc.get("clusters", [])}


def cluster_states(endpoints_doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per cluster: a health word, in-flight requests and the latest cooling end of its endpoints."""
    states = {}
    for cluster in endpoints_doc.get("clusters", []):
        endpoints = cluster["endpoints"]
        words = [e.get("health", "unknown") for e in endpoints]
        up = sum(word in _UP for word in words)
        if all(word == "unknown" for word in words):
            health = "unknown"
        elif up == len(words):
            health = "healthy"
        else:
            health = "unhealthy" if up == 0 else "degraded"
        cooled = [e["cooled_until"] for e in endpoints if e.get("cooled_until")]
        states[cluster["name"]] = {
            "health": health, "healthy_endpoints": up, "endpoints": len(endpoints),
            "in_flight": sum(e.get("in_flight", 0) for e in endpoints),
            "cooling_until": max(cooled) if cooled else None,
        }
    return states


def providers_view(snapshot: Snapshot | None, endpoints_doc: dict[str, Any], overlay_doc: dict[str, Any],
                   shares: Shares, overlay_age_s: float | None) -> dict[str, Any]:
    """Capabilities, each with its selection groups and their providers, and the overlay's revision."""
    states = cluster_states(endpoints_doc)
    capabilities = []
    for capability in () if snapshot is None else snapshot.capabilities.values():
        if not capability.name:
            continue  # the MCP session route, not a capability of the overlay
        groups = capability.groups or tuple(_Ungrouped(c) for c in capability.members)
        capabilities.append({
            "kind": capability.kind, "name": capability.name, "serving_group": capability.serving_group,
            "groups": [{
                "number": group.number, "admission": group.admission,
                "serving": _serving(capability, group),
                "providers": [_provider(c, states, shares) for c in group.members],
            } for group in groups],
        })
    revision = overlay_doc.get("serving_revision")
    return {
        "overlay": {"revision": revision, "revision_short": (revision or "-")[:12],
                    "age_s": None if overlay_age_s is None else round(overlay_age_s, 1),
                    "age": None if overlay_age_s is None else age_text(overlay_age_s),
                    "mode": overlay_doc.get("mode"), "converged": overlay_doc.get("converged")},
        "traffic": {"requests": shares.requests, "window_s": round(shares.window_s)},
        "capabilities": capabilities,
    }


def age_text(seconds: float) -> str:
    """``42 s``, ``5 min``, ``3 h``, ``7 d``: an age read at a glance."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


class _Ungrouped:
    """An ungrouped capability's candidate shown as a group of its own (number None)."""

    def __init__(self, candidate: Any) -> None:
        self.number = None
        self.admission = candidate.admission
        self.members = (candidate,)


def _serving(capability: Any, group: Any) -> bool:
    if group.number is None:
        return bool(capability.serving) and capability.serving[0] is group.members[0]
    return capability.serving_group == group.number


def _provider(candidate: Any, states: dict[str, dict[str, Any]], shares: Shares) -> dict[str, Any]:
    state = states.get(candidate.cluster)
    share = shares.by_cluster.get(candidate.cluster)
    return {
        "cluster": candidate.cluster, "site": candidate.site, "stable_id": candidate.stable_id,
        "admission": candidate.admission, "configured": state is not None,
        "health": "not configured" if state is None else state["health"],
        "healthy_endpoints": None if state is None else f"{state['healthy_endpoints']}/{state['endpoints']}",
        "in_flight": 0 if state is None else state["in_flight"],
        "cooling_until": None if state is None else state["cooling_until"],
        "share_percent": None if share is None else round(share * 100, 1),
    }


def endpoints_view(endpoints_doc: dict[str, Any]) -> dict[str, Any]:
    """The ``/admin/endpoints`` document with what the page shows of it."""
    clusters = [{
        "name": cluster["name"], "strategy": cluster["strategy"], "panic": cluster["panic"],
        "healthy_endpoints": cluster["healthy_endpoints"],
        "endpoints": [{
            "address": e["address"], "health": e.get("health", "unknown"),
            "active_check": e.get("active_check", "-"), "in_flight": e.get("in_flight", 0),
            "requests": e.get("requests", 0), "weight_permille": e.get("weight_permille"),
            "ejection": (e.get("ejection") or {}).get("state", "-"),
            "ejected_until": (e.get("ejection") or {}).get("until"),
            "cooled_until": e.get("cooled_until"),
            "failures": sum((e.get("failures") or {}).values()),
        } for e in cluster["endpoints"]],
    } for cluster in endpoints_doc.get("clusters", [])]
    return {"health_process": endpoints_doc.get("health_process"), "clusters": clusters}


def requests_view(rows: list[dict[str, Any]], limit: int = 100) -> dict[str, Any]:
    """The last requests the workers reported, newest first, as the page shows them."""
    return {"requests": [{
        **row,
        "ended": datetime.fromtimestamp(row["ended_at"], UTC).strftime("%H:%M:%S.%f")[:-3],
        "group": "-" if row["group"] is None else row["group"],
        "latency": "-" if row["latency_ms"] is None else f"{row['latency_ms']:.1f} ms",
        "tokens": "-" if row["tokens_prompt"] is None and row["tokens_completion"] is None
        else f"{row['tokens_prompt'] or 0} / {row['tokens_completion'] or 0}",
        "cost": "-" if row["cost_nusd"] is None else f"${format_usd(row['cost_nusd'])}",
    } for row in rows[:limit]], "shown": min(limit, len(rows))}
