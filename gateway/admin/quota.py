"""``/admin/quota``: the supervisor's own client of the shared token ledger."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.admin.pages import ReportUnavailable
from gateway.config import Auth, Quota
from gateway.identity.limits import Scope
from gateway.quota.rules import RuleSet, rules_from_config

if TYPE_CHECKING:
    from gateway.quota.ledger import QuotaLedger


class QuotaReporter:
    """Reads the ledger from the supervisor's loop; reconnects when the backend URL or the rules change."""

    def __init__(self) -> None:
        self._key: tuple[str, Quota, Auth | None] | None = None
        self._ledger: QuotaLedger | None = None
        self._rules: RuleSet | None = None
        self._key_scopes: dict[str, tuple[Scope, ...]] = {}

    async def report(self, url: str, quota: Quota, tenant: str, auth: Auth | None = None,
                     managed_scopes: tuple[Scope, ...] = ()) -> dict[str, Any]:
        """The tenant's rules and its configured keys with limits (``auth``), and ``managed_scopes`` (its
        managed keys' own, which the caller read from the key table) beside them."""
        # Imported here: the quota client (valkey) is loaded only once somebody asks for this page.
        from gateway.quota.ledger import QuotaLedger
        from gateway.quota.report import QuotaBackendUnavailable, key_scopes_by_tenant, quota_report
        from gateway.valkey.client import create_client

        if self._key != (url, quota, auth):
            await self.close()
        if self._ledger is None or self._rules is None:  # made lazily: the client belongs to the running loop
            self._ledger = QuotaLedger(create_client(url, timeout_s=1.0),
                                       reservation_timeout_s=float(quota.reservation_timeout))
            self._rules = RuleSet(rules_from_config(quota))
            self._key_scopes = key_scopes_by_tenant(auth)
            self._key = (url, quota, auth)
        try:
            return await quota_report(self._ledger, self._rules, tenant,
                                      key_scopes=(*self._key_scopes.get(tenant, ()), *managed_scopes))
        except QuotaBackendUnavailable as exc:
            raise ReportUnavailable(f"quota backend unavailable: {exc}") from None

    async def close(self) -> None:
        if self._ledger is not None:
            await self._ledger.close()
        self._ledger = self._rules = self._key = None
