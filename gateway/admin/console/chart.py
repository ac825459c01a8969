"""Spend per day as the geometry of an inline SVG bar chart (the template draws the rects): no chart
library, no script, nothing the CSP has to allow. Pure."""

from __future__ import annotations

from datetime import date, timedelta
from typing import Any

from gateway.pricing.units import format_usd

WIDTH, HEIGHT = 640, 160
_TOP, _BOTTOM, _LEFT = 14, 20, 4  # room for the largest value above and the day labels below


def spend_chart(rows: list[dict[str, Any]], today: date, days: int = 14) -> dict[str, Any]:
    """Bars of ``cost_nusd`` for the ``days`` days up to ``today`` (days without rollups are 0), from a
    ``GET /admin/spend?group_by=day`` answer's ``data``."""
    by_day = {row["day"]: row for row in rows}
    span = [today - timedelta(days=days - 1 - n) for n in range(days)]
    costs = [int(by_day.get(day.isoformat(), {}).get("cost_nusd", 0)) for day in span]
    requests = [int(by_day.get(day.isoformat(), {}).get("requests", 0)) for day in span]
    peak = max(costs) or 1
    plot = HEIGHT - _TOP - _BOTTOM
    step = (WIDTH - _LEFT) / days
    bars = []
    for index, (day, cost, count) in enumerate(zip(span, costs, requests, strict=True)):
        height = round(plot * cost / peak, 1)
        bars.append({
            "x": round(_LEFT + index * step + 1, 1), "w": round(step - 2, 1),
            "y": round(_TOP + plot - height, 1), "h": height,
            "label": day.strftime("%m-%d") if (days - 1 - index) % 2 == 0 else "",  # every other day
            "label_x": round(_LEFT + (index + 0.5) * step, 1),
            "title": f"{day.isoformat()}: ${format_usd(cost)} ({count} requests)",
        })
    return {"width": WIDTH, "height": HEIGHT, "label_y": HEIGHT - 6, "bars": bars,
            "peak": f"${format_usd(max(costs))}", "total": f"${format_usd(sum(costs))}", "requests": sum(requests)}
