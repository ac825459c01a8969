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
