"""What verifying a JWT costs a worker, per algorithm (docs/identity.md): a fresh token (the full check:
header, signature, claims, identity), a reused one on a new connection (the verified-token cache: one
SHA-256 and a dictionary lookup) and a reused one on the same keep-alive connection (the connection's kept
grant: the key headers compared in constant time, the grant's expiry and key-set generation checked).

    python -m loadtest.jwt_verify_cost [--seconds 1.0]

Prints one line per algorithm: the token's length, µs per fresh verify, per cached grant and per kept grant
(the best of 5 timeit runs, one core; on a shared machine the figures move by some 10 %).
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from hmac import compare_digest
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from gateway.config import parse_config
from gateway.identity.jwt_keys import parse_key_set
from gateway.identity.jwt_verify import JwtVerifier

ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
_CURVES = {"ES256": ec.SECP256R1, "ES384": ec.SECP384R1, "ES512": ec.SECP521R1}
ISSUER = "https://idp.bench.invalid"
_BASE = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'


def signing_key(alg: str) -> tuple[Any, dict[str, Any]]:
    """A private key for ``alg`` and its public JWK."""
    if alg.startswith(("RS", "PS")):
        private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = RSAAlgorithm.to_jwk(private.public_key(), as_dict=True)
    elif alg.startswith("ES"):
        private = ec.generate_private_key(_CURVES[alg]())
        jwk = ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
    else:
        private = ed25519.Ed25519PrivateKey.generate()
        jwk = OKPAlgorithm.to_jwk(private.public_key(), as_dict=True)
    jwk.update({"kid": "k1", "use": "sig", "alg": alg})
    return private, jwk


def measure(alg: str, seconds: float) -> tuple[int, float, float, float]:
    """(token bytes, µs per fresh verify, per cached grant, per kept grant) for ``alg``."""
    private, jwk = signing_key(alg)
    entry = {"name": "bench", "issuer": ISSUER, "audience": ["gridgate"], "jwks_file": "k.json",
             "algorithms": [alg], "tenant_claim": "org"}
    config = parse_config(_BASE + "auth: {jwt: [" + json.dumps(entry) + "]}\n")
    verifier = JwtVerifier(config.auth.jwt)
    verifier.set_keys("bench", parse_key_set(json.dumps({"keys": [jwk]}).encode()))
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": "gridgate", "sub": "client", "org": "acme", "iat": now, "exp": now + 3600,
              "scope": "llm.use", "email": "client@example.com"}
    token = jwt.encode(claims, private, algorithm=alg, headers={"kid": "k1"}).encode()
    clock = time.time()
    fresh = _per_call_us(lambda: verifier.verify(token, clock), seconds)
    cached = _per_call_us(lambda: verifier.grant(token, clock), seconds)
    grant, header, kept_header = verifier.grant(token, clock), b"Bearer " + token, bytes(b"Bearer " + token)
    kept = _per_call_us(lambda: compare_digest(kept_header, header) and compare_digest(b"", b"")
                        and verifier.current(grant, time.time()), seconds)
    return len(token), fresh, cached, kept


def _per_call_us(call: Any, seconds: float) -> float:
    call()
    number = max(1, int(seconds / max(timeit.timeit(call, number=1), 1e-7)))
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="per timeit run")
    args = parser.parse_args(argv)
    print("| alg | token bytes | fresh token, µs | reused, new connection, µs | reused, same connection, µs |")
    print("|---|---|---|---|---|")
    for alg in ALGORITHMS:
        length, fresh, cached, kept = measure(alg, args.seconds)
        print(f"| {alg} | {length} | {fresh:.1f} | {cached:.2f} | {kept:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
