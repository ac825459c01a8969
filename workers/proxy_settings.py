"""The proxy's settings, resolved once per worker from the config (typed, no lookups per request)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import Config, Cooling, Retry
from gateway.models.aliases import ModelRoute, model_routes
from gateway.request.prefix import BYTES_PER_TOKEN


@dataclass(frozen=True, slots=True)
class ProxySettings:
    route_headers: bool
    affinity_enabled: bool
    # The session fact is read for affinity, and for a stable_hash key that names it (affinity on or not).
    session_fact: bool
    affinity_cookie: bytes | None
    retry: Retry
    cooling: Cooling
    first_byte_timeout: float | None
    # Request facts are decoded and candidates filtered only when something can restrict them.
    filters: bool
    # stable_hash picker: the request facts of its key ("tenant", "session", "request_id", or
    # ("header", lowercase name)); empty for other pickers.
    stable_hash_key: tuple[str | tuple[str, bytes], ...]
    # Requested model name -> its alias target and fallback chain (docs/models.md); empty: no models block.
    models: dict[str, ModelRoute]
    model_header: bytes  # the capability header, lowercase (a model moved along a chain rewrites it)
    # Fraction of routed requests whose route evidence is computed for the access line (0 without one).
    evidence_sample: float = 0.0
    # Prefix affinity: the leading prompt bytes hashed (docs/routing.md, "Prefix affinity"); 0: off.
    prefix_bytes: int = 0

    @classmethod
    def from_config(cls, config: Config) -> ProxySettings:
        routing = config.routing
        affinity = routing.session_affinity
        retry = routing.retry
        key: tuple[str | tuple[str, bytes], ...] = ()
        if routing.picker == "stable_hash":
            key = tuple(("header", part[len("header:"):].lower().encode()) if part.startswith("header:") else part
                        for part in routing.stable_hash_key)
        session_fact = affinity.enabled or "session" in key
        return cls(
            route_headers=routing.route_headers,
            affinity_enabled=affinity.enabled,
            session_fact=session_fact,
            affinity_cookie=affinity.cookie.encode() if session_fact and affinity.cookie else None,
            retry=retry,
            cooling=routing.cooling,
            first_byte_timeout=None if retry.first_byte_timeout is None else float(retry.first_byte_timeout),
            filters=bool(routing.models) or any(t.allowed_regions is not None for t in config.tenants),
            stable_hash_key=key,
            models=model_routes(config.models),
            model_header=routing.model_header.lower().encode(),
            evidence_sample=config.access_log.evidence_sample if config.access_log.enabled else 0.0,
            prefix_bytes=routing.prefix_affinity.prefix_tokens * BYTES_PER_TOKEN if routing.prefix_affinity.enabled
            else 0,
        )

    def stable_hash_headers(self) -> list[str]:
        """Header names the stable_hash key reads (the header scan must capture them)."""
        return [part[1].decode() for part in self.stable_hash_key if isinstance(part, tuple)]
