"""What the health process decides about one endpoint (pure: takes the clock's value, returns data).

Active checks flip an endpoint only after ``healthy_threshold``/``unhealthy_threshold`` consecutive
contradicting results; the published record combines that verdict with the endpoint's circuit breaker
(gateway.cluster.outlier) and its slow-start ramp after a return to service.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.cluster.outlier import EndpointBreaker, OutlierState, slow_start_permille
from gateway.cluster.shared_view import is_routable
from gateway.cluster.spec import HealthCheckSpec
from shm.counters import HealthRecord


@dataclass(slots=True)
class ActiveHealth:
    """Consecutive-result thresholds. Endpoints start healthy."""

    healthy: bool = True
    streak: int = 0  # consecutive results contradicting the current verdict

    def observe(self, ok: bool, spec: HealthCheckSpec) -> bool:
        """Count one probe result; True if the verdict flipped."""
        if ok == self.healthy:
            self.streak = 0
            return False
        self.streak += 1
        if self.streak >= (spec.healthy_threshold if ok else spec.unhealthy_threshold):
            self.healthy, self.streak = ok, 0
            return True
        return False


def routing_view(record: HealthRecord) -> tuple[int, ...]:
    """The fields balancers act on; a change in report-only fields (streak counts) is not worth a
    generation bump, which makes every balancer of every worker rebuild."""
    return (record.active_down, record.outlier_state, record.ramp_permille, record.probe_worker,
            record.probe_epoch)


@dataclass(slots=True)
class EndpointVerdict:
    """One endpoint's active verdict and slow-start state; composes the record the writer publishes."""

    slot_generation: int  # of the directory entry: a reused slot is a new endpoint
    active: ActiveHealth = field(default_factory=ActiveHealth)
    was_routable: bool = True
    back_at: float | None = None  # slow-start origin

    def adopt(self, old: HealthRecord, now: float, *, actively_checked: bool, slow_start_s: float) -> bool:
        """Carry over a record published by a previous health process; False if it is not this endpoint's."""
        if old.slot_generation != self.slot_generation:
            return False  # a new endpoint in this slot (or a fresh segment): start healthy
        self.active.healthy = not old.active_down or not actively_checked
        self.was_routable = is_routable(old) and self.active.healthy
        if old.ramp_permille and slow_start_s > 0:
            self.back_at = now - old.ramp_permille / 1000 * slow_start_s
        return True

    def compose(self, breaker: EndpointBreaker, now: float, slow_start_s: float, changed_at_ns: int) -> HealthRecord:
        """The record to publish now; a return to service starts the slow-start ramp."""
        routable = self.active.healthy and breaker.state == OutlierState.CLOSED
        if routable and not self.was_routable:
            self.back_at = now
        self.was_routable = routable
        ramp = 0
        if routable and self.back_at is not None:
            ramp = slow_start_permille(now - self.back_at, slow_start_s)
            if not ramp:
                self.back_at = None
        ejected = breaker.state != OutlierState.CLOSED
        return HealthRecord(
            slot_generation=self.slot_generation,
            active_down=int(not self.active.healthy),
            outlier_state=int(breaker.state),
            ejected_until_ns=int(breaker.ejected_until * 1e9) if ejected else 0,
            ejections=breaker.ejections,
            ramp_permille=ramp,
            probe_worker=breaker.probe_worker if breaker.state == OutlierState.HALF_OPEN else -1,
            probe_epoch=breaker.probe_epoch,
            consecutive_failures=breaker.consecutive,
            total_ejections=breaker.total_ejections,
            changed_at_ns=changed_at_ns,
        )
