"""Spend reporting (docs/pricing.md): what was spent, per day, tenant, key and model, and where it goes.

    rollups  the daily rollups' Valkey layout and a worker's batch between flushes (pure)
    report   ``/admin/spend``: its query, checked, and the rows grouped (pure)
    store    the rollups' reads and writes over a quota-backend client
    series   a worker's labelled spend counters for the metrics (bounded labels)
    webhook  the alert webhook's settings and its HTTP POST
"""
