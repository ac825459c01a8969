"""Request-aware eligibility (docs/routing.md#request-aware-selection): what each candidate can do
(facts from ``routing.models``) and what a request needs, and why a candidate cannot serve it. Pure.

Facts are resolved once per overlay revision (glob matching at plan build, never per request). A
candidate no ``routing.models`` entry matches has no restriction: any context, every feature, no
region. A tenant with ``allowed_regions`` accepts only candidates whose region is listed: an unknown
region cannot be shown to comply, so it is not eligible (data residency errs on the safe side).
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from gateway.config import ModelFacts
from gateway.http.errors import ErrorReply
from gateway.request.features import (  # noqa: F401 - re-exported: the bits are routing's vocabulary too
    ALL_FEATURES,
    AUDIO,
    EMBEDDINGS,
    FEATURE_BIT,
    FEATURES,
    JSON_SCHEMA,
    TOOLS,
    VISION,
)

# Why a candidate was filtered (bits, so one candidate can fail several ways), and their names in the
# access log and the metrics.
TOO_SMALL, MISSING_FEATURE, OUTSIDE_REGION = 1, 2, 4
REASONS = ((TOO_SMALL, "context_window"), (MISSING_FEATURE, "feature"), (OUTSIDE_REGION, "region"))


def reason_names(bits: int) -> list[str]:
    return [name for bit, name in REASONS if bits & bit]


class Facts:
    """What one candidate can serve."""

    __slots__ = ("context_window", "features", "region", "weight")

    def __init__(self, context_window: int = 0, features: int = ALL_FEATURES, region: str | None = None,
                 weight: int = 1) -> None:
        self.context_window = context_window  # 0: no limit known
        self.features = features
        self.region = region
        self.weight = weight  # traffic_weight for the weighted picker (never derived from scores)

    @property
    def restricts(self) -> bool:
        return bool(self.context_window) or self.features != ALL_FEATURES


UNRESTRICTED = Facts()


class FactsTable:
    """``routing.models`` entries in order; the first one matching a candidate gives its facts."""

    def __init__(self, entries: Sequence[ModelFacts]) -> None:
        self._entries = [
            (entry.match.capability, entry.match.cluster, Facts(
                entry.context_window or 0,
                ALL_FEATURES if entry.features is None else sum(FEATURE_BIT[f] for f in set(entry.features)),
                entry.region,
                entry.traffic_weight or 1,
            ))
            for entry in entries
        ]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def facts(self, capability: str, cluster: str) -> Facts:
        for pattern, only_cluster, facts in self._entries:
            if (only_cluster is None or only_cluster == cluster) and fnmatchcase(capability, pattern):
                return facts
        return UNRESTRICTED


class Needs:
    """What one request needs from a provider: tokens of context, features, allowed regions."""

    __slots__ = ("tokens", "features", "regions")

    def __init__(self, tokens: int = 0, features: int = 0, regions: frozenset[str] | None = None) -> None:
        self.tokens = tokens  # prompt estimate + max tokens
        self.features = features
        self.regions = regions

    def reasons(self, facts: Facts) -> int:
        """0 when ``facts`` can serve these needs, else the reason bits."""
        reasons = 0
        if facts.context_window and self.tokens > facts.context_window:
            reasons |= TOO_SMALL
        if self.features & ~facts.features:
            reasons |= MISSING_FEATURE
        if self.regions is not None and facts.region not in self.regions:
            reasons |= OUTSIDE_REGION
        return reasons


def no_eligible_provider(label: str, needs: Needs, filtered: Sequence[tuple[int, Facts]]) -> ErrorReply:
    """Nothing is left after the filters: 400 ``context_length_exceeded`` when only the context window
    excluded candidates, else 422 ``no_eligible_provider`` naming the reasons."""
    counts = {TOO_SMALL: 0, MISSING_FEATURE: 0, OUTSIDE_REGION: 0}
    for reasons, _facts in filtered:
        for bit in counts:
            if reasons & bit:
                counts[bit] += 1
    if counts[MISSING_FEATURE] == counts[OUTSIDE_REGION] == 0:
        largest = max(facts.context_window for _, facts in filtered)
        return ErrorReply(
            400, "context_length_exceeded",
            f"This request needs about {needs.tokens} tokens (prompt estimate plus max tokens), more than the "
            f"largest context window of the {label}'s providers ({largest} tokens).",
            error_type="invalid_request_error",
        )
    parts = []
    if counts[TOO_SMALL]:
        parts.append(f"{counts[TOO_SMALL]} with a context window under {needs.tokens} tokens")
    if counts[MISSING_FEATURE]:
        wanted = ", ".join(name for name in FEATURES if needs.features & FEATURE_BIT[name])
        parts.append(f"{counts[MISSING_FEATURE]} without {wanted}")
    if counts[OUTSIDE_REGION]:
        allowed = ", ".join(sorted(needs.regions or ()))
        parts.append(f"{counts[OUTSIDE_REGION]} outside the allowed regions ({allowed})")
    return ErrorReply(422, "no_eligible_provider",
                      f"No provider of the {label} can serve this request: {'; '.join(parts)}.")
