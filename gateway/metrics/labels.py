"""Stable label registries: the supervisor's name -> metrics index maps (clusters, tenants)."""

from __future__ import annotations

from collections.abc import Iterable


class LabelRegistry:
    """Name -> metrics index, append-only for the life of the supervisor.

    Indexes are shared-memory cell offsets that workers of every generation write and the supervisor
    renders, so an index must never change meaning: a reload that reorders, removes or renames
    clusters (or tenants) only appends the new names. Workers get ``names`` at fork time (a prefix of
    every later value). Once ``capacity`` names are taken, further names are counted under ``other``.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._names: list[str] = []
        self._seen: set[str] = set()  # every name registered, labelled or not
        self._index: dict[str, int] = {}

    @property
    def names(self) -> tuple[str, ...]:
        """The labelled names; position = metrics index."""
        return tuple(self._names)

    def register(self, names: Iterable[str]) -> list[str]:
        """Give every new name the next index; returns the new names that found no room (once each)."""
        unlabelled = []
        for name in names:
            if name in self._seen:
                continue
            self._seen.add(name)
            if len(self._names) < self._capacity:
                self._index[name] = len(self._names)
                self._names.append(name)
            else:
                unlabelled.append(name)
        return unlabelled

    def index_of(self, name: str) -> int | None:
        """The metrics index of a labelled name; None for a name never registered or past the capacity."""
        return self._index.get(name)
