"""The intelligent route: affinity -> selection group -> picker (CONTRACT §4.2, §4.4).

One :class:`Router` per worker process. It is pure apart from the affinity table it is
given (shared memory) and the random source; clocks come in as arguments.

Everything a decision carries is fixed for a snapshot revision, so decisions are built
once per revision and capability (one per serving slot and affinity outcome, on the
capability's first request or in ``prepare``) and ``route`` returns a shared immutable
object: no allocation on the success path.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import quote

from gateway.http.errors import ErrorReply
from gateway.overlay.contract import Candidate
from gateway.overlay.snapshot import Capability, Snapshot

if TYPE_CHECKING:
    from shm.affinity import AffinityTable

AFFINITY_NONE = "none"
AFFINITY_NEW = "new"
AFFINITY_REUSED = "reused"
AFFINITY_FAILOVER = "failover"
_OUTCOMES = (AFFINITY_NONE, AFFINITY_NEW, AFFINITY_FAILOVER)  # index = outcome code for a fresh pick
_NONE, _NEW, _FAILOVER = 0, 1, 2

_FIXED, _ROUND_ROBIN, _RANDOM = 0, 1, 2
_PICKERS = {"deterministic": _FIXED, "roundRobin": _ROUND_ROBIN, "random": _RANDOM}
_HEADER_SAFE = "!#$&'()*+,-./:;<=>?@[]^_`{|}~"


def _header_value(text: str) -> bytes:
    """Header-safe bytes: visible ASCII as is, anything else percent-encoded."""
    if text.isascii() and all(33 <= ord(c) <= 126 for c in text):
        return text.encode("ascii")
    return quote(text, safe=_HEADER_SAFE).encode("ascii")


class RouteDecision(NamedTuple):
    """The chosen candidate and the evidence the proxy reports (CONTRACT §5). Immutable.

    ``evidence`` is the prebuilt ``x-gridgate-*`` header list for this decision
    (provider, stable id, selection group, mode, overlay revision, affinity); the proxy
    adds overhead and request id. ``selection_group`` is None for an ungrouped capability
    (its header value is ``none``).
    """

    candidate: Candidate
    cluster: str
    stable_id: str
    selection_group: int | None
    mode: str
    revision: str
    affinity: str
    evidence: tuple[tuple[bytes, bytes], ...]


def _decision(
    candidate: Candidate,
    identity: tuple[tuple[bytes, bytes], ...],
    selection_group: int | None,
    mode: str,
    revision: str,
    affinity: str,
) -> RouteDecision:
    evidence = (
        *identity,
        (b"x-gridgate-selection-group", b"none" if selection_group is None else b"%d" % selection_group),
        (b"x-gridgate-selection-mode", mode.encode()),
        (b"x-gridgate-overlay-revision", revision.encode()),
        (b"x-gridgate-affinity", affinity.encode()),
    )
    return RouteDecision(
        candidate, candidate.cluster, candidate.stable_id, selection_group, mode, revision, affinity, evidence
    )


def _label(kind: str, name: str) -> str:
    if not name:
        return "MCP session (no tool named)"
    return f"model `{name}`" if kind == "inference_model" else f"MCP tool `{name}`"


def model_not_found(kind: str, name: str) -> ErrorReply:
    if not name:
        return ErrorReply(404, "model_not_found", "The serving routing overlay has no MCP tool.")
    return ErrorReply(
        404, "model_not_found", f"The {_label(kind, name)} is not in the serving routing overlay."
    )


class _Plan:
    """Routing state of one capability for one revision: prebuilt decisions and its picker turn.

    Built on the capability's first request after a revision change, so adopting a new
    snapshot costs nothing up front and a capability costs O(its members) once.
    """

    __slots__ = (
        "picker",
        "size",
        "turn",
        "fresh",
        "reused",
        "capability_hash",
        "accepts_any_binding",
        "unavailable",
    )

    def __init__(self, cap: Capability, snapshot: Snapshot, worker_index: int) -> None:
        serving = cap.serving
        mode, revision = snapshot.mode, snapshot.revision
        identities = {
            c.position: (
                (b"x-gridgate-provider", _header_value(c.cluster)),
                (b"x-gridgate-stable-id", _header_value(c.stable_id)),
            )
            for c in cap.members
        }
        self.size = len(serving)
        # Ungrouped capabilities always take their first new_and_existing candidate.
        self.picker = _PICKERS[mode] if cap.grouped and self.size > 1 else _FIXED
        # Round-robin turn: each worker starts at its own offset so N workers spread evenly.
        self.turn = worker_index % self.size if self.size else 0
        self.fresh = tuple(
            tuple(
                _decision(c, identities[c.position], cap.serving_group, mode, revision, outcome)
                for c in serving
            )
            for outcome in _OUTCOMES
        )
        self.reused = {
            sid: _decision(c, identities[c.position], c.selection_group, mode, revision, AFFINITY_REUSED)
            for sid, c in cap.reusable.items()
        }
        self.capability_hash = cap.hash
        self.accepts_any_binding = cap.accepts_any_binding
        self.unavailable = ErrorReply(
            503,
            "no_admissible",
            f"No provider currently admits new requests for the {_label(cap.kind, cap.name)}.",
        )


class Router:
    """Chooses a candidate per request. One per worker; not thread-safe (one event loop).

    ``worker_index`` offsets every round-robin counter so N workers start on different
    members and spread evenly. ``affinity`` (shared table) and ``affinity_ttl_s`` enable
    session affinity; without a table, keys are ignored.
    """

    __slots__ = ("_worker_index", "_rng", "_affinity", "_ttl", "_revision", "_plans")

    def __init__(
        self,
        worker_index: int = 0,
        rng: random.Random | None = None,
        affinity: AffinityTable | None = None,
        affinity_ttl_s: float = 3600.0,
    ) -> None:
        self._worker_index = worker_index
        self._rng = rng if rng is not None else random.Random()
        self._affinity = affinity
        self._ttl = affinity_ttl_s
        self._revision: str | None = None
        self._plans: list[_Plan | None] = []

    @property
    def revision(self) -> str | None:
        """Revision whose picker state this router holds."""
        return self._revision

    def _adopt(self, snapshot: Snapshot) -> None:
        # Same revision => same candidates and policy => same capability indexes, so the
        # state is kept (route() only calls this on a change). A new revision starts fresh.
        self._plans = [None] * len(snapshot.capabilities)
        self._revision = snapshot.revision

    def prepare(self, snapshot: Snapshot) -> None:
        """Optionally build every capability's plan now (after a reload) instead of lazily
        on each capability's first request. Keeps the state of an unchanged revision."""
        if snapshot.revision != self._revision:
            self._adopt(snapshot)
        plans = self._plans
        for cap in snapshot.capabilities.values():
            if plans[cap.index] is None:
                plans[cap.index] = _Plan(cap, snapshot, self._worker_index)

    def _pick(self, plan: _Plan, outcome: int) -> RouteDecision | ErrorReply:
        choices = plan.fresh[outcome]
        if not choices:
            return plan.unavailable
        picker = plan.picker
        if picker == _FIXED:
            return choices[0]
        if picker == _ROUND_ROBIN:
            turn = plan.turn
            plan.turn = turn + 1 if turn + 1 < plan.size else 0
            return choices[turn]
        return choices[self._rng.randrange(plan.size)]

    def route(
        self,
        snapshot: Snapshot,
        kind: str,
        name: str,
        session_key: bytes | None = None,
        now: float = 0.0,
    ) -> RouteDecision | ErrorReply:
        """Route one request for capability ``(kind, name)``.

        ``session_key`` is the affinity key (see ``gateway.capability.session_key``) and
        ``now`` the shared clock (``time.monotonic()`` is system-wide on Linux, so every
        worker agrees on expiries).
        """
        cap = snapshot.capabilities.get((kind, name))
        if cap is None:
            return model_not_found(kind, name)
        if snapshot.revision != self._revision:
            self._adopt(snapshot)
        plan = self._plans[cap.index]
        if plan is None:
            plan = self._plans[cap.index] = _Plan(cap, snapshot, self._worker_index)
        table = self._affinity
        if session_key is None or table is None:
            return self._pick(plan, _NONE)

        bound = table.lookup(session_key, now)
        if bound is None:
            outcome = _NEW
        else:
            if bound.capability_hash == plan.capability_hash or plan.accepts_any_binding:
                # Reuse keeps the original expiry: it is absolute from binding time.
                decision = plan.reused.get(bound.stable_id_hash)
                if decision is not None:
                    return decision
            outcome = _FAILOVER
        decision = self._pick(plan, outcome)
        if type(decision) is RouteDecision:
            table.bind(session_key, decision.candidate.stable_id_hash, plan.capability_hash, now + self._ttl)
        return decision
