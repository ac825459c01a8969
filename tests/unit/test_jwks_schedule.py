"""When the supervisor fetches a key set (gateway/identity/jwks_schedule.py): max-age within bounds, early
refresh, retry after a failure, and the unknown-kid refetch at most once per 30 s per issuer."""

from __future__ import annotations

from gateway.config.jwt import JwksRefresh
from gateway.identity.jwks_schedule import UNKNOWN_KID_REFETCH_S, FetchSchedule, lifetime, max_age_of

REFRESH = JwksRefresh()  # min 1m, max 1h, default 5m, early 0.2, retry 10s


def test_max_age_is_read_and_no_store_means_the_minimum():
    assert max_age_of("public, max-age=600") == 600 and max_age_of('max-age="90", must-revalidate') == 90
    assert max_age_of("no-store") == 0 and max_age_of("private") is None and max_age_of(None) is None
    assert max_age_of("s-maxage=5") is None


def test_the_lifetime_is_clamped_and_refreshed_early():
    assert lifetime(REFRESH, "max-age=600") == 600 * 0.8
    assert lifetime(REFRESH, "max-age=5") == 60 * 0.8  # below min
    assert lifetime(REFRESH, "max-age=86400") == 3600 * 0.8  # above max
    assert lifetime(REFRESH, None) == 300 * 0.8 and lifetime(REFRESH, "no-cache") == 60 * 0.8


def test_schedule_after_success_failure_and_unknown_kids():
    schedule = FetchSchedule(REFRESH, now=100.0)
    assert schedule.is_due(100.0)  # the first fetch at once
    schedule.fetched(100.0, "max-age=600")
    assert not schedule.is_due(579.0) and schedule.is_due(580.0)
    schedule.failed(200.0)
    assert schedule.due == 210.0  # retry; the last good set serves meanwhile
    schedule.fetched(210.0, None)
    assert schedule.unknown_kid(211.0) and schedule.is_due(211.0)  # the first unknown kid: now
    schedule.fetched(211.0, None)
    assert not schedule.unknown_kid(211.0 + UNKNOWN_KID_REFETCH_S - 1) and not schedule.is_due(212.0)
    assert schedule.unknown_kid(211.0 + UNKNOWN_KID_REFETCH_S)
