"""Client certificates -> who a request is (docs/identity.md, "mTLS"). Pure.

The TLS layer has verified the certificate against ``server_tls.client_auth.ca_file`` before anything
here runs; what is left is reading the one value that names the client (the subject CN, a SAN URI
such as a SPIFFE ID, or a SAN DNS name) from the certificate as ``ssl`` decodes it
(``SSLObject.getpeercert()``), and mapping it to a tenant. It runs once per connection, not per
request: the server keeps the answer with the connection.

An identity made here is a ``KeyIdentity`` (so limits, budgets, spend and the access log see it as
they see a key's) with ``via`` ``mtls`` and the certificate's value as its alias (its subject); one
object per value, kept in a bounded table, so the connections of one client share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.identity.auth import KeyIdentity

VIA = "mtls"  # KeyIdentity.via of a certificate's identity
TENANT_SOURCES = ("subject_cn", "san_uri", "san_dns")
_SAN_TYPE = {"san_uri": "URI", "san_dns": "DNS"}
_WHAT = {"subject_cn": "subject CN", "san_uri": "SAN URI", "san_dns": "SAN DNS name"}
# Distinct values whose identity is kept (without a map the values are whatever the CA signs).
MAX_IDENTITIES = 4096
# A value quoted in a refusal is cut here (it comes from a certificate the CA signed, but may be long).
_QUOTED = 200


def peer_identity(tenant: str, subject: str) -> KeyIdentity:
    """What a verified client certificate proves: its tenant, and (as the alias, as a JWT's subject is)
    the value that named it."""
    return KeyIdentity(tenant, subject, via=VIA)


def certificate_values(peercert: Mapping[str, Any], tenant_from: str) -> list[str]:
    """The values of ``tenant_from`` in a certificate as ``getpeercert()`` decodes it, most specific
    first: the subject's CNs from the last one (RFC 6125 reads the last as the most specific), or the
    SANs of that type in certificate order."""
    if tenant_from == "subject_cn":
        names = [value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"]
        return names[::-1]
    wanted = _SAN_TYPE[tenant_from]
    return [value for kind, value in peercert.get("subjectAltName", ()) if kind == wanted]


class CertificateTenants:
    """Maps verified client certificates to identities; one per worker, built from the config."""

    __slots__ = ("tenant_from", "mapping", "_identities")

    def __init__(self, tenant_from: str, mapping: Mapping[str, str] | None = None) -> None:
        if tenant_from not in TENANT_SOURCES:
            raise ValueError(f"tenant_from: one of {', '.join(TENANT_SOURCES)}")
        self.tenant_from = tenant_from
        self.mapping = None if mapping is None else dict(mapping)
        self._identities: dict[str, KeyIdentity] = {}

    def identify(self, peercert: Mapping[str, Any] | None) -> KeyIdentity | str | None:
        """The identity of a verified certificate; None without one (no certificate was sent); a
        refusal message when the certificate names no tenant (no such value, or one the map lacks)."""
        if not peercert:
            return None
        values = certificate_values(peercert, self.tenant_from)
        what = _WHAT[self.tenant_from]
        if not values:
            return f"the client certificate has no {what}"
        mapping = self.mapping
        if mapping is None:
            return self._identity(values[0], values[0])
        for value in values:
            tenant = mapping.get(value)
            if tenant is not None:
                return self._identity(value, tenant)
        shown = values[0] if len(values[0]) <= _QUOTED else values[0][:_QUOTED] + "..."
        return f"the client certificate's {what} {shown!r} maps to no tenant"

    def _identity(self, subject: str, tenant: str) -> KeyIdentity:
        identities = self._identities
        identity = identities.get(subject)
        if identity is None:
            identity = peer_identity(tenant, subject)
            if len(identities) < MAX_IDENTITIES:
                identities[subject] = identity
        return identity
