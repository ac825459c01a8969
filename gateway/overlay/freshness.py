"""How old the serving overlay is: the time since its ``rendered_at`` (envelope) or ``generated_at``.

Pure. A control plane that republishes at least every ``refresh`` keeps this small; a dead one lets
it grow, which ``gridgate_overlay_age_seconds`` and the ``routing.overlay_max_age`` warning show.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any


def parse_rfc3339(text: Any) -> datetime | None:
    """An RFC 3339 timestamp as an aware datetime; None when absent, unreadable or without an offset."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def rendered_at(provenance: dict[str, Any] | None, generated_at: str | None) -> datetime | None:
    """When the overlay was rendered: ``provenance.rendered_at``, else the document's ``generated_at``."""
    stamp = parse_rfc3339(provenance.get("rendered_at")) if provenance else None
    return stamp if stamp is not None else parse_rfc3339(generated_at)
