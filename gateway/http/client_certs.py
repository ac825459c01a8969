"""Client certificates on the listener's TLS context (``server_tls.client_auth``, docs/identity.md).

``trust_clients`` makes a server context ask for a client certificate and verify it against a CA
bundle (and a CRL file when given): ``required`` fails a handshake without a valid one, ``optional``
fails only a handshake whose certificate does not verify. The listener's context and every reloaded
one are configured here, so ``gridgate check`` loads the files as the workers do.

``CertificateRefusals`` counts the handshakes that failed for want of a good certificate, by reason.
The event loop gives a failed handshake to no protocol and logs it nowhere, so the count is taken in
the TLS object itself: the listening context makes its connections' ``SSLObject`` of a subclass whose
``do_handshake`` notes why it raised (a few calls per handshake, none after it).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import NamedTuple

# Why a handshake was refused, as the metric labels them (docs/identity.md).
REFUSAL_REASONS = ("missing", "untrusted", "expired", "revoked", "crl_unavailable")
# OpenSSL's X509_V_ERR_* codes (x509_vfy.h) that have a reason of their own; the rest are "untrusted".
_BY_VERIFY_CODE = {
    9: "expired", 10: "expired",  # not yet valid, expired
    23: "revoked",
    3: "crl_unavailable", 11: "crl_unavailable", 12: "crl_unavailable",  # no CRL, CRL not yet valid / expired
}
# The reason OpenSSL gives a server whose client sent no certificate although one is required.
_NO_CERTIFICATE = "PEER_DID_NOT_RETURN_A_CERTIFICATE"
_AGAIN = (ssl.SSLWantReadError, ssl.SSLWantWriteError)


class ClientTrust(NamedTuple):
    """Resolved paths of the client-auth files, and whether a certificate is required."""

    ca_file: str
    crl_file: str | None = None
    required: bool = True


class CertificateRefusals:
    """Handshakes refused for their client certificate, per reason (one counter per process)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = dict.fromkeys(REFUSAL_REASONS, 0)

    def note(self, error: ssl.SSLError) -> None:
        if isinstance(error, ssl.SSLCertVerificationError):
            self.counts[_BY_VERIFY_CODE.get(error.verify_code, "untrusted")] += 1
        elif error.reason == _NO_CERTIFICATE:
            self.counts["missing"] += 1


def trust_clients(context: ssl.SSLContext, trust: ClientTrust) -> None:
    """Verify client certificates on ``context`` against ``trust``'s files; raises OSError or
    ssl.SSLError when one does not load."""
    context.verify_mode = ssl.CERT_REQUIRED if trust.required else ssl.CERT_OPTIONAL
    context.load_verify_locations(cafile=trust.ca_file)
    if trust.crl_file is not None:
        context.load_verify_locations(cafile=trust.crl_file)  # the CRLs of a PEM file join the store
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    # A resumed session skips verification: no session tickets (TLS 1.3 then never resumes; a TLS 1.2
    # session id resumes only from the context's own cache, which a reload replaces: counting_refusals).
    context.options |= ssl.OP_NO_TICKET
    context.num_tickets = 0


def counting_refusals(context: ssl.SSLContext, refusals: CertificateRefusals,
                      current: Callable[[], ssl.SSLContext]) -> None:
    """Make the connections of the listening ``context`` count their certificate refusals, and start
    each from ``current()``, the newest loaded context: its CA bundle and CRLs, and its session cache. A
    TLS 1.2 client may resume a session by its id, which skips verification; as the session cache is
    the context's, a session made before a reload does not resume after it (a full handshake verifies
    the certificate against the reloaded files)."""

    class CountedHandshake(ssl.SSLObject):
        @classmethod
        def _create(cls, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, server_side: bool = False,
                    server_hostname: str | None = None, session: ssl.SSLSession | None = None,
                    context: ssl.SSLContext | None = None) -> ssl.SSLObject:
            # SSLContext.wrap_bio's hook (CPython's ssl.py since 3.7); tests/unit/test_client_cert.py
            # proves a reload reaches new handshakes and their session cache through it.
            return super()._create(incoming, outgoing, server_side, server_hostname, session, current())

        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except _AGAIN:
                raise
            except ssl.SSLError as error:
                refusals.note(error)
                raise

    context.sslobject_class = CountedHandshake
