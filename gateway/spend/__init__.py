"""Spend reporting (docs/pricing.md): what was spent, per day, tenant, key and model.

    rollups  the daily rollups' Valkey layout and a worker's batch between flushes (pure)
    report   ``/admin/spend``: its query, checked, the rows grouped, the CLI's table (pure)
    store    the rollups' reads and writes over a quota-backend client
    series   a worker's spend counters for the metrics (bounded labels) and the supervisor's sums
    price_book  ``PriceBook``: which price a model has (overrides, the shipped table, the unpriced policy)
    alerts   a budget threshold crossed: the worker's side, queued for the supervisor over the status pipe

The worker side is workers/spend_tracker.py; the supervisor side gateway/supervisor/spend.py (metrics,
report reads) and gateway/supervisor/spend_alerts.py (the alert webhook).
"""
