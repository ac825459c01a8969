"""The console's browser-facing security (docs/console.md#security): the headers every console answer
carries, the same-origin check on changes, and whether the browser reached us over HTTPS."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

# No inline script or style anywhere (the pages use only /console/static files), nothing from another
# origin, no framing, forms post only here.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                           "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "same-origin"),  # no-referrer would make the browser send Origin: null
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
)


def is_https(headers: Mapping[str, str]) -> bool:
    """Whether the browser speaks HTTPS to us: the admin listener is plain HTTP, so only through a TLS
    reverse proxy that says so (``X-Forwarded-Proto: https``; a false claim only makes the cookie
    Secure, which a plain-HTTP browser then never sends back)."""
    return headers.get("x-forwarded-proto", "").split(",")[0].strip().lower() == "https"


def same_origin(headers: Mapping[str, str]) -> bool:
    """False when the request names another site as its origin (a cross-site form post). Browsers send
    ``Origin`` on every POST; a client without one (curl) is not a browser that could be tricked."""
    origin = headers.get("origin")
    if origin is None:
        return headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")
    host = headers.get("x-forwarded-host") or headers.get("host", "")
    return origin != "null" and urlsplit(origin).netloc.lower() == host.split(",")[0].strip().lower()
