"""JWT bearer tokens -> who the request is (docs/identity.md). Pure: keys and the clock are handed in.

A token is verified with pyjwt against the issuer's key set (``jwt_keys.KeySet``, which the supervisor
fetched off the request path), with an explicit allow-list of algorithms: the header's ``alg`` must be
one of the issuer's ``algorithms`` *and* one the key in question can verify, so ``alg: none`` and an
HMAC algorithm keyed with the issuer's public key (alg confusion) never verify anything. Then ``iss``,
``aud``, ``exp`` (required), ``nbf`` and ``iat`` within the leeway, and ``required_claims``.

A refusal is a ``JwtRefusal`` whose message names the check that failed and never contains the token
(nor a claim value the client chose beyond a short, printable prefix).

What a token proves is a ``JwtGrant``: the identity (``KeyIdentity``, one object per issuer, tenant,
subject and rule, so the quota's memo sees one object per subject), the model globs from its claims,
and its ``exp``. ``JwtVerifier.grant`` caches grants by the token's SHA-256 until their ``exp``
(bounded), so a client that reuses its token pays one hash and one dict lookup per request.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from fnmatch import translate
from typing import Any

import jwt

from gateway.identity.auth import KeyIdentity
from gateway.identity.claim_limits import NO_VALUES, ClaimValues, claim_values, subject_limits
from gateway.identity.jwt_keys import EMPTY_KEY_SET, KeySet
from gateway.identity.key_limits import KeyLimits
from gateway.identity.limits import Limits

MAX_TOKEN_BYTES = 8 * 1024
MAX_CACHED_TOKENS = 10_000
MAX_INTERNED_IDENTITIES = 10_000
_MAX_SHOWN = 64  # characters of a client-chosen value in a message
_MAX_TENANT = 128


class JwtRefusal(Exception):
    """401 ``invalid_token``: ``check`` names what failed (``alg``, ``kid``, ``exp`` ...)."""

    def __init__(self, check: str, message: str, issuer: str | None = None, kid: str | None = None) -> None:
        super().__init__(message)
        self.check = check
        self.message = message
        self.issuer = issuer  # the entry's name when the token was matched to one
        # A kid its issuer's set lacks ("" for a token without one; None: no such refusal): worth a wait
        self.kid = kid


class JwtGrant:
    """A verified token: its identity, model globs (None: no models claim) and expiry (Unix seconds)."""

    __slots__ = ("identity", "models", "expires_at", "valid_until", "kid", "origins", "_models", "keys_generation")

    def __init__(self, identity: KeyIdentity, models: list[str] | None, expires_at: float, leeway: float = 0.0) -> None:
        self.identity = identity
        self.models = models
        self.expires_at = expires_at
        self.valid_until = expires_at + leeway  # the cache serves it until then, as a fresh check would
        self.kid = None  # what a managed key's entry has (the request path reads both alike)
        self.origins = None
        self._models = None if models is None else re.compile("|".join(translate(glob) for glob in models))
        self.keys_generation = 0  # the verifier's key-set generation it was verified under (``JwtVerifier``)

    def allows_model(self, model: str) -> bool:
        return self._models is None or self._models.match(model) is not None

    @property
    def who(self) -> str:
        return f"the token of {self.identity.via} subject {_shown(self.identity.alias or '')}"


def looks_like_jwt(token: bytes) -> bool:
    """A JWT's shape: three base64url segments, the header a JSON object (``eyJ`` is ``{"``). Opaque API
    keys never have it (``gridgate keys`` makes none with dots), so they skip the JWT path entirely."""
    return token.startswith(b"eyJ") and token.count(b".") == 2


def claim_at(claims: dict[str, Any], path: str) -> Any:
    """The claim named ``path``: the literal name first (``https://example.com/org`` is one claim),
    else a dotted path into nested objects (``realm.org``). None when absent."""
    if path in claims:
        return claims[path]
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


class IssuerVerifier:
    """One ``auth.jwt`` entry (the config struct, duck-typed) and its current key set."""

    def __init__(self, entry: Any, keys: KeySet = EMPTY_KEY_SET) -> None:
        self.entry = entry
        self.name: str = entry.name
        self.via = f"jwt:{entry.name}"
        self.keys = keys
        self._algorithms = frozenset(entry.algorithms)
        self._limits = None if entry.limits is None else entry.limits.counted()
        self._claim_limits = entry.limits_from_claims
        # limits_from_claims: each distinct set of claim values -> its limits (written, counted), built once
        self._limits_of: dict[ClaimValues, tuple[KeyLimits | None, Limits | None]] = {
            NO_VALUES: (entry.limits, self._limits)}
        self.bad_limit_claims = 0  # tokens whose limit claims were unusable (the config's limits applied)
        self.bad_limit_paths: set[str] = set()  # which claims (the gate logs each once)
        self._required = [(claim, value if isinstance(value, list) else [value])
                          for claim, value in entry.required_claims.items()]
        self._identities: dict[tuple[str, str, str | None], KeyIdentity] = {}

    def verify(self, token: str, header: dict[str, Any], now: float) -> JwtGrant:
        key = self._key_for(header)
        entry = self.entry
        try:
            # The times are checked below against the clock handed in (pyjwt would read its own).
            claims = jwt.decode(token, key=key.key, algorithms=[header["alg"]], audience=entry.audience,
                                issuer=entry.issuer, options={"require": ["exp"], "verify_exp": False,
                                                              "verify_nbf": False, "verify_iat": False,
                                                              "verify_sub": False, "verify_jti": False})
        except jwt.PyJWTError as exc:
            raise _refusal_of(exc, self.name) from None
        _check_times(claims, now, float(entry.leeway), self.name)
        for claim, accepted in self._required:
            if not _claim_has(claim_at(claims, claim), accepted):
                raise JwtRefusal("required_claims", f"claim {claim!r} is missing or has a value not accepted", self.name)
        return JwtGrant(self._identity(claims), self._models(claims), float(claims["exp"]), float(entry.leeway))

    def _key_for(self, header: dict[str, Any]) -> Any:
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self._algorithms:
            shown = "none" if alg in (None, "none", "") else _shown(str(alg))
            raise JwtRefusal("alg", f"algorithm {shown!r} is not accepted for issuer {self.name!r} "
                             f"(accepted: {', '.join(sorted(self._algorithms))})", self.name)
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise JwtRefusal("kid", "the token's kid is not a string", self.name)
        candidates = self.keys.candidates(kid)
        if not candidates:
            named = "no kid" if kid is None else f"kid {_shown(kid)!r}"
            raise JwtRefusal("kid", f"{named}: no such key in the key set of issuer {self.name!r}", self.name,
                             kid or "")
        for key in candidates:
            if alg in key.algorithms:
                return key
        raise JwtRefusal("alg", f"algorithm {alg!r} does not fit the key the token names", self.name)

    def _identity(self, claims: dict[str, Any]) -> KeyIdentity:
        entry = self.entry
        tenant = entry.tenant if entry.tenant is not None else self._tenant(claims)
        subject = claim_at(claims, entry.key_claim)
        if not isinstance(subject, str | int) or isinstance(subject, bool) or not str(subject):
            raise JwtRefusal("key_claim", f"claim {entry.key_claim!r} (the subject) is missing or not a string", self.name)
        rule = None
        if entry.rule_claim is not None:
            rule = claim_at(claims, entry.rule_claim)
            if rule is not None and not isinstance(rule, str):
                raise JwtRefusal("rule_claim", f"claim {entry.rule_claim!r} is not a string", self.name)
        values = NO_VALUES if self._claim_limits is None else self._claim_values(claims)
        memo = (tenant, str(subject), rule, values)
        identity = self._identities.get(memo)
        if identity is None:
            if len(self._identities) >= MAX_INTERNED_IDENTITIES:
                self._identities.clear()
            written, counted = self._limits_for(values)
            identity = KeyIdentity(tenant, str(subject), None, counted, via=self.via, rule=rule, written=written)
            self._identities[memo] = identity
        return identity

    def _claim_values(self, claims: dict[str, Any]) -> ClaimValues:
        values, bad = claim_values(self._claim_limits, claims, claim_at)
        if bad:
            self.bad_limit_claims += 1
            self.bad_limit_paths.update(bad)
        return values

    def _limits_for(self, values: ClaimValues) -> tuple[KeyLimits | None, Limits | None]:
        """The subject's limits for these claim values (the entry's own when the result is invalid)."""
        found = self._limits_of.get(values)
        if found is None:
            try:
                written = subject_limits(self.entry.limits, values)
            except ValueError:  # e.g. a ninth request limit: the configured limits apply
                self.bad_limit_claims += 1
                found = self._limits_of[NO_VALUES]
            else:
                found = (written, None if written is None else written.counted())
            if len(self._limits_of) >= MAX_INTERNED_IDENTITIES:
                self._limits_of = {NO_VALUES: self._limits_of[NO_VALUES]}
            self._limits_of[values] = found
        return found

    def _tenant(self, claims: dict[str, Any]) -> str:
        entry = self.entry
        value = claim_at(claims, entry.tenant_claim)
        if not isinstance(value, str) or not value or len(value) > _MAX_TENANT or not value.isprintable():
            raise JwtRefusal("tenant_claim", f"claim {entry.tenant_claim!r} (the tenant) is missing or not a "
                             f"printable string of 1..{_MAX_TENANT} characters", self.name)
        if entry.map is not None:
            mapped = entry.map.get(value)
            if mapped is None:
                raise JwtRefusal("tenant_claim", f"claim {entry.tenant_claim!r} has a value the map does not name",
                                 self.name)
            return mapped
        return value

    def _models(self, claims: dict[str, Any]) -> list[str] | None:
        path = self.entry.models_claim
        if path is None:
            return None
        value = claim_at(claims, path)
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list) or not all(isinstance(glob, str) for glob in value):
            raise JwtRefusal("models_claim", f"claim {path!r} (the models) is missing or not a list of strings",
                             self.name)
        return value


class JwtVerifier:
    """Every ``auth.jwt`` entry of a worker, its verified-token cache, and the key sets' updates.

    ``on_unknown_kid(name)`` is called when a token names a kid its issuer's set lacks: the worker asks
    the supervisor to refetch (which does so at most once per 30 s per issuer)."""

    def __init__(self, entries: Iterable[Any], on_unknown_kid: Callable[[str], None] | None = None) -> None:
        self.issuers = {entry.issuer: IssuerVerifier(entry) for entry in entries}
        self.by_name = {issuer.name: issuer for issuer in self.issuers.values()}
        self._only = next(iter(self.issuers.values())) if len(self.issuers) == 1 else None
        self._cache: dict[bytes, JwtGrant] = {}
        self.on_unknown_kid = on_unknown_kid
        # Counts key-set changes: a grant verified under an older generation is not served from a memo
        # (``current``), as the emptied cache no longer serves it.
        self.keys_generation = 0

    def set_keys(self, name: str, keys: KeySet) -> None:
        """A new key set for issuer ``name``: the cache is emptied, so a key the IdP dropped stops
        admitting the tokens it signed now, not at their exp."""
        self.by_name[name].keys = keys
        self._cache.clear()
        self.keys_generation += 1

    def current(self, grant: JwtGrant, now: float) -> bool:
        """``grant`` still admits its token now: unexpired, and verified under today's key sets."""
        return grant.valid_until > now and grant.keys_generation == self.keys_generation

    def grant(self, token: bytes, now: float) -> JwtGrant:
        """The grant of a presented token (cached until its exp), or raise JwtRefusal."""
        if len(token) > MAX_TOKEN_BYTES:
            raise JwtRefusal("size", f"the token is larger than {MAX_TOKEN_BYTES} bytes")
        digest = hashlib.sha256(token).digest()
        cached = self._cache.get(digest)
        if cached is not None:
            if cached.valid_until > now:
                return cached
            del self._cache[digest]
        grant = self.verify(token, now)
        grant.keys_generation = self.keys_generation
        cache = self._cache
        if len(cache) >= MAX_CACHED_TOKENS:
            for stale in [d for d, g in cache.items() if g.valid_until <= now]:
                del cache[stale]
            if len(cache) >= MAX_CACHED_TOKENS:
                cache.clear()
        cache[digest] = grant
        return grant

    def verify(self, token_bytes: bytes, now: float) -> JwtGrant:
        """Verify without the cache (raise JwtRefusal)."""
        try:
            token = token_bytes.decode("ascii")
            header = jwt.get_unverified_header(token)
        except (UnicodeDecodeError, jwt.PyJWTError):
            raise JwtRefusal("format", "the bearer token is not a well-formed JWT") from None
        issuer = self._only if self._only is not None else self._issuer_of(token)
        try:
            return issuer.verify(token, header, now)
        except JwtRefusal as refusal:
            if refusal.check == "kid" and self.on_unknown_kid is not None:
                self.on_unknown_kid(issuer.name)
            raise

    def _issuer_of(self, token: str) -> IssuerVerifier:
        try:
            claims = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise JwtRefusal("format", "the bearer token is not a well-formed JWT") from None
        found = self.issuers.get(claims.get("iss")) if isinstance(claims.get("iss"), str) else None
        if found is None:
            raise JwtRefusal("iss", "the token's issuer (iss) is not one this gateway accepts")
        return found


def _check_times(claims: dict[str, Any], now: float, leeway: float, issuer: str) -> None:
    for name in ("exp", "nbf", "iat"):
        value = claims.get(name)
        if name in claims and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise JwtRefusal(name, f"the token's {name} is not a number (NumericDate)", issuer)
    if claims["exp"] + leeway <= now:
        raise JwtRefusal("exp", "the token has expired (exp, beyond the leeway)", issuer)
    for name in ("nbf", "iat"):
        if name in claims and claims[name] - leeway > now:
            raise JwtRefusal(name, f"the token is not valid yet ({name}, beyond the leeway)", issuer)


def _claim_has(value: Any, accepted: list[str]) -> bool:
    if isinstance(value, list):
        return any(item in accepted for item in value if isinstance(item, str))
    return isinstance(value, str) and value in accepted


def _shown(value: str) -> str:
    value = "".join(char for char in value if char.isprintable())
    return value if len(value) <= _MAX_SHOWN else value[:_MAX_SHOWN] + "..."


_CHECKS: tuple[tuple[type[Exception], str, str], ...] = (
    (jwt.InvalidAudienceError, "aud", "the token's audience (aud) is not one this gateway accepts"),
    (jwt.InvalidIssuerError, "iss", "the token's issuer (iss) is not the issuer configured"),
    (jwt.InvalidSignatureError, "signature", "the token's signature does not verify"),
    (jwt.InvalidAlgorithmError, "alg", "the token's algorithm is not accepted"),
)


def _refusal_of(exc: jwt.PyJWTError, issuer: str) -> JwtRefusal:
    if isinstance(exc, jwt.MissingRequiredClaimError):
        check = exc.claim if exc.claim in ("aud", "iss", "exp") else "required_claims"
        return JwtRefusal(check, f"the token has no {exc.claim!r} claim", issuer)
    for kind, check, message in _CHECKS:
        if isinstance(exc, kind):
            return JwtRefusal(check, message, issuer)
    return JwtRefusal("format", "the token could not be decoded", issuer)
