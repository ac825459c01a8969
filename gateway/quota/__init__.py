"""Quota: limits, rules and estimates (pure), usage extraction (pure), the Valkey ledger, and the gate in parts.

Import the submodules directly; this package imports nothing so the pure rooms stay I/O-free.

    limits     RequestLimit, Budget, Limits, Scope    what can limit a request, and whose (a rule's, a key's)
    rules      QuotaRule, RuleSet                     which rule applies (first match wins; model, key globs)
    estimate   estimate_tokens                        the reservation size
    usage      rewrite_request_for_usage, usage_observer   actual usage from responses
    owner      owner_tag                              the worker identity in every reservation id
    admission  Admission                              a verdict with its headers and error text
    verdict    refused, rate_headers                  an admit's reply as the request's Admission
    counters   QuotaCounters, TenantTokens, configured_tenants   per-worker counters for the metrics
    lease      Lease, Allowance, LeaseSpec            a worker-held block (quota.lease): the arithmetic, sizes

  The ledger, and how it reaches Valkey:
    ledger_script                                     the one Lua script, versioned, and its key prefix
    ledger     QuotaLedger, Account, Reservation      the script's calls and their replies; an Account is what
                                                      meters a (tenant, rule, key)
    transport  ScriptTransport                        the protocol the ledger speaks to Valkey through
    resp_transport     RespTransport                  ... one node, over the lean pipelined RespClient
    cluster_transport  ClusterTransport               ... Valkey Cluster, over valkey-py's ValkeyCluster
    backend    create_client                          the transport for a backend URL (chosen once, here)
    resp       RespClient                             lean pipelined client for one Valkey node

  The gate a worker calls (admission, settle), and its parts:
    gate       QuotaGate                              composes the parts below; the two verbs
    batcher    AdmitBatcher                           one pipelined write per loop tick of admits
    lease_book LeaseBook                              the worker's blocks: ask, grant, take, renew, return
    breaker    Breaker, BackendBreaker                when admissions stop touching a failing backend; the probe
    reconcile  Reconciler                             settling off the request path, in batches
    keeper     ReservationKeeper                      running requests keep their reservations live
    report     quota_report                           the /admin/quota page's reading of the ledger
    embedded   EmbeddedValkey                         the bundled server the supervisor runs
"""
