"""The admin listener (docs/operations.md#admin-listener), run by the supervisor on its own loop.

    pages    ``AdminApp``: pure routing of the pages, ``AdminSources`` (what the supervisor provides),
             ``MetricsExposition`` (the pluggable /metrics page)
    server   ``AdminServer``: HTTP/1.1 on the socket the supervisor bound
    quota    ``QuotaReporter``: the quota page's client of the shared ledger
"""
