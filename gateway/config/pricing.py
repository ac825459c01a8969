"""The pricing part of the gateway configuration: ``pricing`` (docs/configuration.md, docs/pricing.md).

Split from :mod:`gateway.config` (which re-exports every name here) so each schema module stays
small. Prices are written in USD per million tokens, as providers' price pages do, and converted
to integer nano-USD per million tokens by gateway.pricing.units (the same function here, to judge
them, and when the price book is built).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from gateway.pricing.units import parse_usd_per_million
from gateway.yaml_config import Seconds, StrictStruct, check_ranges

# A decimal string ("0.075") or a YAML number (0.075, 3): USD per million tokens.
UsdPerMillion = str | int | float

MAX_GLOB = 256  # characters of a model glob


class PriceOverride(StrictStruct):
    """The prices of the models one glob matches, USD per million tokens; 0 is free."""

    input: UsdPerMillion
    output: UsdPerMillion
    cached_input: UsdPerMillion | None = None  # default: the input price
    cache_write: UsdPerMillion | None = None  # default: the input price
    reasoning: UsdPerMillion | None = None  # default: the output price

    def __post_init__(self) -> None:
        for name in ("input", "output", "cached_input", "cache_write", "reasoning"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                parse_usd_per_million(value)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None


MAX_WEBHOOK_HEADERS = 32
_FRAMING_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "content-type"})


class AlertsWebhook(StrictStruct):
    """Where the supervisor posts spend alerts (docs/pricing.md, "Alerts"): an ``http://`` or ``https://``
    URL, a per-attempt timeout, how many times a failed post is tried again (with exponential backoff
    from ``backoff``, doubling, at most ``max_backoff``), and extra request headers (an authorization)."""

    url: str
    timeout: Seconds = Seconds(5)
    retries: int = 8
    backoff: Seconds = Seconds(1)
    max_backoff: Seconds = Seconds(60)
    headers: dict[str, str] = {}

    def __post_init__(self) -> None:
        problem = webhook_url_problem(self.url)
        if problem is not None:
            raise ValueError(f"url: {problem}")
        check_ranges(self, {"timeout": (0.001, 300.0), "retries": (0, 1000), "backoff": (0.001, 3600.0),
                            "max_backoff": (0.001, 86400.0)})
        if len(self.headers) > MAX_WEBHOOK_HEADERS:
            raise ValueError(f"headers: at most {MAX_WEBHOOK_HEADERS}")
        for name, value in self.headers.items():
            if not name or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(f"headers: {name!r} is not a header name")
            if name.lower() in _FRAMING_HEADERS:
                raise ValueError(f"headers: {name} is set by the gateway")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"headers: the value of {name} must not hold CR, LF or NUL")


def webhook_url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "names no host"
    if any(c in url for c in " \r\n\0"):
        return "must not hold spaces or control characters"
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        return "has an invalid port"
    return None


class Pricing(StrictStruct):
    # Model glob -> prices; the first glob (in file order) matching the served model wins over the table.
    overrides: dict[str, PriceOverride] = {}
    # A model neither the overrides nor the table price: reject it, charge it nothing, or price it as
    # its nearest relative in the table.
    unpriced: Literal["reject", "zero", "estimate"] = "zero"
    # Spend alerts' webhook: a URL, or an object with url, timeout, retries, backoff, max_backoff, headers.
    alerts_webhook: str | AlertsWebhook | None = None
    # gridgate_spend_nanousd_total gets a ``key`` label (kid or alias): one series per key, so opt-in.
    metrics_per_key: bool = False

    @property
    def webhook(self) -> AlertsWebhook | None:
        """``alerts_webhook`` in its object form (a URL alone takes the defaults)."""
        hook = self.alerts_webhook
        return AlertsWebhook(url=hook) if isinstance(hook, str) else hook

    def __post_init__(self) -> None:
        if isinstance(self.alerts_webhook, str):
            problem = webhook_url_problem(self.alerts_webhook)
            if problem is not None:
                raise ValueError(f"alerts_webhook: {problem}")
        for glob in self.overrides:
            if not glob.strip():
                raise ValueError("overrides: a model glob must not be empty")
            if len(glob) > MAX_GLOB:
                raise ValueError(f"overrides: a model glob must be at most {MAX_GLOB} characters")
