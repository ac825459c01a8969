"""Spend per tenant per day, from a gateway's ``GET /admin/spend`` (docs/pricing.md, "Spend reports").

    GRIDGATE_ADMIN_TOKEN=... python -m loadtest.spend_plot --admin 127.0.0.1:9901 [--from D] [--to D]
        [--out spend.svg] [--text] [--top 8]

Draws stacked bars (one colour per tenant, the ``--top`` tenants by cost, the rest as ``others``) to an
SVG with matplotlib when it is installed (``pip install -e .[bench]``), else prints a text chart; ``--text``
prints the text chart in any case. One report call lists the tenants, then one per tenant gives its days.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Sequence

from gateway.keys.admin_client import DEFAULT_ADMIN, TOKEN_ENV, AdminCallFailed, AdminClient, connect_address

OTHERS = "others"
BAR_WIDTH = 50


def days_between(first: str, last: str) -> list[str]:
    start, end = dt.date.fromisoformat(first), dt.date.fromisoformat(last)
    return [(start + dt.timedelta(days=n)).isoformat() for n in range((end - start).days + 1)]


def spend_by_tenant_and_day(client: AdminClient, first: str | None, last: str | None,
                            top: int) -> tuple[list[str], dict[str, dict[str, int]]]:
    """(the days, tenant -> day -> nano-USD) for the ``top`` tenants by cost, the rest under ``others``."""
    window = {"from": first, "to": last}
    tenants = client.call("GET", "/admin/spend", query={**window, "group_by": "tenant"})
    ranked = sorted(tenants["data"], key=lambda row: (-row["cost_nusd"], row["tenant"]))
    series: dict[str, dict[str, int]] = {}
    for index, row in enumerate(ranked):
        name = row["tenant"] if index < top else OTHERS
        days = client.call("GET", "/admin/spend", query={**window, "tenant": row["tenant"], "group_by": "day"})
        cells = series.setdefault(name, {})
        for day in days["data"]:
            cells[day["day"]] = cells.get(day["day"], 0) + day["cost_nusd"]
    return days_between(tenants["from"], tenants["to"]), series


def text_chart(days: Sequence[str], series: dict[str, dict[str, int]]) -> str:
    """One line per day with spend: the day, its total in USD, and a bar made of each tenant's letter."""
    letters = {tenant: chr(ord("A") + index) for index, tenant in enumerate(series)}
    totals = {day: sum(cells.get(day, 0) for cells in series.values()) for day in days}
    peak = max(totals.values(), default=0)
    lines = [f"{letters[tenant]} = {tenant}" for tenant in series]
    for day in days:
        if not totals[day]:
            continue
        bar = ""
        for tenant, cells in series.items():
            bar += letters[tenant] * round(BAR_WIDTH * cells.get(day, 0) / peak)
        lines.append(f"{day}  {totals[day] / 1e9:>12.6f} USD  {bar}")
    if len(lines) == len(series):
        lines.append("(no spend in this range)")
    return "\n".join(lines)


def svg_chart(path: str, days: Sequence[str], series: dict[str, dict[str, int]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadtest.plots import COLOURS, SVG_STYLE

    with plt.rc_context(SVG_STYLE):
        figure, axis = plt.subplots(figsize=(max(6.0, 0.25 * len(days)), 4))
        bottoms = [0.0] * len(days)
        for index, (tenant, cells) in enumerate(series.items()):
            values = [cells.get(day, 0) / 1e9 for day in days]
            axis.bar(range(len(days)), values, bottom=bottoms, label=tenant, color=COLOURS[index % len(COLOURS)])
            bottoms = [a + b for a, b in zip(bottoms, values, strict=True)]
        step = max(1, len(days) // 10)
        axis.set_xticks(range(0, len(days), step), [days[i][5:] for i in range(0, len(days), step)])
        axis.set_ylabel("USD per day")
        axis.set_title(f"spend per tenant, {days[0]} .. {days[-1]} (UTC)")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.spend_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--admin", default=DEFAULT_ADMIN, metavar="HOST:PORT", help="the admin listener")
    parser.add_argument("--from", dest="first", metavar="YYYY-MM-DD")
    parser.add_argument("--to", dest="last", metavar="YYYY-MM-DD")
    parser.add_argument("--top", type=int, default=8, help="tenants drawn apart (the rest: others)")
    parser.add_argument("--out", default="spend.svg", help="the SVG to write (with matplotlib)")
    parser.add_argument("--text", action="store_true", help="print the text chart, matplotlib or not")
    args = parser.parse_args(argv)
    client = AdminClient(connect_address(args.admin), os.environ.get(TOKEN_ENV) or None)
    try:
        days, series = spend_by_tenant_and_day(client, args.first, args.last, max(1, args.top))
    except AdminCallFailed as exc:
        print(f"spend_plot: {exc}", file=sys.stderr)
        return 1
    if not args.text:
        try:
            print(svg_chart(args.out, days, series))
            return 0
        except ImportError:
            print("(matplotlib is not installed: a text chart instead)", file=sys.stderr)
    print(text_chart(days, series))
    return 0


if __name__ == "__main__":
    sys.exit(main())
