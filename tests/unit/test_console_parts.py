"""The console's pure parts: sessions (expiry, bound, CSRF), cookies, the same-origin check and the
traffic share over a sliding window."""

from __future__ import annotations

from gateway.admin.console.guard import is_https, same_origin
from gateway.admin.console.session import (
    SessionBook,
    cleared_cookie,
    cookie_value,
    csrf_matches,
    session_cookie,
)
from gateway.admin.console.traffic import TrafficShare
from tests.clock import TestClock as FakeClock


def test_a_session_lives_until_its_expiry_and_is_found_only_by_its_id():
    clock = FakeClock(100.0)
    book = SessionBook(ttl_s=60, clock=clock)
    first = book.open(b"d" * 32)
    session = book.find(first)
    assert session is not None and session.token_digest == b"d" * 32
    assert book.find(first[:-1] + "x") is None and book.find(None) is None and book.find("") is None
    clock.advance(59.9)
    assert book.find(first) is session
    clock.advance(0.2)
    assert book.find(first) is None and len(book) == 0


def test_expired_sessions_are_handed_out_once_for_the_audit_log():
    clock = FakeClock(100.0)
    book = SessionBook(ttl_s=60, clock=clock)
    first, second = book.open(b"a" * 32), book.open(b"b" * 32)
    assert book.take_expired() == []
    clock.advance(61)
    assert book.find(first) is None  # its cookie came back after the expiry
    expired = book.take_expired()  # the other one, swept although its cookie never came back
    assert sorted(s.token_digest for s in expired) == [b"a" * 32, b"b" * 32] and len(book) == 0
    assert book.find(second) is None and book.take_expired() == []


def test_the_book_is_bounded_and_forgets_the_oldest_sessions_first():
    book = SessionBook(max_sessions=3, clock=FakeClock(0.0))
    ids = [book.open(bytes([n]) * 32) for n in range(5)]
    assert len(book) == 3
    assert [book.find(i) is not None for i in ids] == [False, False, True, True, True]


def test_csrf_tokens_are_per_session_and_compared_exactly():
    book = SessionBook(clock=FakeClock(0.0))
    one, two = book.find(book.open(b"a" * 32)), book.find(book.open(b"a" * 32))
    assert one is not None and two is not None and one.csrf != two.csrf and len(one.csrf) >= 40
    assert csrf_matches(one, one.csrf)
    assert not csrf_matches(one, two.csrf) and not csrf_matches(one, None) and not csrf_matches(one, "")


def test_cookies_carry_their_flags_and_are_read_back_from_a_cookie_header():
    assert session_cookie("abc", 600, secure=False) == \
        "console_session=abc; Path=/console; Max-Age=600; HttpOnly; SameSite=Strict"
    assert session_cookie("abc", 600, secure=True).endswith("; Secure")
    assert "Max-Age=0" in cleared_cookie(False)
    assert cookie_value("theme=dark; console_session=abc; x=1") == "abc"
    assert cookie_value("console_sessionx=abc") is None and cookie_value(None) is None


def test_same_origin_accepts_this_host_and_refuses_another_site():
    host = {"host": "127.0.0.1:9901"}
    assert same_origin({**host, "origin": "http://127.0.0.1:9901"})
    assert not same_origin({**host, "origin": "https://evil.example"})
    assert not same_origin({**host, "origin": "null"})
    assert same_origin(host)  # no Origin: not a browser's cross-site post
    assert not same_origin({**host, "sec-fetch-site": "cross-site"})
    assert same_origin({**host, "origin": "https://console.example", "x-forwarded-host": "console.example"})
    assert is_https({"x-forwarded-proto": "https"}) and not is_https({}) and not is_https({"x-forwarded-proto": "http"})


def test_the_traffic_share_covers_the_requests_of_the_window():
    clock = FakeClock(0.0)
    share = TrafficShare(window_s=60, min_step_s=2, clock=clock)
    assert share.observe({"a": 100, "b": 50}).by_cluster == {}  # nothing counted yet
    clock.advance(10)
    shares = share.observe({"a": 130, "b": 60})
    assert shares.by_cluster == {"a": 0.75, "b": 0.25} and shares.requests == 40 and shares.window_s == 10
    clock.advance(60)  # the first sample falls out; the one at 10 s is the window's start
    shares = share.observe({"a": 130, "b": 160})
    assert shares.by_cluster == {"a": 0.0, "b": 1.0} and shares.requests == 100 and shares.window_s == 60


def test_a_counter_that_went_back_counts_nothing_rather_than_less_than_nothing():
    clock = FakeClock(0.0)
    share = TrafficShare(clock=clock)
    share.observe({"a": 100, "b": 100})
    clock.advance(5)
    assert share.observe({"a": 10, "b": 110}).by_cluster == {"a": 0.0, "b": 1.0}


def test_the_spend_chart_draws_one_bar_a_day_scaled_to_the_peak_and_fills_missing_days():
    from datetime import date

    from gateway.admin.console.chart import spend_chart

    rows = [{"day": "2026-12-07", "cost_nusd": 2_000_000_000, "requests": 4},
            {"day": "2026-12-05", "cost_nusd": 500_000_000, "requests": 1},
            {"day": "2026-11-01", "cost_nusd": 9_000_000_000, "requests": 9}]  # outside the window
    chart = spend_chart(rows, date(2026, 12, 7), days=7)
    bars = chart["bars"]
    assert len(bars) == 7 and chart["total"] == "$2.5" and chart["peak"] == "$2" and chart["requests"] == 5
    assert bars[-1]["h"] == 160 - 14 - 20 and bars[-3]["h"] == bars[-1]["h"] / 4 and bars[0]["h"] == 0
    assert bars[-1]["title"] == "2026-12-07: $2 (4 requests)" and bars[-1]["label"] == "12-07"
    assert [bar["label"] != "" for bar in bars] == [True, False, True, False, True, False, True]
    assert spend_chart([], date(2026, 12, 7))["total"] == "$0"  # nothing spent: flat, no division by zero


def test_the_create_form_becomes_the_admin_apis_body_leaving_empty_fields_to_its_defaults():
    from gateway.admin.console.keys_page import budget_rows, create_body

    assert create_body({"tenant": " team-a ", "alias": "", "models": "", "rpm": ""}) == {"tenant": "team-a"}
    assert create_body({"tenant": "t", "alias": "ci", "models": "gpt-*, claude-* ,", "rpm": "60"}) == {
        "tenant": "t", "alias": "ci", "models": ["gpt-*", "claude-*"],
        "limits": {"requests": [{"window": "1m", "count": 60}]}}
    assert create_body({"tenant": "t", "rpm": "lots"})["limits"]["requests"][0]["count"] == "lots"  # the API says 400
    report = {"rules": [{"rule": "r", "windows": [{"window_s": 60, "limit": 100, "remaining": 40, "reset_s": 12.4}],
                         "requests": [{"window_s": 60, "count": 10, "remaining": 9, "full_in_s": 6.0}]}],
              "keys": [{"key": "k", "windows": [], "requests": [],
                        "spend": [{"period": "1d", "usd": "$5.00", "remaining_nusd": 4_500_000_000, "reset_s": 99}]}]}
    assert budget_rows(report) == [
        {"owner": "rule r", "what": "tokens / 60 s", "limit": 100, "remaining": 40, "reset_s": 12},
        {"owner": "rule r", "what": "requests / 60 s", "limit": 10, "remaining": 9, "reset_s": 6},
        {"owner": "key k", "what": "USD / 1d", "limit": "$5.00", "remaining": "$4.5000", "reset_s": 99}]


def test_the_worker_ring_keeps_the_last_requests_and_reports_each_once():
    import time

    from workers.recent_requests import RING_SIZE, RequestRing
    from workers.request_record import RequestRecord

    ring = RequestRing()
    now = time.perf_counter()
    for n in range(RING_SIZE + 5):
        ring.add(RequestRecord(request_id=b"r%d" % n, tenant="t", capability="m", provider="p", status=200,
                               t_start=now - 0.25, ended=now, attempts=1, body=b"a prompt", cost_nusd=n))
    rows = ring.pending()
    assert [row.request_id for row in rows] == [f"r{n}" for n in range(5, RING_SIZE + 5)]  # the oldest overwritten
    assert rows[0].latency_ms == 250.0 and abs(rows[0].ended_at - time.time()) < 1 and rows[0].group is None
    assert "a prompt" not in repr(rows)
    assert ring.pending() == []  # each entry is reported once
    ring.add(RequestRecord(capability="m", status=499, ended=now, attempts=0))
    (row,) = ring.pending()
    assert (row.status, row.latency_ms, row.request_id) == (499, None, None)
    for n in range(3):  # a few after a report: only they are new
        ring.add(RequestRecord(request_id=b"s%d" % n, capability="m", status=200, ended=now, attempts=1))
    assert [row.request_id for row in ring.pending()] == ["s0", "s1", "s2"]
    for n in range(RING_SIZE):  # a full ring after a report: the last one reported is gone, all are new
        ring.add(RequestRecord(request_id=b"u%d" % n, capability="m", status=200, ended=now, attempts=1))
    assert [row.request_id for row in ring.pending()] == [f"u{n}" for n in range(RING_SIZE)]


def test_the_requests_view_formats_what_the_page_shows():
    from gateway.admin.console.views import requests_view

    row = {"worker": 7, "ended_at": 1796614924.275, "request_id": "x", "tenant": "t", "model": "m", "provider": "p",
           "group": 0, "status": 200, "latency_ms": 12.34, "tokens_prompt": 10, "tokens_completion": None,
           "cost_nusd": 1500, "attempts": 1, "error": None}
    (shown,) = requests_view([row])["requests"]
    assert (shown["latency"], shown["tokens"], shown["cost"], shown["group"]) == ("12.3 ms", "10 / 0", "$0.0000015", 0)
    assert shown["ended"].count(":") == 2
    assert requests_view([row] * 5, limit=2)["shown"] == 2


def test_the_overlay_age_reads_at_a_glance():
    from gateway.admin.console.views import age_text

    assert [age_text(s) for s in (0, 42.9, 119, 120, 7199, 7200, 172800, 621936)] == [
        "0 s", "42 s", "119 s", "2 min", "119 min", "2 h", "2 d", "7 d"]
