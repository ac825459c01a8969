"""The features a request may use, as bits: what ``gateway.request.capability`` finds in a body and what
request-aware eligibility (``gateway.routing.eligibility``) matches against a candidate's facts. Pure."""

from __future__ import annotations

FEATURES = ("tools", "vision", "json_schema", "audio", "embeddings")
FEATURE_BIT = {name: 1 << index for index, name in enumerate(FEATURES)}
ALL_FEATURES = (1 << len(FEATURES)) - 1
TOOLS, VISION, JSON_SCHEMA, AUDIO, EMBEDDINGS = (FEATURE_BIT[name] for name in FEATURES)
