"""Managed API keys (docs/keys.md): issued at runtime, kept in Valkey, followed into a host table.

    record        the record, the admin API's bodies and their checks (pure)
    store         ``KeyStore``: records, indexes, the change log (the audit log), the deny sets, in Valkey
    follower      ``KeyFollower``: the supervisor's loader and follower of the store into the host table
    view          what the table holds per secret (``KeyView``) and what a lookup answers (``KeyEntry``)
    lookup        ``KeyLookup``: a worker's digest -> ``KeyEntry`` over the shared-memory table
    answers       the request path's answers about a key: 401 codes, model globs, ``/v1/gridgate/key`` (pure)
    admin_client  ``gridgate keys ...``: the admin API's client and its tables

The key format (``gg-<kid>-<secret>``, the kid, the SHA-256 digest: the only form ever stored) is
gateway/identity/keyformat.py, a key's limits gateway/identity/key_limits.py.
"""
