"""The ``metrics`` blocks of the control-plane spec (``scoringPolicy.metrics`` and a provider's own), and
their resolution into the provider's :class:`~gateway.control.signals.SignalPlan`.

Kept apart from :mod:`gateway.control.spec` so the spec module stays one screenful of schema; the
presets and the page reading themselves are in :mod:`gateway.control.signals`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.control.signals import (
    KV_CACHE,
    PRESETS,
    QUEUE_DEPTH,
    READY_ENDPOINTS,
    SIGNAL_WORDS,
    SignalPlan,
    label_problem,
    parse_alternatives,
)
from gateway.yaml_config import StrictStruct as _Strict


class MetricsSource(_Strict):
    """Where the load signals are on a provider's metrics page (gateway.control.signals).

    In ``scoringPolicy.metrics`` it applies to every provider. A provider's own ``metrics`` block
    overrides the keys it sets; one naming another ``preset`` (another kind of server) starts afresh
    from that preset instead, inheriting nothing. A name list replaces the preset's; ``[]`` reads no
    such signal.
    """

    preset: Literal["auto", "llm-d-epp", "vllm", "sglang", "tgi"] | None = None
    queue_depth: list[str] | None = msgspec.field(name="queueDepth", default=None)
    kv_cache: list[str] | None = msgspec.field(name="kvCache", default=None)
    ready_endpoints: list[str] | None = msgspec.field(name="readyEndpoints", default=None)
    pool_label: str | None = msgspec.field(name="poolLabel", default=None)
    model_label: str | None = msgspec.field(name="modelLabel", default=None)
    pool: str | None = None  # only series whose pool label has this value
    model: str | None = None  # only series whose model label has this value


def merged(base: MetricsSource, override: MetricsSource | None) -> MetricsSource:
    """``override``'s keys where it sets them, else ``base``'s (all of ``override`` if it names a preset)."""
    if override is None:
        return base
    if override.preset is not None and override.preset != (base.preset or "auto"):
        return override
    fields = {name: getattr(override, name) if getattr(override, name) is not None else getattr(base, name)
              for name in MetricsSource.__struct_fields__}
    return MetricsSource(**fields)


def resolve_signals(policy: MetricsSource, own: MetricsSource | None, needed: list[str],
                    own_path: str = "providers[?].metrics") -> tuple[SignalPlan, list[str]]:
    """A provider's signal plan (its ``metrics`` block over ``scoringPolicy.metrics``) for the ``needed``
    signals, and the problems found resolving it, each naming the block that set the key at fault."""
    source = merged(policy, own)

    def path(attribute: str, key: str) -> str:
        block = own_path if own is not None and getattr(own, attribute) is not None else "scoringPolicy.metrics"
        return f"{block}.{key}"

    problems: list[str] = []
    preset_name = source.preset or "auto"
    preset = PRESETS[preset_name]
    keys = {QUEUE_DEPTH: "queueDepth", KV_CACHE: "kvCache", READY_ENDPOINTS: "readyEndpoints"}
    signals = []
    for signal in needed:
        names = getattr(source, signal)
        try:
            alternatives = getattr(preset, signal) if names is None else parse_alternatives(names)
        except ValueError as exc:
            problems.append(f"{path(signal, keys[signal])}: {exc}")
            continue
        if alternatives:
            signals.append((signal, alternatives))
        elif signal != READY_ENDPOINTS:
            where = path(signal, keys[signal]) if names is not None else path("preset", "preset")
            problems.append(f"{where}: the {preset_name} preset names no {SIGNAL_WORDS[signal]} gauge and "
                            f"scoringPolicy needs one: list it in {keys[signal]}")
    filters = []
    for attribute in ("pool", "model"):
        value = getattr(source, attribute)
        if value is None:
            continue
        label_key = f"{attribute}_label"
        label = getattr(source, label_key) or getattr(preset, label_key)
        if label is None:
            problems.append(f"{path(attribute, attribute)}: the {preset_name} preset has no {attribute} label: "
                            f"set {attribute}Label")
        elif (problem := label_problem(label)) is not None:
            problems.append(f"{path(label_key, attribute + 'Label')}: {problem}")
        else:
            filters.append((label, value))
    return SignalPlan(tuple(signals), tuple(filters), preset_name), problems
