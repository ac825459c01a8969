"""The control plane's metric presets, names and label filters against recorded pages of each kind of
provider (tests/fixtures/metrics), and how a missing gauge is reported. Pure."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError
from gateway.control.decide import Observation, assess, decide
from gateway.control.observe import observation_from_page
from gateway.control.signals import KV_CACHE, QUEUE_DEPTH, SignalPlan, read_signals
from gateway.control.spec import ControlSpec, parse_spec
from gateway.control.telemetry import ControlTelemetry, missing_changes

PAGES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"
SCOPE = {"network": "net", "gateway": "gw", "namespace": "ns", "local_site": "east"}


def page(name: str) -> str:
    return (PAGES / name).read_text()


def spec_for(metrics: dict[str, Any] | None = None, *, strategy: str = "queueDepth",
             own: list[dict[str, Any] | None] | None = None, **scoring: Any) -> ControlSpec:
    providers = []
    for index, block in enumerate(own or [None]):
        entry: dict[str, Any] = {"name": f"p{index}", "site": "east", "models": [f"m{index}"],
                                 "health_url": f"http://p{index}.test/health",
                                 "metrics_url": f"http://p{index}.test/metrics"}
        if block is not None:
            entry["metrics"] = block
        providers.append(entry)
    policy: dict[str, Any] = {"strategy": strategy, **scoring}
    if metrics is not None:
        policy["metrics"] = metrics
    return parse_spec(yaml.safe_dump({"output": "o.json", "scope": SCOPE, "scoringPolicy": policy,
                                      "providers": providers}))


def observe(spec: ControlSpec, text: str, provider: int = 0) -> Observation:
    return observation_from_page(text, spec.signal_plan(spec.providers[provider]))


def problems(**kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        spec_for(**kw)
    return info.value.problems


# --------------------------------------------------------------------------- recorded pages, one per preset


@pytest.mark.parametrize(("pool", "queue", "kv", "ready"), [("qwen3-pool", 4.5, 0.62, 4.0),
                                                            ("llama-pool", 1.0, 0.35, 2.0)])
def test_llm_d_epp_page_is_read_per_pool(pool: str, queue: float, kv: float, ready: float) -> None:
    spec = spec_for({"preset": "llm-d-epp", "pool": pool}, kvCacheThreshold=0.9)
    observation = observe(spec, page("llm-d-epp.prom"))
    assert (observation.queue_depth, observation.kv_cache_utilization, observation.ready_endpoints) == (
        queue, kv, ready)
    assert (observation.error, observation.missing) == (None, ())
    assessed = assess(spec, observation)
    assert (assessed.admission, assessed.fresh, assessed.score is not None) == ("new_and_existing", True, True)


def test_an_older_epp_publishing_only_the_inference_pool_names_is_read_too() -> None:
    spec = spec_for({"preset": "llm-d-epp", "pool": "vllm-llama3-8b-instruct"}, strategy="kvCachePressure",
                    queueDepthThreshold=32)
    observation = observe(spec, page("llm-d-epp-legacy.prom"))
    assert (observation.queue_depth, observation.kv_cache_utilization, observation.ready_endpoints) == (38, 0.9375, 3)
    # Both over their thresholds: bound sessions finish there, new ones go elsewhere.
    assert assess(spec, observation).admission == "existing_only"


def test_vllm_page_sums_queues_over_engines_and_takes_the_fullest_kv_cache() -> None:
    spec = spec_for({"preset": "vllm", "model": "meta-llama/Llama-3.1-8B-Instruct"}, kvCacheThreshold=0.9)
    observation = observe(spec, page("vllm.prom"))
    assert (observation.queue_depth, observation.kv_cache_utilization) == (14 + 11 + 3 + 0, 0.7112)
    assert observation.ready_endpoints is None and observation.error is None  # vLLM has no such gauge


def test_sglang_page_is_read_across_data_parallel_ranks() -> None:
    spec = spec_for({"preset": "sglang", "model": "Qwen/Qwen3-32B"}, strategy="kvCachePressure",
                    queueDepthThreshold=64)
    observation = observe(spec, page("sglang.prom"))
    assert (observation.queue_depth, observation.kv_cache_utilization) == (21 + 17 + 5 + 2, 0.81)


def test_tgi_page_gives_a_queue_depth() -> None:
    observation = observe(spec_for({"preset": "tgi"}), page("tgi.prom"))
    assert (observation.queue_depth, observation.error) == (9 + 4, None)


def test_default_preset_reads_the_mock_then_vllm_names_as_before() -> None:
    spec = spec_for(kvCacheThreshold=0.9)
    assert observe(spec, 'mock_queue_depth{provider="p"} 2\nvllm:num_requests_running 9\n'
                         "vllm:num_requests_waiting 1\nmock_kv_cache_utilization 0.4\n").queue_depth == 2
    vllm = observe(spec, page("vllm.prom"))
    assert (vllm.queue_depth, vllm.kv_cache_utilization) == (28, 0.7112)


def test_names_in_the_spec_replace_the_preset_and_sum_with_a_plus() -> None:
    spec = spec_for({"preset": "llm-d-epp", "pool": "qwen3-pool",
                     "queueDepth": ["llm_d_epp_average_queue_size + llm_d_epp_average_running_requests"]})
    assert observe(spec, page("llm-d-epp.prom")).queue_depth == 4.5 + 12.25


def test_a_provider_block_overrides_the_policy_for_that_provider_only() -> None:
    spec = spec_for({"preset": "llm-d-epp", "pool": "llama-pool"},
                    own=[None, {"pool": "qwen3-pool"}, {"preset": "tgi"}])
    assert [observe(spec, page("llm-d-epp.prom"), i).queue_depth for i in (0, 1)] == [1.0, 4.5]
    assert observe(spec, page("tgi.prom"), 2).queue_depth == 13


# --------------------------------------------------------------------------- what a page lacks is reported


def test_a_page_without_the_configured_gauge_is_reported_and_published_stale() -> None:
    spec = spec_for({"preset": "vllm"})
    observation = observe(spec, page("llm-d-epp.prom"))  # an EPP read as if it were vLLM
    assert observation.missing == (QUEUE_DEPTH,)
    assert observation.error == ("metrics: queue depth: no vllm:num_requests_running + vllm:num_requests_waiting "
                                 "on the page")
    assessed = assess(spec, observation)
    assert (assessed.admission, assessed.fresh, assessed.score) == ("new_and_existing", False, None)


def test_a_pool_filter_that_matches_no_series_says_so() -> None:
    spec = spec_for({"preset": "llm-d-epp", "pool": "gone-pool"})
    observation = observe(spec, page("llm-d-epp.prom"))
    assert observation.missing == (QUEUE_DEPTH, "ready_endpoints")
    assert 'no series of llm_d_epp_average_queue_size or inference_pool_average_queue_size with name="gone-pool"' in (
        observation.error or "")


def test_zero_ready_endpoints_takes_the_provider_out() -> None:
    text = page("llm-d-epp.prom").replace('llm_d_epp_ready_endpoints{name="qwen3-pool"} 4',
                                          'llm_d_epp_ready_endpoints{name="qwen3-pool"} 0')
    spec = spec_for({"preset": "llm-d-epp", "pool": "qwen3-pool"})
    observation = observe(spec, text)
    assert observation.ready_endpoints == 0
    assessed = assess(spec, observation)
    assert (assessed.admission, assessed.reason) == ("none", "0 ready endpoints")
    document = decide(spec, {"p0": observation}).document
    assert document["candidates"][0]["admission_state"] == "none"


def test_a_garbled_line_costs_only_itself_and_non_finite_values_are_skipped() -> None:
    plan = SignalPlan(((QUEUE_DEPTH, (("mock_queue_depth",),)), (KV_CACHE, (("mock_kv_cache_utilization",),))))
    reading = read_signals('mock_queue_depth{provider="p" 3\nmock_queue_depth{provider="q",note="a\\nb"} 2\n'
                           "mock_queue_depth_total 99\nmock_kv_cache_utilization NaN\n", plan)
    assert (reading.value(QUEUE_DEPTH), reading.value(KV_CACHE)) == (2.0, None)
    assert [signal for signal, _ in reading.missing] == [KV_CACHE]


def test_missing_signals_are_logged_once_when_they_go_and_when_they_come_back() -> None:
    plans = {"a": SignalPlan(((QUEUE_DEPTH, (("x",),)),), (("name", "pool-a"),), "llm-d-epp")}
    went = missing_changes({}, {"a": (QUEUE_DEPTH,)}, plans)
    assert went == [(logging.WARNING, 'a: the metrics page lacks its queue depth gauge (preset llm-d-epp, '
                                      'name="pool-a"); published without it')]
    assert missing_changes({"a": (QUEUE_DEPTH,)}, {"a": (QUEUE_DEPTH,)}, plans) == []
    assert missing_changes({"a": (QUEUE_DEPTH,)}, {"a": ()}, plans) == [
        (logging.INFO, "a: its queue depth gauge is readable again")]


def test_the_missing_metric_gauge_follows_each_round_and_ignores_unreachable_rounds() -> None:
    spec = spec_for({"preset": "llm-d-epp", "pool": "qwen3-pool"})
    telemetry = ControlTelemetry({"p0": spec.signal_plan(spec.providers[0])})

    def missing(signal: str) -> float | None:
        return telemetry.registry.get_sample_value("gridgate_control_metric_missing",
                                                   {"provider": "p0", "signal": signal})

    assert missing("queue depth") == 0
    telemetry.observed({"p0": observe(spec, page("vllm.prom"))})
    assert (missing("queue depth"), missing("ready endpoints")) == (1, 1)
    telemetry.observed({"p0": Observation(healthy=False, error="health: connection refused")})
    assert missing("queue depth") == 1  # nothing was learnt about the page
    telemetry.observed({"p0": observe(spec, page("llm-d-epp.prom"))})
    assert (missing("queue depth"), missing("ready endpoints")) == (0, 0)
    assert telemetry.registry.get_sample_value("gridgate_control_rounds_total") == 3


# --------------------------------------------------------------------------- spec errors name the field


def test_a_preset_without_the_needed_gauge_is_a_spec_error() -> None:
    assert problems(metrics={"preset": "tgi"}, strategy="kvCachePressure") == [
        "scoringPolicy.metrics.preset: the tgi preset names no KV-cache gauge and scoringPolicy needs one: "
        "list it in kvCache"]


def test_label_filters_need_a_label_the_preset_or_the_spec_names() -> None:
    assert problems(metrics={"preset": "llm-d-epp"}, own=[{"model": "m"}]) == [
        "providers[0].metrics.model: the llm-d-epp preset has no model label: set modelLabel"]
    spec = spec_for({"preset": "tgi", "pool": "p", "poolLabel": "pool"})
    assert spec.signal_plan(spec.providers[0]).filters == (("pool", "p"),)
    assert problems(metrics={"pool": "p", "poolLabel": "bad-label"}) == [
        "scoringPolicy.metrics.poolLabel: 'bad-label' is not a Prometheus label name"]


def test_metric_names_are_checked() -> None:
    assert problems(metrics={"queueDepth": ["ok_name + not a name"]}) == [
        "scoringPolicy.metrics.queueDepth: 'ok_name + not a name' is not a metric name or a sum of names (`a + b`)"]
    assert problems(metrics={"preset": "prometheus"})[0].startswith("scoringPolicy.metrics.preset: expected ")
