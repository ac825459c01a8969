"""The ``tracing`` block of the gateway configuration (docs/configuration.md, docs/tracing.md).

Split from :mod:`gateway.config` (which re-exports it). OpenTelemetry traces are off when the block is
absent; with it, every worker samples requests and exports their spans over OTLP/HTTP (JSON) to
``endpoint`` from a thread of its own, never from the request path.
"""

from __future__ import annotations

from typing import ClassVar
from urllib.parse import urlsplit

from gateway.yaml_config import MINUTE, Range, Seconds, StrictStruct, check_ranges

OTLP_TRACES_PATH = "/v1/traces"


class Tracing(StrictStruct):
    """OpenTelemetry traces of the requests (off when the block is absent)."""

    # The collector's OTLP/HTTP address: ``http://host:4318`` (spans go to ``/v1/traces``), or a full
    # URL whose path is not ``/`` (sent as is).
    endpoint: str
    # Fraction of requests without a sampled client trace that are traced (a sampled parent always is).
    sample: float = 0.01
    service_name: str = "gridgate"
    # Extra headers of the export requests (a collector's credential, a tenant header).
    headers: dict[str, str] = {}
    # Spans a worker holds for export at most; past it new spans are dropped and counted.
    queue_size: int = 2048
    # Spans per export request, at most; an export leaves when this many wait or every flush_interval.
    batch_size: int = 512
    flush_interval: Seconds = Seconds(1)
    # One export request's time limit (connect and answer); a failed export drops its spans.
    timeout: Seconds = Seconds(2)

    _RANGES: ClassVar[dict[str, Range]] = {
        "queue_size": (1, 1_000_000), "batch_size": (1, 100_000), "flush_interval": (0.01, MINUTE),
        "timeout": (0.1, MINUTE),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if not 0.0 <= self.sample <= 1.0:
            raise ValueError("sample: must be between 0.0 and 1.0")
        if not self.service_name.strip():
            raise ValueError("service_name: must not be empty")
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("endpoint: must be an http:// or https:// URL of the collector (http://host:4318)")
        for name in self.headers:
            if not name or not all(33 <= ord(c) <= 126 and c != ":" for c in name):
                raise ValueError(f"headers: {name!r} is not a header name")

    def traces_url(self) -> str:
        """Where the spans are posted: ``endpoint`` + ``/v1/traces`` unless it names a path itself."""
        parts = urlsplit(self.endpoint)
        if parts.path in ("", "/"):
            return self.endpoint.rstrip("/") + OTLP_TRACES_PATH
        return self.endpoint
