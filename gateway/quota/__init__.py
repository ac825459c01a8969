"""Quota: rules (pure), the Valkey ledger, and the gate a worker calls, in parts.

Import the submodules directly; this package imports nothing so the pure rooms stay I/O-free. What a
limit is lives in gateway/identity (``limits``, ``key_limits``), the token estimate and the usage read
from responses in gateway/request (``estimate``, ``usage``), the transports and clients to Valkey in
gateway/valkey.

    rules      QuotaRule, RuleSet                     which rule applies (first match wins; model, key globs)
    owner      owner_tag                              the worker identity in every reservation id
    admission  Admission                              a verdict with its headers and error text
    verdict    refused, rate_headers                  an admit's reply as the request's Admission
    rate_headers  duration_text                       the rate-limit headers' names (OpenAI's), reset times in words
    counters   QuotaCounters, TenantTokens, configured_tenants   per-worker counters for the metrics
    lease      Lease, Allowance, LeaseSpec            a worker-held block (quota.lease): the arithmetic, sizes

  The ledger:
    ledger_script                                     the one Lua script, versioned, and its key prefix
    ledger     QuotaLedger, Account, Reservation      the script's calls and their replies; an Account is what
                                                      meters a (tenant, rule, key)

  The gate a worker calls (admission, settle), and its parts:
    gate       QuotaGate                              composes the parts below; the two verbs
    batcher    AdmitBatcher                           one pipelined write per loop tick of admits
    lease_book LeaseBook                              the worker's blocks: ask, grant, take, renew, return
    breaker    Breaker, BackendBreaker                when admissions stop touching a failing backend; the probe
    reconcile  Reconciler                             settling off the request path, in batches
    keeper     ReservationKeeper                      running requests keep their reservations live
    report     quota_report                           the /admin/quota page's reading of the ledger
"""
