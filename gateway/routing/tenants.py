"""Per-tenant routing policy (docs/routing.md#request-aware-selection): which capabilities a tenant
may use, which regions may serve it, whether it may pin a route. Pure; capability checks are memoised
per tenant so globs are matched once per (tenant, capability), not per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from gateway.config import TenantPolicy

_MEMO_LIMIT = 4096  # capability names remembered per tenant (bounded: names come from clients)


class Policy:
    """One tenant's policy, ready for the request path."""

    __slots__ = ("tenant", "patterns", "open", "regions", "may_pin", "batch", "_allowed")

    def __init__(self, config: TenantPolicy) -> None:
        self.tenant = config.tenant
        self.patterns = tuple(config.allowed_capabilities) if config.allowed_capabilities is not None else None
        self.open = self.patterns is None  # every capability allowed: nothing to check per request
        self.regions = frozenset(config.allowed_regions) if config.allowed_regions is not None else None
        self.may_pin = config.may_pin
        self.batch = config.priority == "batch"
        self._allowed: dict[str, bool] = {}

    def allows(self, capability: str) -> bool:
        patterns = self.patterns
        if patterns is None:
            return True
        allowed = self._allowed.get(capability)
        if allowed is None:
            allowed = any(fnmatchcase(capability, pattern) for pattern in patterns)
            if len(self._allowed) < _MEMO_LIMIT:
                self._allowed[capability] = allowed
        return allowed


OPEN = Policy(TenantPolicy(tenant="*"))  # tenants without an entry: no restriction, interactive


class TenantPolicies:
    def __init__(self, policies: Sequence[TenantPolicy]) -> None:
        self._by_tenant = {policy.tenant: Policy(policy) for policy in policies}

    def __bool__(self) -> bool:
        return bool(self._by_tenant)

    def get(self, tenant: str) -> Policy:
        return self._by_tenant.get(tenant, OPEN)

