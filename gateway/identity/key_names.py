"""Names in the Valkey keys of a tenant: escaped tenant, rule and key names in the ledger's keys and
members, and the tenant's deny set of managed keys (same hash tag as every ledger key of the tenant:
``gateway.quota.ledger_script``). Pure."""

from __future__ import annotations


def deny_set_key(tenant: str) -> str:
    """The tenant's deny set of managed keys (kid -> ``blocked``|``revoked``), which the key store writes
    (``gateway.keys.store``) and the admit reads: in the tenant's hash slot, like every ledger key."""
    return f"gg:keys:v1:{{{escape_key_part(tenant)}}}:deny"


def escape_key_part(value: str) -> str:
    """Make a tenant, rule or key name safe inside ``{...}``, around ``:`` and inside a member."""
    for char, code in (("%", "%25"), (":", "%3A"), ("{", "%7B"), ("}", "%7D"), ("|", "%7C"), (",", "%2C"),
                       ("=", "%3D"), (" ", "%20")):
        value = value.replace(char, code)
    return value
