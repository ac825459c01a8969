"""A worker's spend counters for ``gridgate_spend_nanousd_total`` (docs/pricing.md, "Metrics"), with
bounded labels, and the supervisor's sum of them over its workers.

Tenant and model names reach a worker from clients and the key store, so each worker labels at most
``MAX_TENANTS`` tenants, ``MAX_MODELS`` models and ``MAX_KEYS`` keys (when ``pricing.metrics_per_key``
is on); later names count under ``other``. A worker's counters are monotonic for its life and sent
to the supervisor as cumulative values (the series that changed, each heartbeat), so a lost message
loses nothing: the next one carries the same totals. The supervisor keeps each live worker's last
values and folds those of a worker that exited into its retired totals, so no counter goes back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

MAX_TENANTS = 128
MAX_MODELS = 128
MAX_KEYS = 512
MAX_SERIES = 4096  # the supervisor's bound over all workers; past it everything counts under other/other
OTHER = "other"
NO_KEY = ""  # the key label of a series without per-key labels

Series = tuple[str, str, str]  # (tenant, model, key)


class SpendCounters:
    """One worker's cumulative nano-USD per series, and the series changed since the last ``changed``."""

    def __init__(self, per_key: bool = False) -> None:
        self.per_key = per_key
        self.totals: dict[Series, int] = {}
        self._dirty: set[Series] = set()
        self._tenants: set[str] = set()
        self._models: set[str] = set()
        self._keys: set[str] = set()

    @staticmethod
    def _bounded(name: str, seen: set[str], limit: int) -> str:
        if name in seen:
            return name
        if len(seen) >= limit:
            return OTHER
        seen.add(name)
        return name

    def add(self, tenant: str, model: str, key: str, nusd: int) -> None:
        """Count ``nusd`` (per flush, not per request: the tracker folds its batch in)."""
        series = (self._bounded(tenant, self._tenants, MAX_TENANTS), self._bounded(model, self._models, MAX_MODELS),
                  self._bounded(key, self._keys, MAX_KEYS) if self.per_key else NO_KEY)
        if series not in self.totals and len(self.totals) >= MAX_SERIES:
            series = (OTHER, OTHER, OTHER if self.per_key else NO_KEY)
        self.totals[series] = self.totals.get(series, 0) + nusd
        self._dirty.add(series)

    def changed(self) -> list[tuple[str, str, str, int]]:
        """The series changed since the last call, with their totals; they count as sent."""
        dirty, self._dirty = self._dirty, set()
        return [(*series, self.totals[series]) for series in dirty]

    def unsent(self, series: Iterable[tuple[str, str, str, int]]) -> None:
        """These could not be sent: send them again next time."""
        self._dirty.update((tenant, model, key) for tenant, model, key, _ in series)


class SpendSums:
    """The supervisor's side: each live worker's last totals, plus the retired workers'."""

    def __init__(self) -> None:
        self._live: dict[int, dict[Series, int]] = {}  # worker pid -> series -> total
        self._retired: dict[Series, int] = {}
        self.unpriced_live: dict[int, tuple[int, int, int]] = {}
        self.unpriced_retired = [0, 0, 0]

    def update(self, pid: int, series: Iterable[tuple[str, str, str, int]]) -> None:
        totals = self._live.setdefault(pid, {})
        for tenant, model, key, value in series:
            totals[(tenant, model, key)] = value

    def worker_exited(self, pid: int) -> None:
        for name, value in self._live.pop(pid, {}).items():
            self._retired[name] = self._retired.get(name, 0) + value
        counts = self.unpriced_live.pop(pid, None)
        if counts is not None:
            self.unpriced_retired = [a + b for a, b in zip(self.unpriced_retired, counts, strict=True)]

    def totals(self) -> Iterator[tuple[Series, int]]:
        """Summed per series; past ``MAX_SERIES`` distinct ones (workers label apart), the rest under
        other/other (the labelled ones are the first seen, in sorted order: stable between scrapes)."""
        summed = dict(self._retired)
        for totals in self._live.values():
            for name, value in totals.items():
                summed[name] = summed.get(name, 0) + value
        if len(summed) > MAX_SERIES:
            names = sorted(summed)
            kept = {name: summed[name] for name in names[:MAX_SERIES - 1]}
            for name in names[MAX_SERIES - 1:]:
                other = (OTHER, OTHER, OTHER if name[2] else NO_KEY)
                kept[other] = kept.get(other, 0) + summed[name]
            summed = kept
        return iter(sorted(summed.items()))

    def unpriced(self) -> list[int]:
        summed = list(self.unpriced_retired)
        for counts in self.unpriced_live.values():
            summed = [a + b for a, b in zip(summed, counts, strict=True)]
        return summed
