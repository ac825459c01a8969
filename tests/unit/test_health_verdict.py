"""What the health process decides per endpoint: thresholds, slow start, the published record."""

from __future__ import annotations

from dataclasses import replace

from gateway.cluster.outlier import EndpointBreaker, OutlierState
from gateway.cluster.spec import HealthCheckSpec
from gateway.health.verdict import ActiveHealth, EndpointVerdict, routing_view
from shm.counters import HealthRecord

CHECK = HealthCheckSpec(healthy_threshold=2, unhealthy_threshold=3)


def test_active_verdict_flips_only_after_the_threshold_of_consecutive_results() -> None:
    active = ActiveHealth()
    assert [active.observe(ok, CHECK) for ok in (False, False, True, False, False, False)] == \
        [False, False, False, False, False, True]
    assert not active.healthy
    assert [active.observe(ok, CHECK) for ok in (True, False, True, True)] == [False, False, False, True]
    assert active.healthy and active.streak == 0


def test_a_closed_healthy_endpoint_publishes_an_all_default_record() -> None:
    verdict = EndpointVerdict(slot_generation=4)
    record = verdict.compose(EndpointBreaker(), now=100.0, slow_start_s=10.0, changed_at_ns=55)
    assert record == HealthRecord(slot_generation=4, changed_at_ns=55)


def test_return_to_service_ramps_the_weight_then_ends_at_full_weight() -> None:
    verdict = EndpointVerdict(slot_generation=1)
    verdict.active.healthy = False
    breaker = EndpointBreaker()
    assert verdict.compose(breaker, 0.0, 10.0, 0).active_down == 1
    verdict.active.healthy = True
    ramps = [verdict.compose(breaker, now, 10.0, 0).ramp_permille for now in (5.0, 7.5, 14.9, 15.0, 30.0)]
    assert ramps == [100, 200, 900, 0, 0]
    assert verdict.back_at is None  # the ramp is over


def test_without_slow_start_a_recovered_endpoint_is_at_full_weight_at_once() -> None:
    verdict = EndpointVerdict(slot_generation=1, was_routable=False)
    assert verdict.compose(EndpointBreaker(), 3.0, 0.0, 0).ramp_permille == 0


def test_an_ejected_endpoint_publishes_its_deadline_and_only_half_open_names_a_probe_worker() -> None:
    verdict = EndpointVerdict(slot_generation=2)
    breaker = EndpointBreaker(state=OutlierState.EJECTED, ejections=2, ejected_until=12.5, total_ejections=3,
                              consecutive=5, probe_worker=1, probe_epoch=7)
    record = verdict.compose(breaker, 10.0, 10.0, 0)
    assert record.outlier_state == OutlierState.EJECTED and record.ejected_until_ns == 12_500_000_000
    assert (record.ejections, record.total_ejections, record.consecutive_failures) == (2, 3, 5)
    assert record.probe_worker == -1 and record.probe_epoch == 7
    breaker.state = OutlierState.HALF_OPEN
    assert verdict.compose(breaker, 13.0, 10.0, 0).probe_worker == 1
    breaker.state = OutlierState.CLOSED
    closed = verdict.compose(breaker, 14.0, 10.0, 0)
    assert closed.ejected_until_ns == 0 and closed.ramp_permille == 100  # back: slow start begins


def test_routing_view_ignores_report_only_fields() -> None:
    record = HealthRecord(slot_generation=1, ramp_permille=300)
    assert routing_view(replace(record, consecutive_failures=4, total_ejections=9, changed_at_ns=1)) == \
        routing_view(record)
    assert routing_view(replace(record, ramp_permille=400)) != routing_view(record)
    assert routing_view(replace(record, probe_epoch=2)) != routing_view(record)


def test_adopting_a_previous_record_keeps_an_unhealthy_or_ramping_endpoint_so() -> None:
    old = HealthRecord(slot_generation=3, active_down=1)
    verdict = EndpointVerdict(slot_generation=3)
    assert verdict.adopt(old, 50.0, actively_checked=True, slow_start_s=10.0)
    assert not verdict.active.healthy and not verdict.was_routable
    unchecked = EndpointVerdict(slot_generation=3)
    assert unchecked.adopt(old, 50.0, actively_checked=False, slow_start_s=10.0)
    assert unchecked.active.healthy  # its check was removed: nothing will ever flip it back

    ramping = EndpointVerdict(slot_generation=3)
    assert ramping.adopt(HealthRecord(slot_generation=3, ramp_permille=400), 50.0, actively_checked=True,
                         slow_start_s=10.0)
    assert ramping.compose(EndpointBreaker(), 50.0, 10.0, 0).ramp_permille == 400  # continues, not restarted


def test_a_record_of_another_slot_generation_is_not_adopted() -> None:
    verdict = EndpointVerdict(slot_generation=5)
    assert not verdict.adopt(HealthRecord(slot_generation=4, active_down=1), 0.0, actively_checked=True,
                             slow_start_s=10.0)
    assert verdict.active.healthy and verdict.was_routable
