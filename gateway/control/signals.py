"""Where the control plane reads its load signals on a provider's Prometheus page. Pure.

A *preset* names, per signal, the gauges a kind of server publishes; the spec may override any of
them and filter the series by pool and model label (docs/control-plane.md, "Metrics"). Each signal
is a list of *alternatives* tried in order; an alternative is one gauge or a sum of gauges written
``a + b``. The first alternative whose every gauge has a series on the page (after the label
filters) gives the value; none does: the signal is *missing*, and says why.

Across the series of one gauge (engines, ranks, models, pools): queue depth and ready endpoints are
summed, KV-cache utilisation takes the highest (the fullest engine is the one that refuses work).

Preset names, as the projects publish them:

- ``llm-d-epp``: the endpoint picker's pool gauges, label ``name`` = the InferencePool.
  ``llm_d_epp_average_queue_size``, ``llm_d_epp_average_kv_cache_utilization``,
  ``llm_d_epp_ready_endpoints`` (llm-d/llm-d-router, pkg/epp/metrics/metrics.go), else their
  deprecated ``inference_pool_average_queue_size``, ``inference_pool_average_kv_cache_utilization``,
  ``inference_pool_ready_pods`` (kubernetes-sigs/gateway-api-inference-extension,
  site-src/guides/metrics-and-observability.md), which older EPPs publish alone.
- ``vllm``: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``; ``vllm:kv_cache_usage_perc``
  (0..1), else the deprecated ``vllm:gpu_cache_usage_perc``; label ``model_name``
  (vllm-project/vllm, vllm/v1/metrics/loggers.py).
- ``sglang``: ``sglang:num_running_reqs`` + ``sglang:num_queue_reqs``; ``sglang:token_usage`` (0..1);
  label ``model_name`` (sgl-project/sglang, python/sglang/srt/metrics/collector.py).
- ``tgi``: ``tgi_batch_current_size`` + ``tgi_queue_size``; TGI publishes no KV-cache gauge
  (huggingface/text-generation-inference, docs/source/reference/metrics.md).
- ``auto`` (the default): the mock provider's ``mock_queue_depth`` / ``mock_kv_cache_utilization``,
  else vLLM's names: what the control plane read before presets existed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

QUEUE_DEPTH, KV_CACHE, READY_ENDPOINTS = "queue_depth", "kv_cache", "ready_endpoints"
SIGNAL_WORDS = {QUEUE_DEPTH: "queue depth", KV_CACHE: "KV-cache", READY_ENDPOINTS: "ready endpoints"}
_HIGHEST = frozenset((KV_CACHE,))  # combined by max over series; the others are summed

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Alternative = tuple[str, ...]  # gauges summed


@dataclass(frozen=True, slots=True)
class Preset:
    queue_depth: tuple[Alternative, ...]
    kv_cache: tuple[Alternative, ...]
    ready_endpoints: tuple[Alternative, ...]
    pool_label: str | None
    model_label: str | None


PRESETS: dict[str, Preset] = {
    "auto": Preset(
        queue_depth=(("mock_queue_depth",), ("vllm:num_requests_running", "vllm:num_requests_waiting")),
        kv_cache=(("mock_kv_cache_utilization",), ("vllm:kv_cache_usage_perc",), ("vllm:gpu_cache_usage_perc",)),
        ready_endpoints=(), pool_label=None, model_label="model_name",
    ),
    "llm-d-epp": Preset(
        queue_depth=(("llm_d_epp_average_queue_size",), ("inference_pool_average_queue_size",)),
        kv_cache=(("llm_d_epp_average_kv_cache_utilization",), ("inference_pool_average_kv_cache_utilization",)),
        ready_endpoints=(("llm_d_epp_ready_endpoints",), ("inference_pool_ready_pods",)),
        pool_label="name", model_label=None,
    ),
    "vllm": Preset(
        queue_depth=(("vllm:num_requests_running", "vllm:num_requests_waiting"),),
        kv_cache=(("vllm:kv_cache_usage_perc",), ("vllm:gpu_cache_usage_perc",)),
        ready_endpoints=(), pool_label=None, model_label="model_name",
    ),
    "sglang": Preset(
        queue_depth=(("sglang:num_running_reqs", "sglang:num_queue_reqs"),),
        kv_cache=(("sglang:token_usage",),),
        ready_endpoints=(), pool_label=None, model_label="model_name",
    ),
    "tgi": Preset(
        queue_depth=(("tgi_batch_current_size", "tgi_queue_size"),),
        kv_cache=(),
        ready_endpoints=(), pool_label=None, model_label=None,
    ),
}


def parse_alternatives(texts: Sequence[str]) -> tuple[Alternative, ...]:
    """``["a + b", "c"]`` -> ``(("a", "b"), ("c",))``; ValueError naming a malformed entry."""
    alternatives = []
    for text in texts:
        names = tuple(part.strip() for part in text.split("+"))
        bad = [name for name in names if not _NAME.match(name)]
        if bad:
            raise ValueError(f"{text!r} is not a metric name or a sum of names (`a + b`)")
        alternatives.append(names)
    return tuple(alternatives)


def label_problem(label: str) -> str | None:
    return None if _LABEL.match(label) else f"{label!r} is not a Prometheus label name"


def describe(alternatives: Sequence[Alternative]) -> str:
    return " or ".join(" + ".join(names) for names in alternatives)


@dataclass(frozen=True, slots=True)
class SignalPlan:
    """What to read on one provider's page: the needed signals' alternatives and the label filters."""

    signals: tuple[tuple[str, tuple[Alternative, ...]], ...]  # (signal, alternatives), only the needed ones
    filters: tuple[tuple[str, str], ...] = ()  # (label, value): a series must carry every one
    preset: str = "auto"

    @property
    def wanted(self) -> frozenset[str]:
        return frozenset(name for _, alternatives in self.signals for names in alternatives for name in names)

    def describe_filters(self) -> str:
        return ",".join(f'{label}="{value}"' for label, value in self.filters)


@dataclass(frozen=True, slots=True)
class Reading:
    """The signals found on one page (None: missing) and, per missing signal, why."""

    values: Mapping[str, float | None]
    missing: tuple[tuple[str, str], ...] = ()  # (signal, why)

    def value(self, signal: str) -> float | None:
        return self.values.get(signal)


# --------------------------------------------------------------------------- the page


Series = list[tuple[dict[str, str], float]]


def parse_series(text: str, names: frozenset[str]) -> dict[str, Series]:
    """Every finite sample of the named gauges with its labels, in page order.

    Parsed by ``prometheus_client``'s parser, line by line over the lines that can hold a wanted
    sample: one garbled line on a provider's page costs only that line, and a large page (vLLM's
    histograms) is not parsed whole for a few gauges.
    """
    prefixes = tuple(names)
    found: dict[str, Series] = {}
    if not prefixes:
        return found
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(prefixes):
            continue
        try:
            families = list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            continue
        for family in families:
            for sample in family.samples:
                if sample.name in names and math.isfinite(sample.value):
                    found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


def _matching(series: Series, filters: tuple[tuple[str, str], ...]) -> list[float]:
    return [value for labels, value in series if all(labels.get(label) == want for label, want in filters)]


def read_signals(text: str, plan: SignalPlan) -> Reading:
    """The plan's signals as found on the page ``text``."""
    series = parse_series(text, plan.wanted)
    values: dict[str, float | None] = {}
    missing: list[tuple[str, str]] = []
    for signal, alternatives in plan.signals:
        value = None
        filtered_out = False
        for names in alternatives:
            per_name = [_matching(series.get(name, []), plan.filters) for name in names]
            if all(per_name):
                combine = max if signal in _HIGHEST else sum
                value = combine(combine(values_) for values_ in per_name)
                break
            filtered_out = filtered_out or all(series.get(name) for name in names)
        values[signal] = value
        if value is None:
            what = f"no {describe(alternatives)} on the page"
            if filtered_out:
                what = f"no series of {describe(alternatives)} with {plan.describe_filters()}"
            missing.append((signal, what))
    return Reading(values, tuple(missing))
