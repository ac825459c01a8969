"""Metrics: per-worker counter rows in shared memory, summed and rendered by the supervisor.

Import the submodules directly; this package imports nothing, so a worker never loads the renderer.

    catalogue  COUNTERS, MAX_CLUSTERS, ...   every family's cells in a row, bucket bounds, label lists
    labels     LabelRegistry                 stable name -> index maps (clusters, tenants) the supervisor owns
    writer     WorkerMetrics                 what a worker calls: a few integer additions per event
    render     render_prometheus             summed rows -> Prometheus text (prometheus_client exposition)
"""
