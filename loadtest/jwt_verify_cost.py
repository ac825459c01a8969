"""What verifying a JWT costs a worker, per algorithm (docs/identity.md): a fresh token (the full check:
header, signature, claims, identity) and a reused one (the verified-token cache: one SHA-256 and a
dictionary lookup).

    python -m loadtest.jwt_verify_cost [--seconds 1.0]

Prints one line per algorithm: µs per fresh verify and per cached grant (the best of 5 timeit runs, one
core; on a shared machine the figures move by some 10 %).
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from gateway.config import parse_config
from gateway.identity.jwt_keys import parse_key_set
from gateway.identity.jwt_verify import JwtVerifier

ALGORITHMS = ("RS256", "PS256", "ES256", "ES384", "EdDSA")
ISSUER = "https://idp.bench.invalid"
_BASE = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'


def signing_key(alg: str) -> tuple[Any, dict[str, Any]]:
    """A private key for ``alg`` and its public JWK."""
    if alg.startswith(("RS", "PS")):
        private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = RSAAlgorithm.to_jwk(private.public_key(), as_dict=True)
    elif alg.startswith("ES"):
        private = ec.generate_private_key(ec.SECP256R1() if alg == "ES256" else ec.SECP384R1())
        jwk = ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
    else:
        private = ed25519.Ed25519PrivateKey.generate()
        jwk = OKPAlgorithm.to_jwk(private.public_key(), as_dict=True)
    jwk.update({"kid": "k1", "use": "sig", "alg": alg})
    return private, jwk


def measure(alg: str, seconds: float) -> tuple[float, float]:
    """(µs per fresh verify, µs per cached grant) for ``alg``."""
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
    return fresh, cached


def _per_call_us(call: Any, seconds: float) -> float:
    call()
    number = max(1, int(seconds / max(timeit.timeit(call, number=1), 1e-7)))
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="per timeit run")
    args = parser.parse_args(argv)
    print(f"{'alg':<6} {'fresh token µs':>15} {'reused token µs':>16}")
    for alg in ALGORITHMS:
        fresh, cached = measure(alg, args.seconds)
        print(f"{alg:<6} {fresh:>15.1f} {cached:>16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
