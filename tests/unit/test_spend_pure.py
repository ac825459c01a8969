"""The pure parts of spend reporting (docs/pricing.md): the rollups' layout and batch, the report's query
and grouping, the table, the bounded metric labels, the alert outbox, and the status-pipe messages."""

from __future__ import annotations

import os

import pytest

from gateway.process_protocol import SpendAlertReport, SpendCounts, StatusReader, try_send_status
from gateway.spend import rollups, series
from gateway.spend.alerts import AlertOutbox, SpendAlert
from gateway.spend.report import QueryProblem, parse_query, spend_report, spend_table
from gateway.spend.rollups import RollupBatch, RollupRow, day_number, parse_hash, tenant_hash, tenants_set
from gateway.spend.series import OTHER, SpendCounters, SpendSums

TODAY = day_number("2026-12-01")
ALERT = SpendAlert("team-a", "tenant", "daily", "2026-12-01T00:00:00Z", 0.5, 5, 10)


def q(**params: str):
    return parse_query({name.rstrip("_"): [value] for name, value in params.items()}, TODAY)


# ---------------------------------------------------------------------------------------------- rollups


def test_one_script_per_day_carries_every_nonzero_counter_of_its_tenants():
    batch = RollupBatch()
    batch.add((TODAY, "team-a", "ci", "gpt-4o"), 100, 20, 10, 0, 5000)
    batch.add((TODAY, "team-a", "ci", "gpt-4o"), 50, 0, 5, 2, 1000)
    batch.add((TODAY, "team-b", "-", "m:with\x1fodd|chars"), 1, 0, 0, 0, 0)
    batch.add((TODAY - 1, "team-a", "ci", "gpt-4o"), 1, 0, 1, 0, 7)  # a request that ended before midnight
    scripts = batch.scripts("flush-1")
    assert len(scripts) == 2
    today = next(script for script in scripts if script[3] == rollups.flush_marker(TODAY, "flush-1"))
    command, _, numkeys, *rest = today
    assert command == "EVAL" and numkeys == 4
    keys, args = rest[:numkeys], rest[numkeys:]
    assert keys == [rollups.flush_marker(TODAY, "flush-1"), tenants_set(TODAY), tenant_hash(TODAY, "team-a"),
                    tenant_hash(TODAY, "team-b")]
    assert all("{2026-12-01}" in key for key in keys)  # one Cluster slot per day
    assert args[0] == rollups.expires_at(TODAY) == (TODAY + 402) * 86400
    suffix = "\x1fci\x1fgpt-4o"
    assert args[1:3] == ["team-a", 6] and dict(zip(args[3:15:2], args[4:15:2], strict=True)) == {
        "r" + suffix: 2, "p" + suffix: 150, "c" + suffix: 20, "o" + suffix: 15, "x" + suffix: 2, "n" + suffix: 6000}
    assert args[15:] == ["team-b", 2, "r\x1f-\x1fm:with\x1fodd|chars", 1, "p\x1f-\x1fm:with\x1fodd|chars", 1]


def test_the_cost_counter_is_written_and_parsed_back_with_the_model_whole():
    batch = RollupBatch()
    batch.add((TODAY, "t", "k", "a\x1fb"), 3, 1, 2, 1, 123)
    fields = {}
    args = batch.scripts("x")[0][6:]  # EVAL, the script, 3 keys: the marker, the tenants set, the hash
    pairs = args[3:]
    for field, value in zip(pairs[0::2], pairs[1::2], strict=True):
        fields[field.encode()] = str(value).encode()
    fields[b"junk"] = b"1"
    assert parse_hash(TODAY, "t", fields) == [RollupRow(TODAY, "t", "k", "a\x1fb", (1, 3, 1, 2, 1, 123, 0, 0, 0))]


def test_a_subjects_cell_is_parsed_back_with_its_identity_apart():
    batch = RollupBatch()
    batch.add((TODAY, "t", "jwt:okta\x1ealice", "m"), 3, 0, 2, 0, 5)
    batch.add((TODAY, "t", "alice", "m"), 1, 0, 1, 0, 1)
    args = batch.scripts("x")[0][6:]
    pairs = args[3:]
    fields = {field.encode(): str(value).encode() for field, value in zip(pairs[0::2], pairs[1::2], strict=True)}
    assert sorted(parse_hash(TODAY, "t", fields), key=lambda row: row.identity) == [
        RollupRow(TODAY, "t", "alice", "m", (1, 1, 0, 1, 0, 1, 0, 0, 0)),
        RollupRow(TODAY, "t", "alice", "m", (1, 3, 0, 2, 0, 5, 0, 0, 0), "jwt:okta")]


def test_a_subject_holding_the_rollup_separators_keeps_its_own_row_and_the_model_whole():
    # A subject is whatever the IdP or the certificate says: "\x1f" in it must not split into the model.
    from gateway.identity.auth import KeyIdentity
    identity = KeyIdentity("t", alias="a\x1fb\x1ec", via="jwt:okta")
    batch = RollupBatch()
    batch.add((TODAY, "t", identity.rollup_name, "m"), 1, 0, 1, 0, 1)
    pairs = batch.scripts("x")[0][6:][3:]
    fields = {field.encode(): str(value).encode() for field, value in zip(pairs[0::2], pairs[1::2], strict=True)}
    assert parse_hash(TODAY, "t", fields) == [
        RollupRow(TODAY, "t", "a\ufffdb\ufffdc", "m", (1, 1, 0, 1, 0, 1, 0, 0, 0), "jwt:okta")]


def test_a_full_batch_refuses_new_cells_but_keeps_counting_known_ones(monkeypatch):
    monkeypatch.setattr(rollups, "MAX_CELLS", 2)
    batch = RollupBatch()
    assert batch.add((TODAY, "a", "-", "m"), 1, 0, 1, 0, 1) and batch.add((TODAY, "b", "-", "m"), 1, 0, 1, 0, 1)
    assert not batch.add((TODAY, "c", "-", "m"), 1, 0, 1, 0, 1)
    assert batch.add((TODAY, "a", "-", "m"), 1, 0, 1, 0, 1) and batch.cells[(TODAY, "a", "-", "m")][0] == 2


# ---------------------------------------------------------------------------------------------- report


def test_the_query_defaults_to_the_last_30_days_grouped_by_day():
    query = q()
    assert (query.first_day, query.last_day, query.group_by) == (TODAY - 29, TODAY, "day")
    assert q(to="2026-01-31").first_day == day_number("2026-01-02")
    assert len(q(from_="2025-01-01", to="2026-02-04").days) == 400


@pytest.mark.parametrize(("params", "problem"), [
    ({"from": ["2026-02-30"]}, "from: must be a date YYYY-MM-DD, not '2026-02-30'"),
    ({"to": ["20261201"]}, "to: must be a date YYYY-MM-DD"),
    ({"from": ["2026-12-02"], "to": ["2026-12-01"]}, "to: 2026-12-01 is before from 2026-12-02"),
    ({"from": ["2025-01-01"], "to": ["2026-02-05"]}, "from: the range spans 401 days; at most 400"),
    ({"group_by": ["hour"]}, "group_by: must be one of day, model, key, tenant"),
    ({"tenant": [""]}, "tenant: must be 1..256 characters"),
    ({"kid": ["a", "b"]}, "kid: give it once"),
    ({"limit": ["3"]}, "limit: unknown query parameter"),
])
def test_a_bad_parameter_is_named(params, problem):
    with pytest.raises(QueryProblem) as caught:
        parse_query(params, TODAY)
    assert str(caught.value).startswith(problem)


ROWS = [
    RollupRow(TODAY, "team-a", "ci", "m", (2, 100, 10, 20, 5, 1_500_000_000)),
    RollupRow(TODAY, "team-a", "web", "n", (1, 10, 0, 2, 0, 7)),
    RollupRow(TODAY - 1, "team-b", "-", "m", (1, 10, 0, 2, 0, 3)),
]


def test_rows_are_grouped_each_way_with_exact_decimal_costs_and_totals():
    by_model = spend_report(q(group_by="model"), ROWS)
    assert [(row["model"], row["requests"], row["cost_nusd"]) for row in by_model["data"]] == [
        ("m", 3, 1_500_000_003), ("n", 1, 7)]
    assert by_model["data"][0]["cost_usd"] == "1.500000003"
    assert by_model["totals"] == {"requests": 4, "tokens_prompt": 120, "tokens_cached": 10, "tokens_completion": 24,
                                  "tokens_reasoning": 5, "cost_nusd": 1_500_000_010, "cost_usd": "1.50000001",
                                  "cache_hits": 0, "saved_tokens": 0, "saved_nusd": 0, "saved_usd": "0"}
    assert [row["day"] for row in spend_report(q(), ROWS)["data"]] == ["2026-11-30", "2026-12-01"]
    assert [row["key"] for row in spend_report(q(group_by="key", tenant="team-a"), ROWS)["data"]] == ["ci", "web"]
    only = spend_report(q(group_by="tenant", model="m", kid="-"), ROWS)
    assert [(row["tenant"], row["requests"]) for row in only["data"]] == [("team-b", 1)]


SUBJECT_ROWS = [
    RollupRow(TODAY, "acme", "alice", "m", (2, 10, 0, 2, 0, 20), "jwt:okta"),
    RollupRow(TODAY - 1, "acme", "alice", "n", (1, 10, 0, 2, 0, 10), "jwt:okta"),
    RollupRow(TODAY, "acme", "alice", "m", (1, 10, 0, 2, 0, 5), "jwt:corp"),
    RollupRow(TODAY, "acme", "spiffe://a/b", "m", (1, 10, 0, 2, 0, 1), "mtls"),
    RollupRow(TODAY, "acme", "alice", "m", (4, 10, 0, 2, 0, 3)),  # a YAML key aliased alice
    RollupRow(TODAY, "acme", "-", "m", (1, 10, 0, 2, 0, 2)),
]


def test_rows_are_grouped_by_subject_and_identity_and_keys_are_one_row():
    report = spend_report(q(group_by="subject"), SUBJECT_ROWS)
    assert [(row["subject"], row["identity"], row["requests"], row["cost_nusd"]) for row in report["data"]] == [
        ("-", None, 5, 5), ("alice", "jwt:corp", 1, 5), ("alice", "jwt:okta", 3, 30), ("spiffe://a/b", "mtls", 1, 1)]
    assert report["totals"]["requests"] == 10
    by_key = spend_report(q(group_by="key"), SUBJECT_ROWS)  # a key name, whoever it names
    assert [(row["key"], row["requests"]) for row in by_key["data"]] == [("-", 1), ("alice", 8), ("spiffe://a/b", 1)]
    text = spend_table(report)
    header, first, *_, total = text.splitlines()
    assert header.split()[:3] == ["subject", "identity", "requests"] and first.split()[:3] == ["-", "-", "5"]
    assert total.split()[:2] == ["total", "10"]


def test_the_table_is_aligned_with_the_totals_last():
    text = spend_table(spend_report(q(group_by="model"), ROWS))
    header, first, second, rule, total = text.splitlines()
    assert header.split() == ["model", "requests", "prompt", "cached", "completion", "reasoning", "cost_usd", "hits",
                              "saved"]
    assert first.split() == ["m", "3", "110", "10", "22", "5", "1.500000003", "0", "0"]
    assert total.split() == ["total", "4", "120", "10", "24", "5", "1.50000001", "0", "0"]
    assert len({len(line) for line in (header, first, second, total)}) == 1 and set(rule) == {"-", " "}


# ---------------------------------------------------------------------------------------------- metric labels


def test_worker_labels_are_bounded_and_overflow_into_other(monkeypatch):
    monkeypatch.setattr(series, "MAX_MODELS", 2)
    counters = SpendCounters()
    for model in ("a", "b", "c", "d"):
        counters.add("t", model, "-", 10)
    assert counters.totals == {("t", "a", ""): 10, ("t", "b", ""): 10, ("t", OTHER, ""): 20}
    assert sorted(counters.changed()) == [("t", "a", "", 10), ("t", "b", "", 10), ("t", OTHER, "", 20)]
    assert counters.changed() == []
    per_key = SpendCounters(per_key=True)
    per_key.add("t", "a", "kid1", 5)
    assert per_key.changed() == [("t", "a", "kid1", 5)]


def test_the_supervisor_sums_cumulative_reports_and_keeps_a_dead_workers_counts():
    sums = SpendSums()
    sums.update(1, [("t", "m", "", 10)])
    sums.update(1, [("t", "m", "", 25)])  # cumulative: replaces, never adds
    sums.update(2, [("t", "m", "", 5), ("u", "m", "", 1)])
    sums.unpriced_live[2] = (1, 2, 3)
    assert dict(sums.totals()) == {("t", "m", ""): 30, ("u", "m", ""): 1}
    sums.worker_exited(2)
    sums.update(3, [("t", "m", "", 4)])  # its replacement starts from zero
    assert dict(sums.totals()) == {("t", "m", ""): 34, ("u", "m", ""): 1}
    assert sums.unpriced() == [1, 2, 3]


# ---------------------------------------------------------------------------------------------- alerts, pipe


def test_the_outbox_keeps_what_the_pipe_refuses_and_sends_it_in_order():
    accepted: list[SpendAlert] = []
    open_ = [False]

    def send(alert: SpendAlert) -> bool:
        if open_[0]:
            accepted.append(alert)
        return open_[0]

    outbox = AlertOutbox(send, size=2)
    first, second, third = (SpendAlert("t", "tenant", b, "p", 0.5, 1, 2) for b in ("a", "b", "c"))
    for alert in (first, second, third):
        outbox.put(alert)
    assert len(outbox) == 2 and outbox.dropped == 1
    open_[0] = True
    outbox.retry()
    assert accepted == [first, second] and len(outbox) == 0


def test_spend_messages_cross_the_status_pipe_and_a_full_pipe_says_so():
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        counts = SpendCounts(series=[("team-a", "gpt-4o", "", 123)], unpriced=(1, 0, 2), alerts_dropped=3)
        assert try_send_status(write_fd, counts) and try_send_status(write_fd, SpendAlertReport(ALERT))
        assert StatusReader().feed(os.read(read_fd, 65536)) == [counts, SpendAlertReport(ALERT)]
        while try_send_status(write_fd, SpendAlertReport(ALERT)):
            pass  # fill the pipe
        assert not try_send_status(write_fd, SpendAlertReport(ALERT))
    finally:
        os.close(read_fd)
        os.close(write_fd)


# ---------------------------------------------------------------------------------------------- alert sender


def test_the_sender_backs_off_doubling_up_to_the_cap_then_counts_a_failure_and_bounds_its_queue():
    import asyncio

    from gateway.config.pricing import AlertsWebhook
    from gateway.supervisor.spend_alerts import AlertSender, WebhookFailed

    hook = AlertsWebhook(url="http://127.0.0.1:9/", retries=4, backoff=1.0, max_backoff=4.0)
    pauses: list[float] = []
    posted: list[bytes] = []

    async def post(_hook: AlertsWebhook, body: bytes) -> int:
        posted.append(body)
        if len(posted) <= 5:  # the first alert's five attempts fail
            raise WebhookFailed("connection refused")
        return 200

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    async def scenario() -> AlertSender:
        sender = AlertSender(lambda: hook, post=post, sleep=sleep, queue_size=2)
        for budget in ("a", "b", "c"):
            sender.submit(SpendAlert("t", "tenant", budget, "p", 0.5, 1, 2))
        await sender._task  # type: ignore[misc]
        return sender

    sender = asyncio.run(scenario())
    assert pauses == [1.0, 2.0, 4.0, 4.0]
    assert sender.counts == {"delivered": 1, "failed": 1, "dropped": 1}
    assert b'"budget":"b"' in posted[-1] and b'"type":"gridgate.spend_alert"' in posted[-1]


def test_the_tightest_rule_budget_of_a_quota_report_is_what_remains_for_the_tenant():
    from gateway.supervisor.spend import tightest_remaining

    report = {"tenant": "team-a", "rules": [
        {"rule": "daily", "spend": [{"usd": "$5.00", "period": "1d", "remaining_nusd": 3_000_000_000},
                                    {"usd": "$100.00", "period": "1mo", "remaining_nusd": 1_500_000_000}]},
        {"rule": "tokens-only", "windows": []}],
        "keys": [{"key": "ci", "spend": [{"remaining_nusd": 1}]}]}  # a key's budget is not the tenant's
    assert tightest_remaining(report) == 1_500_000_000
    assert tightest_remaining({"tenant": "t", "rules": [{"rule": "r", "windows": []}], "keys": []}) is None


def test_each_keys_own_tightest_budget_is_what_remains_for_that_key():
    from gateway.supervisor.spend import keys_remaining

    report = {"tenant": "team-a", "rules": [{"rule": "daily", "spend": [{"remaining_nusd": 7}]}], "keys": [
        {"key": "ci", "spend": [{"remaining_nusd": 30}, {"remaining_nusd": 20}]},
        {"key": "tokens-only", "windows": []}]}
    assert keys_remaining(report) == {"ci": 20}
    assert keys_remaining({"tenant": "t", "rules": []}) == {}


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(("pricing", "problem"), [
    ("{alerts_webhook: ftp://hooks.example.com/x}", "pricing.alerts_webhook: must be an http:// or https:// URL"),
    ("{alerts_webhook: 'http:///x'}", "pricing.alerts_webhook: names no host"),
    ("{alerts_webhook: {url: 'https://h:99999/'}}", "pricing.alerts_webhook.url: has an invalid port"),
    ("{alerts_webhook: {url: 'https://h/', retries: -1}}", "pricing.alerts_webhook.retries: must be >= 0"),
    ("{alerts_webhook: {url: 'https://h/', backoff: 0ms}}", "pricing.alerts_webhook.backoff: must be >= 1ms"),
    ("{alerts_webhook: {url: 'https://h/', headers: {Host: evil}}}",
     "pricing.alerts_webhook.headers: Host is set by the gateway"),
    ("{alerts_webhook: {url: 'https://h/', headers: {X-A: \"a\\r\\nb\"}}}",
     "pricing.alerts_webhook.headers: the value of X-A must not hold CR, LF or NUL"),
    ("{alerts_webhook: {url: 'https://h/', colour: red}}", "pricing.alerts_webhook.colour: unknown key"),
    ("{metrics_per_key: maybe}", "pricing.metrics_per_key: expected true or false"),
])
def test_a_bad_webhook_or_metrics_setting_is_an_error_naming_the_field(pricing, problem):
    from gateway.config import ConfigError, parse_config

    base = 'clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'
    with pytest.raises(ConfigError) as caught:
        parse_config(base + f"pricing: {pricing}\n")
    assert caught.value.problems[0].startswith(problem), caught.value.problems


def test_a_webhook_url_alone_takes_the_defaults():
    from gateway.config import parse_config

    config = parse_config('clusters: [{name: a, endpoints: ["127.0.0.1:9001"]}]\nrouting: {overlay_file: o.json}\n'
                          "pricing: {alerts_webhook: 'https://hooks.example.com/gg'}\n")
    hook = config.pricing.webhook
    assert (hook.url, hook.timeout, hook.retries, hook.backoff, hook.max_backoff, hook.headers) == (
        "https://hooks.example.com/gg", 5.0, 8, 1.0, 60.0, {})


def test_published_alerts_go_to_the_installed_outbox_and_the_last_ones_are_kept():
    from gateway.spend import alerts

    taken: list[SpendAlert] = []
    alerts.published.clear()
    alerts.install_outbox(AlertOutbox(lambda alert: taken.append(alert) is None))
    try:
        for index in range(alerts.PUBLISHED_KEPT + 1):
            alerts.publish_alert(SpendAlert("t", "rule r", f"b{index}", "p", 0.5, 1, 2))
    finally:
        alerts.install_outbox(None)
    assert len(taken) == alerts.PUBLISHED_KEPT + 1
    assert len(alerts.published) == alerts.PUBLISHED_KEPT // 2 + 1 and alerts.published[-1].budget == "b256"
    alerts.published.clear()


def test_cache_hits_roll_up_with_what_they_saved_beside_the_requests():
    """A response cache hit (docs/cache.md) is no request that reached a provider: its own column, and the
    tokens and nano-USD it saved (the report's ``saved_usd``, the table's ``saved``)."""
    batch = RollupBatch()
    cell = (TODAY, "team-a", "-", "m")
    assert batch.add(cell, 10, 0, 5, 0, 300)
    assert batch.add_hit(cell, 15, 300) and batch.add_hit((TODAY, "team-a", "-", "n"), 7, 0)
    assert batch.cells[cell] == [1, 10, 0, 5, 0, 300, 1, 15, 300]
    rows = [RollupRow(day, tenant, key, model, tuple(counts)) for (day, tenant, key, model), counts in batch.cells.items()]
    totals = spend_report(q(group_by="model"), rows)["totals"]
    assert (totals["requests"], totals["cache_hits"], totals["saved_tokens"], totals["saved_usd"]) == (1, 2, 22, "0.0000003")
    flushed = [str(arg) for arg in batch.scripts("f")[0]]
    assert "h\x1f-\x1fm" in flushed and "v\x1f-\x1fm" in flushed  # the hit's counters go to the store
