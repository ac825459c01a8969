"""The ``cors`` block of the gateway configuration (docs/configuration.md, docs/cors.md).

Split from :mod:`gateway.config` (which re-exports it) so each schema module stays small; the
entries are judged by the same functions the request path's policy is built with
(gateway/request/cors.py), so what loads is what runs.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.request.cors import DEFAULT_EXPOSE, OriginList, expose_list
from gateway.yaml_config import DAY, Range, Seconds, StrictStruct, check_ranges


class Cors(StrictStruct):
    """Browser clients: which origins' pages may call the data plane (off when the block is absent)."""

    # Exact origins ("https://app.example.com"), "regex:<pattern>" (the whole origin), or "*" alone.
    allowed_origins: list[str]
    # How long a browser may reuse a preflight's answer (browsers cap it: Chrome at 2h).
    max_age: Seconds = Seconds(600)
    # Response headers a page may read: "default" (the gateway's own), or names ("default" among them).
    expose_headers: str | list[str] = DEFAULT_EXPOSE

    _RANGES: ClassVar[dict[str, Range]] = {"max_age": (0, DAY)}  # 0: ask before every request

    def __post_init__(self) -> None:
        check_ranges(self, self._RANGES)
        if not self.allowed_origins:
            raise ValueError("allowed_origins: list at least one origin (or remove the cors block: CORS off)")
        try:
            OriginList(self.allowed_origins)
        except ValueError as exc:
            raise ValueError(f"allowed_origins{exc}") from None
        try:
            expose_list(self.expose_headers)
        except ValueError as exc:
            separator = "" if str(exc).startswith("[") else ": "
            raise ValueError(f"expose_headers{separator}{exc}") from None
