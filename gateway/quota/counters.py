"""The quota gate's per-worker counters (pure data; the metrics side reads and sums them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import Config

OTHER_TENANT = "other"
MAX_LEARNED = 128  # tenants of managed keys a worker labels (the supervisor's registry holds as many)


@dataclass(slots=True)
class QuotaCounters:
    """Per-worker monotonic counters (the metrics module sums them over workers)."""

    admitted: int = 0
    leased: int = 0  # admitted from a worker-held block (quota.lease), included in admitted
    leases_granted: int = 0  # blocks the ledger granted this worker
    denied: int = 0  # over a token budget or a request limit, never-fits included
    denied_requests: int = 0  # of those, by a request limit
    denied_never_fits: int = 0  # the estimate exceeds a whole window: not retryable
    denied_concurrency: int = 0
    shadow_refusals: int = 0  # limits marked shadow that would have refused a request (one per limit)
    backend_error_rejected: int = 0
    backend_error_allowed: int = 0
    unmetered: int = 0  # no rule matched (no default rule)
    tokens_estimated: int = 0
    tokens_actual: int = 0
    tokens_refunded: int = 0
    tokens_overage: int = 0
    reservations_expired: int = 0  # charged at the estimate because they outlived the timeout
    reservations_extended: int = 0  # deadlines moved on because their requests still ran (keeper.py)
    backend_errors: int = 0  # failed backend round trips (an admit batch, a settle batch, a probe)
    breaker_opened: int = 0  # the breaker opened: the on_backend_error policy applies without a round trip
    breaker_closed: int = 0  # the backend answered again
    reconcile_drops: int = 0  # queue full
    reconcile_failures: int = 0  # retries exhausted
    reconcile_duplicates: int = 0
    denied_budget: int = 0  # refused by a hard USD budget (included in denied)
    spend_alerts: int = 0  # thresholds of USD budgets crossed (each once per period across every gateway)
    spend_usage_clamped: int = 0  # usage negative or over 10x the reservation: charged the reservation

    def count_settled(self, estimate: int, charged: int) -> None:
        """A request's reservation was settled: ``charged`` tokens against its ``estimate``."""
        self.tokens_actual += charged
        if charged < estimate:
            self.tokens_refunded += estimate - charged
        else:
            self.tokens_overage += charged - estimate

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


def configured_tenants(config: Config) -> list[str]:
    """The tenants a config names (its API keys', its JWT issuers' fixed or mapped ones, its quota rules',
    then its client certificates' map),
    once each, in config order: the label set of the per-tenant token counters (``other`` is never one
    of them)."""
    names = [key.tenant for key in config.auth.keys] if config.auth is not None else []
    for entry in config.auth.jwt if config.auth is not None else []:  # the tenants a JWT entry can name
        names += [entry.tenant] if entry.tenant is not None else list((entry.map or {}).values())
    if config.quota is not None:
        names += [rule.match.tenant for rule in config.quota.rules if rule.match and rule.match.tenant]
    client_auth = None if config.server_tls is None else config.server_tls.client_auth
    if client_auth is not None and client_auth.map is not None:
        names += client_auth.map.values()
    return [name for name in dict.fromkeys(names) if name != OTHER_TENANT]


class TenantTokens:
    """Tokens in (prompt) and out (completion) per tenant, counted by one worker from the usage the
    provider reported. Label set bounded by construction: the configured tenants (auth keys, quota
    rules), then ``other`` (everything else), then the tenants of managed keys this worker met, each
    with the supervisor's metrics index its key's table entry carried (``learned``, at most
    ``MAX_LEARNED``): their tenant may be newer than the worker."""

    __slots__ = ("names", "index", "tokens_in", "tokens_out", "learned", "_other")

    def __init__(self, tenants: Iterable[str]) -> None:
        names = [name for name in dict.fromkeys(tenants) if name != OTHER_TENANT]
        self.names: list[str] = [*names, OTHER_TENANT]
        self.index = {name: i for i, name in enumerate(self.names)}
        self._other = len(names)
        self.tokens_in = [0] * len(self.names)
        self.tokens_out = [0] * len(self.names)
        self.learned: dict[str, int] = {}  # tenant -> the supervisor's metrics index

    def slot(self, tenant: str, tenant_index: int = -1) -> int:
        """The tenant's slot; a tenant not configured gets one of its own when ``tenant_index`` (a managed
        key's ``KeyIdentity.tenant_index``) says where the supervisor counts it, else ``other``'s."""
        found = self.index.get(tenant)
        if found is not None:
            return found
        if tenant_index < 0 or len(self.learned) >= MAX_LEARNED:
            return self._other
        self.learned[tenant] = tenant_index
        self.index[tenant] = slot = len(self.names)
        self.names.append(tenant)
        self.tokens_in.append(0)
        self.tokens_out.append(0)
        return slot

    def add(self, slot: int, prompt_tokens: int | None, completion_tokens: int | None,
            total_tokens: int | None) -> None:
        """One response's usage. A missing side is derived from the total when the other is known;
        a usage without either side (total only, or none) cannot be split and is not counted here."""
        if prompt_tokens is None and completion_tokens is None:
            return
        if prompt_tokens is None:
            prompt_tokens = max(0, (total_tokens or 0) - completion_tokens)  # type: ignore[operator]
        elif completion_tokens is None:
            completion_tokens = max(0, (total_tokens or 0) - prompt_tokens)
        self.tokens_in[slot] += prompt_tokens
        self.tokens_out[slot] += completion_tokens

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """tenant -> (tokens in, tokens out)."""
        return {name: (self.tokens_in[i], self.tokens_out[i]) for i, name in enumerate(self.names)}
