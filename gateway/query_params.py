"""An admin page's query string, checked the same way on every page: known parameters, each given once.
Pure (no I/O, no other gridgate module), so the admin pages and the supervisor's report code share it."""

from __future__ import annotations


class QueryProblem(ValueError):
    """A query parameter the page refuses (400); the message names it."""


def single_params(query: dict[str, list[str]], allowed: tuple[str, ...]) -> dict[str, str]:
    """``parse_qs``'s form -> one value per name; a name outside ``allowed`` or given twice is a
    ``QueryProblem`` naming it."""
    params: dict[str, str] = {}
    for name, values in query.items():
        if name not in allowed:
            raise QueryProblem(f"{name}: unknown query parameter (this page takes {', '.join(allowed)})")
        if len(values) != 1:
            raise QueryProblem(f"{name}: give it once")
        params[name] = values[0]
    return params
