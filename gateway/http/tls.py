"""HTTPS on the data-plane listener (``server_tls``): the one way its TLS context is built, and its reload.

``server_tls_context`` is used by the workers and by ``gridgate check``, so a certificate that passes
the check loads in the listener. ``ReloadableServerTls`` keeps one context for the listening socket
and hands every new handshake the newest loaded one (from the SNI callback, which OpenSSL runs for
every ClientHello, with or without a server name): a reload never touches connections already open,
and a certificate that fails to load leaves the previous one in service.
"""

from __future__ import annotations

import ssl

from gateway.http.client_certs import CertificateRefusals, ClientTrust, counting_refusals, trust_clients

ALPN = ["http/1.1"]


def _no_passphrase() -> bytes:
    # An encrypted key would otherwise make OpenSSL ask on the terminal; the gateway has nothing to give.
    return b""


def server_tls_context(cert_file: str, key_file: str, clients: ClientTrust | None = None) -> ssl.SSLContext:
    """TLS 1.2 or newer, ALPN ``http/1.1``, client certificates verified against ``clients`` when
    given; raises OSError or ssl.SSLError when the files do not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION  # client-initiated renegotiation only costs us CPU
    context.set_alpn_protocols(ALPN)
    context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    if clients is not None:
        trust_clients(context, clients)
    return context


def load_problem(exc: OSError) -> str:
    """One line for a failed load (ssl.SSLError is an OSError)."""
    return str(getattr(exc, "reason", None) or exc.strerror or exc)


class ReloadableServerTls:
    """The listener's TLS context; ``reload`` re-reads the files for new handshakes.

    With ``clients``, the CA bundle and CRL file are re-read too, each connection starts from the
    newest context (its CA store and its session cache: a TLS 1.2 session from before a reload does
    not resume after it), and ``refusals`` counts the handshakes refused for their client certificate. Whether a certificate is required and whether CRLs are checked
    stay as the listening context has them: a change of those is a change of the config, which
    starts new workers.
    """

    def __init__(self, cert_file: str, key_file: str, clients: ClientTrust | None = None) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.clients = clients
        self.context = server_tls_context(cert_file, key_file, clients)  # given to the listening socket
        self._current = self.context
        self.context.sni_callback = self._select
        self.refusals: CertificateRefusals | None = None
        if clients is not None:
            self.refusals = CertificateRefusals()
            counting_refusals(self.context, self.refusals, self._newest)

    def _newest(self) -> ssl.SSLContext:
        return self._current

    def _select(self, ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self._current
        if current is not context:
            ssl_object.context = current

    def reload(self) -> str | None:
        """Load the files again; None when done, else why not (the previous certificate stays)."""
        try:
            context = server_tls_context(self.cert_file, self.key_file, self.clients)
        except OSError as exc:
            return load_problem(exc)
        self._current = context
        return None
