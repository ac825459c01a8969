"""The JWT part of the configuration: ``auth.jwt``, one entry per identity provider (docs/identity.md).

Split from :mod:`gateway.config.quota` (``Auth`` holds the list) so each schema module stays small; the
rules are the same: strict Structs, a range for every number, errors naming the field. The algorithm
list is an allow-list of asymmetric algorithms only: ``none`` and the HMAC family cannot be written,
so a token signed with HS256 and the issuer's public key as the secret (alg confusion) has no
algorithm that accepts it.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

import msgspec

from gateway.identity.key_limits import KeyLimits
from gateway.yaml_config import DAY, HOUR, Range, Seconds, StrictStruct, check_ranges

JwtAlgorithm = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CLAIM_PATH = re.compile(r"[^.\s]+(\.[^.\s]+)*")


class JwksRefresh(StrictStruct):
    """How often the supervisor fetches an issuer's key set: the IdP's ``Cache-Control: max-age``,
    clamped to ``[min, max]`` (``default`` without one), and refreshed ``early`` before it runs out."""

    min: Seconds = Seconds(60)
    max: Seconds = Seconds(HOUR)
    default: Seconds = Seconds(300)
    early: float = 0.2  # the share of the lifetime left when the refresh starts
    retry: Seconds = Seconds(10)  # after a failed fetch (the last good set keeps serving)
    timeout: Seconds = Seconds(5)

    _RANGES: ClassVar[dict[str, Range]] = {"min": (1, DAY), "max": (1, 7 * DAY), "default": (1, DAY),
                                           "early": (0.0, 0.9), "retry": (0.1, HOUR), "timeout": (0.1, 60)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if self.min > self.max:
            raise ValueError("min: must be <= max")


class ClaimLimits(StrictStruct):
    """``limits_from_claims``: claims (dotted paths) whose integer values are a subject's own limits,
    replacing the entry's ``limits`` of that kind (docs/identity.md, "Limits from claims"). A value
    that is missing keeps the configured limit; one that is not an integer within the bounds keeps it
    too, counted and logged, never a refusal."""

    requests_per_minute: str | None = None  # a request limit of that many per 1m
    tokens_per_minute: str | None = None  # a token budget of that many per 1m
    max_in_flight: str | None = None  # concurrent requests of the subject

    def __post_init__(self) -> None:
        paths = [self.requests_per_minute, self.tokens_per_minute, self.max_in_flight]
        if all(path is None for path in paths):
            raise ValueError("requests_per_minute: name at least one claim (requests_per_minute, "
                             "tokens_per_minute, max_in_flight)")
        for field in ("requests_per_minute", "tokens_per_minute", "max_in_flight"):
            path = getattr(self, field)
            if path is not None and _CLAIM_PATH.fullmatch(path) is None:
                raise ValueError(f"{field}: a claim name, or a dotted path (gridgate.rpm)")


class JwtIssuer(StrictStruct):
    """One identity provider whose tokens identify clients."""

    name: str  # the identity is jwt:<name> (access log, spend, messages)
    issuer: str  # the exact `iss`
    audience: list[str]  # the token's `aud` must name one of these
    jwks_url: str | None = None
    jwks_file: str | None = None  # a JWKS document on disk (re-read when it changes)
    oidc_discovery: bool = False  # fetch <issuer>/.well-known/openid-configuration, then its jwks_uri
    algorithms: list[JwtAlgorithm] = msgspec.field(default_factory=lambda: ["RS256"])
    leeway: Seconds = Seconds(30)  # clock skew allowed on exp, nbf and iat
    tenant_claim: str | None = None  # a claim (dotted path into nested claims) naming the tenant
    tenant: str | None = None  # or one fixed tenant for every token of this issuer
    map: dict[str, str] | None = None  # tenant claim value -> tenant; a value not in it is refused
    key_claim: str = "sub"  # the subject: the identity's name in limits, spend and the access log
    models_claim: str | None = None  # model globs the token may use (a list or a space-separated string)
    rule_claim: str | None = None  # the quota rule (by name) that meters the token's requests
    required_claims: dict[str, str | list[str]] = {}  # claim -> the value, or one of the values
    limits: KeyLimits | None = None  # each subject's own limits (docs/limits.md), like a key's
    limits_from_claims: ClaimLimits | None = None  # or taken from the token's claims, per subject
    refresh: JwksRefresh = JwksRefresh()
    # A token naming a kid the key set lacks waits this long (at most) for the supervisor's refetch on the
    # worker, then is verified again; 0: refused at once (docs/identity.md, "Rotation").
    unknown_kid_wait: Seconds = Seconds(2)

    _RANGES: ClassVar[dict[str, Range]] = {"leeway": (0, 600), "unknown_kid_wait": (0, 10)}

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if _NAME.fullmatch(self.name) is None:
            raise ValueError("name: 1..64 characters: letters, digits and . _ - (not first)")
        if not self.issuer.strip():
            raise ValueError("issuer: must not be empty (the exact `iss` of the tokens)")
        if not self.audience or not all(value.strip() for value in self.audience):
            raise ValueError("audience: at least one non-empty value (the token's `aud` must name one)")
        sources = [name for name in ("jwks_url", "jwks_file") if getattr(self, name) is not None]
        if self.oidc_discovery:
            sources.append("oidc_discovery")
        if not sources:
            raise ValueError("jwks_url: the issuer has no key source: give jwks_url, jwks_file or oidc_discovery: true")
        if len(sources) > 1:
            raise ValueError(f"{sources[1]}: give one key source, not {' and '.join(sources)}")
        for field in ("jwks_url",):
            url = getattr(self, field)
            if url is not None and not url.startswith(("https://", "http://")):
                raise ValueError(f"{field}: must be an http(s) URL")
        if self.oidc_discovery and not self.issuer.startswith(("https://", "http://")):
            raise ValueError("issuer: oidc_discovery needs an http(s) issuer URL")
        if not self.algorithms:
            raise ValueError("algorithms: at least one algorithm")
        if self.tenant_claim is None and self.tenant is None:
            raise ValueError("tenant_claim: required: the claim naming the tenant (or a fixed tenant)")
        if self.tenant_claim is not None and self.tenant is not None:
            raise ValueError("tenant: give tenant_claim or tenant, not both")
        if self.map is not None and self.tenant_claim is None:
            raise ValueError("map: maps tenant_claim values; it needs tenant_claim")
        for field in ("tenant_claim", "key_claim", "models_claim", "rule_claim"):
            path = getattr(self, field)
            if path is not None and _CLAIM_PATH.fullmatch(path) is None:
                raise ValueError(f"{field}: a claim name, or a dotted path (realm.org)")
        for claim, value in self.required_claims.items():
            if isinstance(value, list) and not value:
                raise ValueError(f"required_claims.{claim}: at least one value")


def jwt_checks(issuers: list[JwtIssuer]) -> list[str]:
    """Checks across ``auth.jwt`` entries; each problem names its field."""
    problems = []
    names: dict[str, int] = {}
    issuer_urls: dict[str, int] = {}
    for index, entry in enumerate(issuers):
        if entry.name in names:
            problems.append(f"auth.jwt[{index}].name: duplicate name {entry.name!r} (auth.jwt[{names[entry.name]}])")
        names.setdefault(entry.name, index)
        if entry.issuer in issuer_urls:
            problems.append(f"auth.jwt[{index}].issuer: {entry.issuer!r} is auth.jwt[{issuer_urls[entry.issuer]}]'s "
                            "too (a token's `iss` picks one entry)")
        issuer_urls.setdefault(entry.issuer, index)
    return problems
