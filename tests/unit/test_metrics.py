"""The worker metrics row and its Prometheus text: what a worker writes is what a scraper parses,
under stable labels, and every family is documented with its type and labels."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics.catalogue import COUNTERS, FIRST_BYTE_BUCKETS_S, MAX_CLUSTERS, MAX_TENANTS
from gateway.metrics.labels import LabelRegistry
from gateway.metrics.render import render_prometheus
from gateway.metrics.writer import WorkerMetrics
from gateway.quota.counters import TenantTokens
from gateway.routing.eligibility import MISSING_FEATURE, OUTSIDE_REGION, TOO_SMALL
from workers.access_log import AccessLog
from workers.line_writer import LineWriter

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def parsed(row: list[int], clusters: tuple[str, ...] = (), tenants: tuple[str, ...] = ()) -> dict[str, dict]:
    """family name -> {(sample name, sorted labels): value}, through prometheus_client's own parser."""
    text = render_prometheus(row, clusters, tenants).decode()
    return {
        family.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def sample(families: dict[str, dict], family: str, name: str, **labels: str) -> float | None:
    return families[family].get((name, tuple(sorted(labels.items()))))


def test_latency_histograms_put_each_response_in_its_le_bucket_under_its_cluster():
    row = [0] * COUNTERS
    metrics = WorkerMetrics(row, ("provider-a", "provider-b"))
    metrics.upstream_latency("provider-a", 0.004, 0.02)
    metrics.upstream_latency("provider-a", 0.005, 0.5)  # exactly on a bound: counted in that bucket (le)
    metrics.upstream_latency("provider-a", 75.0, 900.0)  # past the last bounds: +Inf only
    metrics.upstream_latency("unregistered", 1.0, 2.0)  # a cluster the registry has no room for
    families = parsed(row, ("provider-a", "provider-b"))
    first = "gridgate_upstream_first_byte_seconds"
    assert sample(families, first, f"{first}_bucket", cluster="provider-a", le="0.005") == 2.0
    assert sample(families, first, f"{first}_bucket", cluster="provider-a", le="60.0") == 2.0
    assert sample(families, first, f"{first}_bucket", cluster="provider-a", le="+Inf") == 3.0
    assert sample(families, first, f"{first}_count", cluster="provider-a") == 3.0
    assert sample(families, first, f"{first}_sum", cluster="provider-a") == 75.009
    duration = "gridgate_upstream_duration_seconds"
    assert sample(families, duration, f"{duration}_bucket", cluster="provider-a", le="0.01") == 0.0
    assert sample(families, duration, f"{duration}_bucket", cluster="provider-a", le="0.025") == 1.0
    assert sample(families, duration, f"{duration}_bucket", cluster="provider-a", le="0.5") == 2.0
    assert sample(families, duration, f"{duration}_bucket", cluster="provider-a", le="600.0") == 2.0
    assert sample(families, duration, f"{duration}_count", cluster="provider-a") == 3.0
    assert sample(families, duration, f"{duration}_sum", cluster="provider-a") == 900.52
    assert sample(families, duration, f"{duration}_count", cluster="other") == 1.0
    # A cluster without responses has no series (17 empty buckets each would only be noise).
    assert sample(families, first, f"{first}_count", cluster="provider-b") is None
    buckets = [labels for name, labels in families[first] if name.endswith("_bucket") and
               dict(labels)["cluster"] == "provider-a"]
    assert len(buckets) == len(FIRST_BYTE_BUCKETS_S) + 1


def test_every_error_the_gateway_answers_itself_is_counted_by_status():
    row = [0] * COUNTERS
    metrics = WorkerMetrics(row, ("provider-a",))
    for status in (403, 422, 422, 401, 418):  # model_not_allowed, no_eligible_provider (twice), ..., unlisted
        metrics.request(None, status)
    metrics.request(None, 200)  # GET /v1/models: answered by the gateway, not an error
    metrics.request("provider-a", 502)  # about a provider: counted under its cluster instead
    families = parsed(row, ("provider-a",))
    errors = {dict(labels)["status"]: value for (_, labels), value in families["gridgate_gateway_errors"].items()}
    assert {status: value for status, value in errors.items() if value} == {"403": 1, "422": 2, "401": 1, "other": 1}
    assert sample(families, "gridgate_requests", "gridgate_requests_total", cluster="gateway", code="4xx") == 5.0
    assert sample(families, "gridgate_requests", "gridgate_requests_total", cluster="provider-a", code="5xx") == 1.0


def test_failovers_cooling_and_filters_count_under_their_labels():
    row = [0] * COUNTERS
    metrics = WorkerMetrics(row, ("provider-a", "provider-b"))
    metrics.failover("provider-a")
    metrics.failover("provider-a")
    metrics.failover("elsewhere")
    metrics.cooled("provider-b")
    metrics.route_filtered(TOO_SMALL)
    metrics.route_filtered(TOO_SMALL | OUTSIDE_REGION)
    metrics.route_filtered(MISSING_FEATURE)
    metrics.retry()
    families = parsed(row, ("provider-a", "provider-b"))
    failovers = "gridgate_provider_failovers"
    assert sample(families, failovers, f"{failovers}_total", cluster="provider-a") == 2.0
    assert sample(families, failovers, f"{failovers}_total", cluster="provider-b") == 0.0
    assert sample(families, failovers, f"{failovers}_total", cluster="other") == 1.0
    cooled = "gridgate_provider_cooled"
    assert sample(families, cooled, f"{cooled}_total", cluster="provider-b") == 1.0
    assert sample(families, cooled, f"{cooled}_total", cluster="other") is None  # only once it counted
    filtered = "gridgate_route_filtered"
    assert {labels[0][1]: value for (_, labels), value in families[filtered].items()} == {
        "context_window": 2.0, "feature": 1.0, "region": 1.0}
    assert sample(families, "gridgate_upstream_retries", "gridgate_upstream_retries_total") == 1.0


def test_tenant_tokens_keep_their_labels_across_generations_with_different_tenant_lists():
    registry = LabelRegistry(MAX_TENANTS)
    registry.register(["team-a", "team-b"])
    row_old, row_new = [0] * COUNTERS, [0] * COUNTERS
    old_tokens = TenantTokens(["team-a", "team-b"])
    old_tokens.add(old_tokens.slot("team-b"), 100, 20, 120)
    old_tokens.add(old_tokens.slot("stranger"), 7, 3, 10)  # an unconfigured tenant: other
    WorkerMetrics(row_old, (), registry.names).publish_tenant_tokens(old_tokens)
    registry.register(["team-c", "team-b"])  # the reload drops team-a, adds team-c, reorders
    new_tokens = TenantTokens(["team-c", "team-b"])
    new_tokens.add(new_tokens.slot("team-b"), 5, 1, 6)
    new_tokens.add(new_tokens.slot("team-c"), 40, 4, 44)
    new_worker = WorkerMetrics(row_new, (), registry.names)
    new_worker.publish_tenant_tokens(new_tokens)
    new_worker.publish_tenant_tokens(new_tokens)  # published every second: copies, never adds
    families = parsed([a + b for a, b in zip(row_old, row_new, strict=True)], (), registry.names)
    counted = {(dict(labels)["tenant"], dict(labels)["direction"]): value
               for (_, labels), value in families["gridgate_tenant_tokens"].items()}
    assert counted == {
        ("team-a", "in"): 0.0, ("team-a", "out"): 0.0, ("team-b", "in"): 105.0, ("team-b", "out"): 21.0,
        ("team-c", "in"): 40.0, ("team-c", "out"): 4.0, ("other", "in"): 7.0, ("other", "out"): 3.0,
    }


def test_a_managed_keys_tenant_registered_after_the_worker_forked_is_counted_under_its_own_name():
    # The supervisor registers the tenant when its key reaches the table (after this worker forked, so the
    # worker's registry names lack it) and the key's entry carries the index: the worker counts it there.
    registry = LabelRegistry(MAX_TENANTS)
    registry.register(["team-a"])
    worker = WorkerMetrics(row := [0] * COUNTERS, (), registry.names)  # forked now
    registry.register(["team-m"])
    tokens = TenantTokens(["team-a"])
    tokens.add(tokens.slot("team-m", registry.index_of("team-m")), 30, 3, 33)
    tokens.add(tokens.slot("team-a"), 1, 1, 2)
    worker.publish_tenant_tokens(tokens)
    families = parsed(row, (), registry.names)
    for tenant, value in (("team-m", 30.0), ("team-a", 1.0), ("other", 0.0)):
        assert sample(families, "gridgate_tenant_tokens", "gridgate_tenant_tokens_total", tenant=tenant,
                      direction="in") == value


def test_tenants_past_the_registry_capacity_add_up_under_other():
    registry = LabelRegistry(capacity=1)
    assert registry.register(["team-a", "team-b", "team-c"]) == ["team-b", "team-c"]
    row = [0] * COUNTERS
    tokens = TenantTokens(["team-a", "team-b", "team-c"])
    for tenant in ("team-a", "team-b", "team-c", "stranger"):
        tokens.add(tokens.slot(tenant), 10, 1, 11)
    WorkerMetrics(row, (), registry.names).publish_tenant_tokens(tokens)
    families = parsed(row, (), registry.names)
    assert sample(families, "gridgate_tenant_tokens", "gridgate_tenant_tokens_total", tenant="team-a",
                  direction="in") == 10.0
    assert sample(families, "gridgate_tenant_tokens", "gridgate_tenant_tokens_total", tenant="other",
                  direction="in") == 30.0
    assert sample(families, "gridgate_tenant_tokens", "gridgate_tenant_tokens_total", tenant="other",
                  direction="out") == 3.0


def test_access_log_drops_reach_the_metrics(tmp_path):
    async def dropped_lines() -> int:
        access_log = AccessLog(LineWriter(str(tmp_path / "access.log"), max_buffer_bytes=256))
        for _ in range(20):  # no await between them: the loop never flushes, the small buffer fills
            access_log.rejected(400, "bad_request")
        await access_log.close()
        return access_log.dropped

    dropped = asyncio.run(dropped_lines())
    assert dropped > 0
    row = [0] * COUNTERS
    WorkerMetrics(row, ()).publish_access_log(dropped)
    families = parsed(row)
    assert sample(families, "gridgate_access_log_dropped", "gridgate_access_log_dropped_total") == dropped
    written = (tmp_path / "access.log").read_text().splitlines()
    assert len(written) + dropped == 20


# --------------------------------------------------------------------------- the documented table

_ROW = re.compile(r"^\| `(gridgate_[a-z_]+)` \| (counter|gauge|histogram) \|([^|]*)\|", re.M)
_SUFFIX = {"counter": "_total", "gauge": "", "histogram": ""}


def test_every_worker_family_is_documented_with_its_type_and_labels():
    """Every cell set to 1 so every family and label shows up; the docs row names the family (with the
    suffix a scraper sees), its type, and exactly its label names (values in parentheses aside)."""
    documented = {name: (kind, set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", labels))))
                  for name, kind, labels in _ROW.findall(DOCS.read_text())}
    text = render_prometheus([1] * COUNTERS, tuple(f"c{n}" for n in range(MAX_CLUSTERS)), ("team-a",)).decode()
    families = list(text_string_to_metric_families(text))
    assert len(families) >= 19
    for family in families:
        name = family.name + _SUFFIX[family.type]
        assert name in documented, f"{name} is not in docs/operations.md's metrics table"
        kind, labels = documented[name]
        assert kind == family.type, f"{name}: documented as {kind}, exported as {family.type}"
        exported = {label for s in family.samples for label in s.labels if label != "le"}
        assert labels == exported, f"{name}: documented labels {sorted(labels)}, exported {sorted(exported)}"


def test_the_cluster_and_tenant_label_sets_are_bounded():
    text = render_prometheus([1] * COUNTERS, tuple(f"c{n}" for n in range(MAX_CLUSTERS + 10)),
                             tuple(f"t{n}" for n in range(MAX_TENANTS + 10))).decode()
    clusters = set(re.findall(r'cluster="([^"]+)"', text))
    tenants = set(re.findall(r'tenant="([^"]+)"', text))
    assert len(clusters) == MAX_CLUSTERS + 2  # the registry's names, other, gateway
    assert {"other", "gateway", "c63"} <= clusters and "c64" not in clusters
    assert len(tenants) == MAX_TENANTS + 1 and "other" in tenants and f"t{MAX_TENANTS}" not in tenants


def test_published_tenant_tokens_are_the_per_slot_sums_of_the_gate_tenants():
    """``publish_tenant_tokens`` writes only the cells of the gate's tenants: the row is what a sum over
    every slot of the registry gives (names past it and ``other`` added up under ``other``; a zero sum
    leaves its cell as it is), whatever the registry and the gate's names."""
    from gateway.metrics.catalogue import OTHER_TENANT, TENANT_TOKENS

    pick = random.Random(5)
    names = [f"team-{n}" for n in range(8)] + ["other"]
    for _ in range(300):
        registry = pick.sample(names[:-1], pick.randint(0, 6))
        tokens = TenantTokens(pick.sample(names, pick.randint(0, 9)))
        for slot in range(len(tokens.names)):
            tokens.add(slot, pick.choice((None, 0, 3, 70)), pick.choice((None, 0, 5)), 80)
        row = [pick.choice((0, 1, 99)) for _ in range(COUNTERS)]
        expected = list(row)
        per_slot = [0] * ((MAX_TENANTS + 1) * 2)
        index = {name: i for i, name in enumerate(registry)}
        for position, name in enumerate(tokens.names):
            at = index.get(name, OTHER_TENANT) * 2
            per_slot[at] += tokens.tokens_in[position]
            per_slot[at + 1] += tokens.tokens_out[position]
        for offset, value in enumerate(per_slot):
            if value:
                expected[TENANT_TOKENS + offset] = value
        WorkerMetrics(row, (), registry).publish_tenant_tokens(tokens)
        assert row == expected
