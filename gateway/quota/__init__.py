"""Token quota: rules and estimates (pure), usage extraction (pure), the Valkey ledger, the gate.

Import the submodules directly; this package imports nothing so the pure rooms stay I/O-free.

    rules      QuotaRule, Budget, RuleSet             which budgets apply (first match wins)
    estimate   estimate_tokens                        the reservation size
    usage      rewrite_request_for_usage, usage_observer   actual usage from responses
    owner      owner_tag                              the worker identity in every reservation id
    ledger     QuotaLedger                            the Lua script and key layout in Valkey
    admission  Admission                              a verdict with its headers and error text
    breaker    Breaker                                when admissions stop touching a failing backend
    counters   QuotaCounters, TenantTokens, configured_tenants   per-worker counters for the metrics
    reconcile  Reconciler                             settling off the request path, in batches
    lease      Lease, LeaseSpec                       worker-held token blocks (quota.lease): the arithmetic
    gate       QuotaGate                              what a worker calls per request
    report     quota_report                           the /admin/quota page's reading of the ledger
    resp       RespClient                             lean pipelined client for one Valkey node
    backend    create_client                          the client for a backend URL (RespClient or ValkeyCluster)
    embedded   EmbeddedValkey                         the bundled server the supervisor runs
"""
