"""The quota and auth parts of the gateway configuration: ``auth`` and ``quota`` (docs/configuration.md,
docs/limits.md).

Split from :mod:`gateway.config` (which re-exports every name here) so each schema module stays
small; the rules are the same: strict Structs, every numeric key with a range (``check_ranges``).
A key's ``limits`` and a rule's ``requests``, ``budgets`` and ``spend`` entries are
``gateway.identity.key_limits``'s, the form managed keys write too (a key's limits check themselves,
windows given twice included). Checks that span entries or blocks (aliases, key globs, key limits
without a quota block) are ``quota_checks``, run by the config loader with its other cross-field
checks; a rule's are ``gateway.quota.rules.validate_rules`` (``gridgate check`` and the supervisor run
them).
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from gateway.config.jwt import JwtIssuer, jwt_checks
from gateway.config.keys import KeyStoreBackend, check_backend_url
from gateway.identity.auth import is_key_digest
from gateway.identity.key_limits import MAX_COUNT, MAX_TOKENS, KeyLimits, RequestRate, SpendLimit, TokenBudget
from gateway.yaml_config import DAY, MINUTE, Range, Seconds, StrictStruct, check_ranges

_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@/+-]{0,127}")


class ApiKey(StrictStruct):
    tenant: str
    key: str
    alias: str | None = None  # the key's name: rules match it (match.key), limits count under it
    limits: KeyLimits | None = None

    def __post_init__(self) -> None:
        if not is_key_digest(self.key):
            raise ValueError("key: must be 'sha256:<64 lowercase hex>' (see `gridgate keys hash`)")
        if self.alias is not None and _ALIAS.fullmatch(self.alias) is None:
            raise ValueError("alias: 1..128 characters: letters, digits and . _ @ / + - (not first)")
        if self.limits is not None and self.alias is None:
            raise ValueError("limits: the key needs an alias (its name in counters, messages and /admin/quota)")


class Auth(StrictStruct):
    keys: list[ApiKey] = []
    store: KeyStoreBackend | None = None  # managed keys' Valkey when there is no quota block (docs/keys.md)
    key_table_capacity: int = 100_000  # managed-key secrets one host's table holds (docs/keys.md)
    jwt: list[JwtIssuer] = []  # identity providers whose bearer tokens identify clients (docs/identity.md)

    _RANGES: ClassVar[dict[str, Range]] = {"key_table_capacity": (1, 10_000_000)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class QuotaBackend(StrictStruct):
    kind: Literal["embedded", "valkey"] = "embedded"
    url: str | None = None
    # embedded only: where the bundled Valkey keeps its append-only file, so budgets survive restarts.
    # Default: $STATE_DIRECTORY/valkey under systemd, else a temporary directory (not persistent).
    data_dir: str | None = None

    def __post_init__(self) -> None:
        check_backend_url(self.kind, self.url)


class QuotaBreaker(StrictStruct):
    """How the quota backend's circuit breaker reacts to a failing Valkey (gateway/quota/breaker.py)."""

    # Consecutive failed backend round trips that open the breaker: from then on admissions get the
    # on_backend_error answer at once, without touching the backend.
    failures: int = 3
    # While open, each worker probes the backend this often (one PING); the first answer closes it.
    probe_interval: Seconds = Seconds(0.1)

    _RANGES: ClassVar[dict[str, Range]] = {"failures": (1, 1000), "probe_interval": (0.01, 10)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class QuotaMatch(StrictStruct):
    tenant: str | None = None  # exact
    model: str | None = None  # glob (fnmatch: * ? [..])
    key: str | None = None  # glob over the key's kid or alias
    subject: str | None = None  # glob over a JWT's (or a client certificate's) subject only (docs/identity.md)

    def __post_init__(self) -> None:
        for name in ("tenant", "model", "key", "subject"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty (omit it to match any)")


class Estimate(StrictStruct):
    default_max_tokens: int = 1024

    _RANGES: ClassVar[dict[str, Range]] = {"default_max_tokens": (0, 100_000_000)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class QuotaRule(StrictStruct):
    name: str
    budgets: list[TokenBudget] = []
    requests: list[RequestRate] = []
    match: QuotaMatch | None = None
    estimate: Estimate = Estimate()
    max_in_flight: int | None = None  # None: no limit (0 is refused rather than read as "unlimited")
    spend: list[SpendLimit] = []  # USD budgets per calendar period (docs/limits.md, "USD budgets")

    _RANGES: ClassVar[dict[str, Range]] = {"max_in_flight": (1, 1_000_000)}

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight: must be >= 1 (omit the key for no limit)")
        check_ranges(self, self._RANGES)
        if not self.budgets and not self.requests and self.max_in_flight is None and not self.spend:
            raise ValueError("budgets: a rule needs budgets, requests, spend or max_in_flight")


class QuotaLease(StrictStruct):
    """Worker-held blocks (gateway/quota/lease.py): admit without a Valkey round trip per request."""

    enabled: bool = True
    # A block stops admitting after this long (and at the end of a token window); its unused part goes back.
    ttl: Seconds = Seconds(1)
    # Blocks only while every limit still has room for this many blocks: near the limit every request
    # is decided in Valkey, exactly as without leases.
    headroom: int = 10
    # A fixed block size; None: sized from what the (tenant, rule, key)'s last blocks used.
    tokens: int | None = None
    requests: int | None = None

    _RANGES: ClassVar[dict[str, Range]] = {"tokens": (1, MAX_TOKENS), "requests": (1, MAX_COUNT),
                                           "ttl": (0.01, MINUTE), "headroom": (1, 1_000_000)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


class Quota(StrictStruct):
    rules: list[QuotaRule] = []
    backend: QuotaBackend = QuotaBackend()
    on_backend_error: Literal["reject", "allow"] = "reject"
    reservation_timeout: Seconds = Seconds(120)
    breaker: QuotaBreaker = QuotaBreaker()
    lease: QuotaLease | None = QuotaLease()  # null or {enabled: false}: every request decided in Valkey

    _RANGES: ClassVar[dict[str, Range]] = {"reservation_timeout": (1, DAY)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)


def quota_checks(auth: Auth | None, quota: Quota | None) -> list[str]:
    """Checks across ``auth`` and ``quota``; each problem names its field."""
    problems: list[str] = []
    if auth is not None and auth.store is not None and quota is not None:
        problems.append("auth.store: with a quota block the keys live in the quota backend's Valkey "
                        "(the admission call reads their deny set there); remove auth.store")
    keys = auth.keys if auth is not None else []
    if auth is not None:
        problems += jwt_checks(auth.jwt)
        problems += [f"auth.jwt[{index}].limits: needs the quota block (limits are counted in its backend)"
                     for index, entry in enumerate(auth.jwt) if entry.limits is not None and quota is None]
        problems += [f"auth.jwt[{index}].limits_from_claims: needs the quota block (limits are counted in its backend)"
                     for index, entry in enumerate(auth.jwt) if entry.limits_from_claims is not None and quota is None]
    aliases: dict[str, int] = {}
    for index, key in enumerate(keys):
        if key.alias is None:
            continue
        if key.alias in aliases:
            problems.append(f"auth.keys[{index}].alias: duplicate alias {key.alias!r} "
                            f"(auth.keys[{aliases[key.alias]}] has it)")
        aliases.setdefault(key.alias, index)
        if key.limits is not None and quota is None:
            problems.append(f"auth.keys[{index}].limits: needs the quota block (limits are counted in its backend)")
    if quota is None:
        return problems
    if not quota.rules and not any(key.limits is not None for key in keys):
        problems.append("quota.rules: required (no rule and no key with limits: nothing to meter)")
    for index, rule in enumerate(quota.rules):
        pattern = rule.match.key if rule.match else None
        if pattern is None:
            continue
        if auth is None:
            problems.append(f"quota.rules[{index}].match.key: there is no auth block, so no request has a key")
        # With auth and a quota block, managed keys are on (docs/keys.md): a glob may name the kids and
        # aliases of keys made at runtime, so matching no auth.keys[].alias is no error.
    return problems
