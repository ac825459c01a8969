"""The ``server_tls.client_auth`` block (docs/identity.md, "mTLS"): client certificates on the HTTPS
listener.

Split from :mod:`gateway.config` (which re-exports it) so each schema module stays small. The shape
is checked here; whether the files load is ``gridgate check``'s (gateway/check.py), with the same
function the listener loads them with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from gateway.http.client_certs import ClientTrust
from gateway.yaml_config import StrictStruct


class ClientAuth(StrictStruct):
    """Who may connect, and which tenant a verified client certificate names."""

    ca_file: str  # the CA bundle client certificates must chain to (PEM; relative to the config file)
    # required: a handshake without a valid certificate fails; optional: without one, other credentials.
    mode: Literal["optional", "required"] = "required"
    tenant_from: Literal["subject_cn", "san_uri", "san_dns"] = "subject_cn"
    # The value (CN, SAN URI, SAN DNS name) -> tenant; without it the value itself is the tenant.
    map: dict[str, str] | None = None
    crl_file: str | None = None  # PEM CRLs; with it, a revoked leaf certificate fails the handshake

    def __post_init__(self) -> None:
        if not self.ca_file.strip():
            raise ValueError("ca_file: must name a PEM file of the CA certificates clients chain to")
        if self.crl_file is not None and not self.crl_file.strip():
            raise ValueError("crl_file: must name a PEM file of CRLs (or leave it out)")
        if self.map is not None:
            if not self.map:
                raise ValueError("map: list at least one value (or leave it out: the value is the tenant)")
            for value, tenant in self.map.items():
                if not value or not tenant.strip():
                    raise ValueError(f"map: a certificate value and its tenant must not be empty ({value!r}: {tenant!r})")

    @property
    def required(self) -> bool:
        return self.mode == "required"

    def trust(self, resolve: Callable[[str], str]) -> ClientTrust:
        """What the TLS context needs, with the file paths resolved (``Config.file_path``)."""
        return ClientTrust(resolve(self.ca_file), None if self.crl_file is None else resolve(self.crl_file),
                           self.required)
