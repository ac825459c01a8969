"""Client certificates at the head gate (``server_tls.client_auth``, docs/identity.md "mTLS").

Built only when the listener verifies client certificates; the head gate (workers/head_gate.py) asks
it only for a request that no API key identified. The TLS layer verified the certificate during the
handshake; what it names (``gateway.identity.client_cert``) is read from the transport on the
connection's first request and kept with the connection, so every later request on it costs one
attribute read.
"""

from __future__ import annotations

from asyncio import BaseTransport
from typing import Protocol

from gateway.identity.auth import KeyIdentity
from gateway.identity.client_cert import CertificateTenants

# A connection's slot before its certificate was read (a read one holds an identity, a refusal or None).
NOT_READ = False


class CertifiedConnection(Protocol):
    transport: BaseTransport | None
    peer_identity: KeyIdentity | str | None | bool  # NOT_READ until the first request reads it


class ConnectionCertificates:
    """One per worker: who a connection's client certificate says it is."""

    __slots__ = ("tenants",)

    def __init__(self, tenants: CertificateTenants) -> None:
        self.tenants = tenants

    def __call__(self, conn: CertifiedConnection) -> KeyIdentity | str | None:
        """The connection's identity; None without a certificate; a refusal message when its
        certificate names no tenant (``CertificateTenants.identify``)."""
        known = conn.peer_identity
        if known is not NOT_READ:
            return known  # type: ignore[return-value]
        transport = conn.transport
        peercert = None if transport is None else transport.get_extra_info("peercert")
        identity = self.tenants.identify(peercert)
        conn.peer_identity = identity
        return identity
