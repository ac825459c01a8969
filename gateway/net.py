"""Low-level network helpers every layer shares: the one address parser and the one TLS client context.

Imports nothing from gridgate, so the config, the cluster model, the health prober, the control plane
and the worker can all use it without pulling each other in.
"""

from __future__ import annotations

import ssl


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid address {text!r}, expected host:port")
    return host.strip("[]"), int(port)


def client_tls_context(*, ca_file: str | None = None, verify: bool = True) -> ssl.SSLContext:
    """A TLS client context: the system CAs (or ``ca_file``); ``verify=False`` skips certificate and host checks."""
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
