"""One provider cluster's endpoints: the spec, the balancers, passive health and the shared-memory view.

spec          what a cluster is (plain data) and the one config -> spec mapping
balancers/    endpoint selection by family: weighted (rr, random), load (least-conn, p2c), hashing
outcome       how one upstream attempt ended, as passive health counts it
outlier       the circuit breakers the health process runs (pure), with their state enum
shared_view   the balancers' view of health and in-flight counts in shared memory
report        the ``/admin/endpoints`` document
"""
