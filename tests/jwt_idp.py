"""A local identity provider for the tests: signing keys the test makes, tokens, a JWKS document, and a
tiny HTTP server serving OIDC discovery and the JWKS (docs/identity.md).

The server runs in a thread on loopback; the test swaps its keys (rotation), makes it answer 503 or
garbage (an IdP outage) and counts the JWKS fetches it served.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

ISSUER_AUDIENCE = "gridgate"


class SigningKey:
    """A private key, its kid and the algorithm it signs with."""

    def __init__(self, alg: str, kid: str) -> None:
        self.alg = alg
        self.kid = kid
        if alg.startswith(("RS", "PS")):
            self.private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self._to_jwk = RSAAlgorithm.to_jwk
        elif alg.startswith("ES"):
            curve = {"ES256": ec.SECP256R1(), "ES384": ec.SECP384R1(), "ES512": ec.SECP521R1()}[alg]
            self.private = ec.generate_private_key(curve)
            self._to_jwk = ECAlgorithm.to_jwk
        else:
            self.private = ed25519.Ed25519PrivateKey.generate()
            self._to_jwk = OKPAlgorithm.to_jwk

    def jwk(self, with_alg: bool = True) -> dict[str, Any]:
        body = dict(self._to_jwk(self.private.public_key(), as_dict=True))
        body.update({"kid": self.kid, "use": "sig"})
        if with_alg:
            body["alg"] = self.alg
        return body

    def public_pem(self) -> bytes:
        return self.private.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo)

    def sign(self, claims: dict[str, Any], **header: Any) -> str:
        headers = {"kid": self.kid, **header}
        return jwt.encode(claims, self.private, algorithm=self.alg, headers=headers)


def jwks(*keys: SigningKey) -> bytes:
    return json.dumps({"keys": [key.jwk() for key in keys]}).encode()


def claims(issuer: str, *, sub: str = "alice", org: str = "acme", lifetime: float = 600, **extra: Any) -> dict[str, Any]:
    now = int(time.time())
    body: dict[str, Any] = {"iss": issuer, "aud": ISSUER_AUDIENCE, "sub": sub, "org": org, "iat": now,
                            "nbf": now, "exp": now + int(lifetime)}
    body.update(extra)
    return body


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned_token(header: dict[str, Any], body: dict[str, Any], signature: bytes = b"") -> str:
    return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(body).encode())}.{_b64(signature)}"


def hmac_with_public_key(key: SigningKey, body: dict[str, Any]) -> str:
    """The alg-confusion attack: HS256 whose secret is the issuer's public key (PEM), which a verifier
    that takes the header's alg at its word would accept."""
    header = {"alg": "HS256", "typ": "JWT", "kid": key.kid}
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(body).encode())}"
    signature = hmac.new(key.public_pem(), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


class LocalIdp:
    """An OIDC issuer on loopback: ``/.well-known/openid-configuration`` and ``/jwks``."""

    def __init__(self, *keys: SigningKey, max_age: int | None = 300) -> None:
        self.keys = list(keys)
        self.max_age = max_age
        # "ok", "down" (503), "garbage" (200 with a body that is no JWKS) or "hang" (no answer until the mode
        # changes: the gateway's fetch times out); ``stop_serving`` closes the port itself.
        self.mode = "ok"
        self.jwks_fetches = 0
        idp = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                while idp.mode == "hang":
                    time.sleep(0.05)
                try:
                    self._answer()
                except OSError:  # the client gave up (it timed out while the IdP hung)
                    pass

            def _answer(self) -> None:
                if self.path == "/.well-known/openid-configuration":
                    body = json.dumps({"issuer": idp.issuer, "jwks_uri": idp.issuer + "/jwks"}).encode()
                elif self.path == "/jwks":
                    idp.jwks_fetches += 1
                    if idp.mode == "down":
                        self.send_error(503)
                        return
                    body = b"<html>maintenance</html>" if idp.mode == "garbage" else jwks(*idp.keys)
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("content-type", "application/json")
                if idp.max_age is not None:
                    self.send_header("cache-control", f"public, max-age={idp.max_age}")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._handler = Handler
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.issuer = f"http://127.0.0.1:{self.port}"
        self._serving = False

    def _serve(self) -> None:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self._serving = True

    def stop_serving(self) -> None:
        """The IdP's process is gone: its port refuses connections until ``resume_serving``."""
        if self._serving:
            self._serving = False
            self.server.shutdown()
            self.server.server_close()

    def resume_serving(self) -> None:
        """Back on the same port (the issuer URL does not change)."""
        if not self._serving:
            self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
            self._serve()

    def __enter__(self) -> LocalIdp:
        self._serve()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode = "ok"  # (a handler that hangs returns)
        self.stop_serving()
