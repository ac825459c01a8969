"""An issuer's key set: a JWKS document parsed into the public keys a worker verifies tokens with. Pure.

Only asymmetric keys are kept (RSA, EC P-256/P-384/P-521, OKP Ed25519/Ed448): a symmetric ``oct`` key
in an IdP's JWKS would let anyone who can read the (public) document sign tokens, so it is dropped,
never used. Each key says which algorithms it may verify: its own ``alg`` when the JWK names one,
else every algorithm of its type (RSA: RS*/PS*; EC: the ES* of its curve; OKP: EdDSA). A key whose
``use`` is not ``sig`` is dropped too.

``parse_key_set`` raises ``KeySetError`` (naming what is wrong, never echoing key material) for a
document that is not a JWKS or holds no usable key: the supervisor then keeps the last good set.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

MAX_KEY_SET_BYTES = 256 * 1024  # a JWKS document larger than this is refused (an IdP's holds a few keys)
MAX_KEYS = 64

_RSA = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512")
_EC_BY_CURVE = {"P-256": ("ES256",), "P-384": ("ES384",), "P-521": ("ES512",)}
_OKP = ("EdDSA",)
_decode = msgspec.json.decode


class KeySetError(ValueError):
    """A JWKS document the gateway cannot use."""


class VerifyKey:
    """One public key: its ``kid`` (may be None), the algorithms it verifies, and the key object."""

    __slots__ = ("kid", "algorithms", "key")

    def __init__(self, kid: str | None, algorithms: tuple[str, ...], key: Any) -> None:
        self.kid = kid
        self.algorithms = algorithms
        self.key = key

    def __repr__(self) -> str:
        return f"VerifyKey(kid={self.kid!r}, algorithms={self.algorithms!r})"


class KeySet:
    """Keys by ``kid``; ``unnamed`` holds the keys without one (used when a token names no kid).
    ``fingerprint``: a digest of the document, so a refetch that changed nothing is recognised."""

    __slots__ = ("by_kid", "unnamed", "fingerprint")

    def __init__(self, keys: list[VerifyKey], fingerprint: str) -> None:
        self.by_kid = {key.kid: key for key in keys if key.kid is not None}
        self.unnamed = tuple(key for key in keys if key.kid is None)
        self.fingerprint = fingerprint

    def __len__(self) -> int:
        return len(self.by_kid) + len(self.unnamed)

    def candidates(self, kid: str | None) -> tuple[VerifyKey, ...]:
        """The keys a token naming ``kid`` may be verified with (none: the kid is unknown). A token
        without a kid may use any key when the set has exactly one."""
        if kid is not None:
            key = self.by_kid.get(kid)
            return () if key is None else (key,)
        if len(self) == 1:
            return self.unnamed or tuple(self.by_kid.values())
        return self.unnamed


EMPTY_KEY_SET = KeySet([], "")


def parse_key_set(document: bytes) -> KeySet:
    """The usable keys of a JWKS document (``{"keys": [...]}``); KeySetError if there is none."""
    if len(document) > MAX_KEY_SET_BYTES:
        raise KeySetError(f"the key set is {len(document)} bytes, more than {MAX_KEY_SET_BYTES}")
    try:
        body = _decode(document)
    except msgspec.DecodeError:
        raise KeySetError("the key set is not JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("keys"), list):
        raise KeySetError('the key set is not a JWKS document (no "keys" list)')
    keys = [key for jwk in body["keys"][:MAX_KEYS] if (key := _verify_key(jwk)) is not None]
    if not keys:
        raise KeySetError("the key set holds no usable signing key (RSA, EC or OKP, use sig)")
    return KeySet(keys, hashlib.sha256(document).hexdigest()[:16])


def _verify_key(jwk: Any) -> VerifyKey | None:
    if not isinstance(jwk, dict) or jwk.get("use", "sig") != "sig":
        return None
    kty, alg, kid = jwk.get("kty"), jwk.get("alg"), jwk.get("kid")
    if kid is not None and not isinstance(kid, str):
        return None
    if kty == "RSA":
        kinds, loader = _RSA, RSAAlgorithm
    elif kty == "EC":
        kinds, loader = _EC_BY_CURVE.get(jwk.get("crv"), ()), ECAlgorithm
    elif kty == "OKP":
        kinds, loader = _OKP, OKPAlgorithm
    else:
        return None  # oct (a shared secret) and anything unknown
    if alg is not None:
        kinds = (alg,) if alg in kinds else ()
    if not kinds:
        return None
    try:
        key = loader.from_jwk(jwk)
    except Exception:  # noqa: BLE001 - pyjwt raises several types for a malformed key; the key is skipped
        return None
    if hasattr(key, "private_numbers") or hasattr(key, "private_bytes_raw"):
        key = key.public_key()  # a JWKS should never hold private parts; verify with the public half
    return VerifyKey(kid, kinds, key)
