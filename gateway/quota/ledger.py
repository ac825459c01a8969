"""The shared ledger in Valkey: one server-side Lua script (``ledger_script``), one round trip per decision.

The key layout, the member format and what each mode does are described in ``ledger_script``: every
counter of one tenant (its rules' and its keys' request clocks, token windows and in-flight sets, and
the set of its open reservations) shares the hash tag ``{<tenant>}``, so one call checks and takes every
limit of a request atomically, on one Valkey node or one Cluster slot. Windows of token budgets are fixed
and aligned to the epoch; request limits are GCRA; both on Valkey's clock (``TIME`` inside the script).

An admit takes every limit that applies, all or nothing: a refused request changes no counter. A
reservation records what it took, so settling it (the usage, and the request slots of work that never
reached a provider), expiring it (lazily, by the next call of its tenant: charged at its estimate),
cancelling it (an admit whose reply was lost) or sweeping it (a worker that died) undoes exactly that.
Every key carries a TTL. A request that runs longer than the timeout has its deadline moved on while it
runs (``extend_many``, driven by ``gateway.quota.keeper``), so only a reservation the gateway lost track
of expires. An ``<id>`` starts with its worker's owner tag (``gateway.quota.owner``).

``Account``: what meters one (tenant, rule, key): its scopes, their limits in the call's order
(``limits.LimitRef``), and its admit call prepared once by the transport. An account with USD budgets
names their current calendar periods in its admit call, so it is made again when the first of them ends
(``spend_until``): the period arithmetic runs once per period, not per request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.identity.limits import LimitRef, Scope, SpendBudget, limit_refs
from gateway.pricing.period import PeriodSpan
from gateway.quota.ledger_report import ScopeReport, read_report
from gateway.quota.ledger_script import (  # noqa: F401 - deny_set_key re-exported: importers use the ledger
    KEY_PREFIX,
    LEDGER,
    deny_set_key,
    escape_key_part,
)
from gateway.quota.rules import QuotaRule
from gateway.valkey.transport import SLOT, Reply, ScriptTransport, Template, UnexpectedReply, Wire

if TYPE_CHECKING:
    from gateway.identity.auth import KeyIdentity

# Settle outcomes (what the script did).
SETTLE_NOOP = 0  # already settled, or expired earlier and charged at the estimate
SETTLE_APPLIED = 1  # the actual tokens were charged, the reservation released
SETTLE_EXPIRED = 2  # past its deadline: charged at the estimate

# The fields of an admit's reply (one bulk string, split on spaces; the member last, admitted only).
F_VERDICT, F_NOW, F_EXPIRED, F_REFUSED, F_RETRY = 0, 1, 2, 3, 4
F_RQ_LIMIT, F_RQ_REMAINING, F_RQ_RESET = 5, 6, 7
F_TK_LIMIT, F_TK_REMAINING, F_TK_RESET = 8, 9, 10
F_SHADOW, F_SPEND_ROOM, F_MEMBER = 11, 12, 13
ADMIT_FIELDS = 14  # admitted; a refusal has the first 12
REFUSED_FIELDS = 12
# A managed key in its tenant's deny set: ``D <now> blocked|revoked`` (nothing written).
F_KEY_STATUS = 2
KEY_STATUSES = (b"blocked", b"revoked")

# The records below are built per metered request: msgspec structs are made in C (a NamedTuple's
# constructor is a Python function), and hold nothing that could point back at them (gc=False).


class SpendWindow(msgspec.Struct, frozen=True, gc=False):
    """One USD budget of an account in its current period: what an alert of its window names."""

    tenant: str
    scope: Scope
    budget: SpendBudget
    span: PeriodSpan


class Reservation(msgspec.Struct, frozen=True, gc=False):
    """What settling needs: the tenant's keys, the member the script returned, the tokens it reserved
    and the request slots it took; with USD budgets, the worst-case cost it reserved (nano-USD) and its
    spend windows in the member's order (an alert in the settle reply names one by its number)."""

    zkey: bytes
    prefix: bytes
    member: bytes
    estimate: int
    slots: int = 1
    worst: int = 0
    spend: tuple[SpendWindow, ...] = ()


class Account(msgspec.Struct, frozen=True, gc=False):
    """What meters one (tenant, rule, key): the scopes whose limits apply (the key's own, then the
    rule's), every limit in the admit call's order, the tenant's keys and the admit call prepared by
    the transport (everything but the reservation id, the estimate and the slots). Made once per
    (tenant, rule, key) (``QuotaLedger.account``)."""

    tenant: str
    rule: QuotaRule | None
    key: Any  # gateway.identity.auth.KeyIdentity | None
    scopes: tuple[Scope, ...]
    limits: tuple[LimitRef, ...]
    zkey: bytes
    prefix: bytes
    admit: Template  # the transport's
    default_max_tokens: int
    has_requests: bool  # some enforced request limit: responses carry x-ratelimit-*-requests
    has_budgets: bool  # some enforced token budget: responses carry x-ratelimit-*-tokens
    leasable: bool  # no in-flight cap, no shadow limit: a worker may hold blocks of it
    has_hard_spend: bool  # some hard USD budget: a block's spend must leave it headroom
    first_window_s: int  # the shortest token window (0: none): a block never outlives its end
    lease_key: tuple[str, str, str]  # (tenant, rule, key): one open block each
    spend: tuple[SpendWindow, ...] = ()  # USD budgets in the call's order, in their current periods
    spend_until: float = 0.0  # Unix seconds the first of those periods ends (0: no USD budget)
    # A managed key's: its blocks are its own (the kid in ``lease_key``), asked for with its tenant's deny
    # set like its admits, and live at most MANAGED_BLOCK_TTL_S without a renewal grace (docs/keys.md).
    managed: bool = False


class AdmitCommand(msgspec.Struct, frozen=True, gc=False):
    """One admit: what goes on the wire and what its reply needs to become an Admission (or to be
    cancelled, when the reply is lost)."""

    wire: Wire
    account: Account
    reservation_id: bytes
    estimate: int
    slots: int = 1
    worst: int = 0  # nano-USD: the request's worst-case cost (USD budgets only)


class AdmitReply(msgspec.Struct, frozen=True, gc=False):
    """An admit's reply, read (``QuotaLedger.read``); ``fields`` keeps the numbers as the script wrote
    them (the rate-limit headers use those bytes as they are)."""

    admitted: bool
    fields: list[bytes]
    reservation: Reservation | None
    key_status: bytes | None = None  # refused because the managed key is ``blocked`` or ``revoked``

    @property
    def now_ms(self) -> int:
        return int(self.fields[F_NOW])

    def triple(self, at: int) -> tuple[int, int, int]:
        """(limit, remaining, reset_ms) at ``F_RQ_LIMIT`` or ``F_TK_LIMIT``; limit 0: no such limit."""
        fields = self.fields
        return int(fields[at]), int(fields[at + 1]), int(fields[at + 2])


def key_prefix(tenant: str) -> str:
    """Every key of ``tenant`` starts with this (it ends with ``:``); the hash tag is ``{<tenant>}``."""
    return f"{KEY_PREFIX}:{{{escape_key_part(tenant)}}}:"


def keys_of(tenant: str) -> tuple[bytes, bytes]:
    """(the tenant's reservation set, the prefix of its keys)."""
    prefix = key_prefix(tenant).encode()
    return prefix + b"z", prefix


def scope_part(scope: Scope) -> str:
    """A scope in the ledger's keys: ``r:<rule>``, ``a:<alias>``, ``k:<kid>``."""
    return f"{scope.tag}:{escape_key_part(scope.name)}"


def scopes_of(rule: QuotaRule | None, key: KeyIdentity | None) -> tuple[Scope, ...]:
    """The scopes that meter a request: the key's own limits (if any), then its rule's (if one applies)."""
    scopes: list[Scope] = []
    if key is not None and key.limits is not None and not key.limits.empty and key.name is not None:
        scopes.append(Scope("key", key.name, key.limits, key.limit_tag))
    if rule is not None:
        scopes.append(rule.scope)
    return tuple(scopes)


# Every tenant's reservation set: ``z`` right after the hash tag.
RESERVATION_SETS = KEY_PREFIX + ":{*}:z"

_ONE = b"1"  # a request's slots: one
_MAX_ACCOUNTS = 65536  # defensive cap; tenants and keys come from configured keys, so never reached


class QuotaLedger:
    """Valkey-backed ledger: the key layout, the script's calls and what their replies mean. Each
    decision is exactly one script call; the wire, pipelining and script reloads are the transport's
    (``transport.py``). Timeouts and failure policy belong to the callers; errors propagate.

    Admits are built here (``admit_command``), sent in batches (``send_admits``: one pipelined round trip
    for every admit of a loop tick, batched by ``batcher.AdmitBatcher``) and read back (``read``).
    """

    def __init__(self, transport: ScriptTransport, *, reservation_timeout_s: float,
                 clock: Callable[[], float] | None = None) -> None:
        transport.use_script(LEDGER)
        # ``clock``, tests only: the Unix seconds each script call passes as now (``StampedCalls``) and
        # calendar periods are read at, so a test moves windows on instead of waiting. The gateway sets none.
        if clock is not None:
            from gateway.valkey.transport import StampedCalls  # tests only: off the gateway's imports
            transport = StampedCalls(transport, clock)  # type: ignore[assignment]
        self._time = clock or time.time
        self._transport = transport
        self._fill = transport.fill
        self._timeout_ms = max(1, int(reservation_timeout_s * 1000))
        self._accounts: dict[tuple[str, object, object], Account] = {}
        # zkey, prefix, member, tokens, slots back, cost (nano-USD; empty: the worst case)
        self._settle = transport.template((SLOT, "settle", SLOT, SLOT, SLOT, SLOT, SLOT))

    @property
    def transport(self) -> ScriptTransport:
        return self._transport

    @property
    def reservation_timeout_s(self) -> float:
        return self._timeout_ms / 1000

    async def load_script(self) -> None:
        """Off the request path: at start and after the backend recovered (a restarted server has an
        empty script cache)."""
        await self._transport.load_script()

    async def ping(self) -> None:
        await self._transport.ping()

    async def close(self) -> None:
        await self._transport.aclose()

    # -- admissions (request path)

    def account(self, tenant: str, rule: QuotaRule | None, key: KeyIdentity | None = None,
                now: float | None = None) -> Account | None:
        """What meters (tenant, rule, key), made on first use and memoised; None when nothing does. With
        USD budgets, made again once ``now`` (Unix seconds) reaches the end of one of its periods."""
        memo = (tenant, rule, key)
        account = self._accounts.get(memo)
        if account is not None and account.spend_until and (now or self._time()) >= account.spend_until:
            account = None
        if account is None:
            account = self._make_account(tenant, rule, key, self._time() if now is None else now)
            if account is None:
                return None
            if len(self._accounts) >= _MAX_ACCOUNTS:
                self._accounts.clear()
            self._accounts[memo] = account
        return account

    def _make_account(self, tenant: str, rule: QuotaRule | None, key: KeyIdentity | None,
                      now: float) -> Account | None:
        scopes = scopes_of(rule, key)
        if not scopes:
            return None
        zkey, prefix = keys_of(tenant)
        kid = None if key is None else key.kid
        spend = tuple(SpendWindow(tenant, scope, budget, budget.clock.at(now))
                      for scope in scopes for budget in scope.limits.spend)
        # ARGV: mode, prefix, id, estimate, timeout, slots, scopes, deny set, kid, worst, then per scope
        # (ledger_script). A managed key's admit reads its tenant's deny set in the same call. The worst
        # case is a slot of the call only where a USD budget applies.
        args: list[Any] = [zkey, "admit", prefix, SLOT, SLOT, self._timeout_ms, SLOT, len(scopes),
                           "" if kid is None else deny_set_key(tenant), kid or "", SLOT if spend else 0]
        spans = iter(spend)
        for scope in scopes:
            limits = scope.limits
            args += [scope_part(scope), limits.max_in_flight, len(limits.requests)]
            for request in limits.requests:
                args += [request.window_s, request.count, request.burst, int(request.shadow)]
            args.append(len(limits.budgets))
            for budget in limits.budgets:
                args += [budget.window_s, budget.tokens, int(budget.shadow)]
            args.append(len(limits.spend))
            for spent in limits.spend:
                span = next(spans).span
                args += [spent.period, span.id, span.end * 1000, spent.nusd, int(spent.hard), spent.thresholds]
        refs = limit_refs(scopes)
        windows = [budget.window_s for scope in scopes for budget in scope.limits.budgets]
        return Account(
            tenant, rule, key, scopes, refs, zkey, prefix, self._transport.template(args),
            rule.default_max_tokens if rule is not None else DEFAULT_MAX_TOKENS,
            has_requests=any(ref.kind == "requests" and not ref.shadow for ref in refs),
            has_budgets=any(ref.kind == "tokens" and not ref.shadow for ref in refs),
            leasable=not any(s.limits.max_in_flight or s.limits.has_shadow for s in scopes),
            has_hard_spend=any(window.budget.hard for window in spend),
            first_window_s=min(windows, default=0),
            lease_key=(tenant, rule.name if rule is not None else "",
                       kid or (scopes[0].name if scopes[0].kind == "key" else "")),
            spend=spend,
            spend_until=min((window.span.end for window in spend), default=0),
            managed=kid is not None,
        )

    def admit_command(self, account: Account, estimate: int, reservation_id: bytes, slots: int = 1,
                      worst: int = 0) -> AdmitCommand:
        """``worst``: the request's worst-case cost in nano-USD (only an account with USD budgets reads it)."""
        if account.spend:
            return AdmitCommand(self._fill(account.admit, (reservation_id, b"%d" % estimate,
                                                           _ONE if slots == 1 else b"%d" % slots, b"%d" % worst)),
                                account, reservation_id, estimate, slots, worst)
        return AdmitCommand(self._fill(account.admit, (reservation_id, b"%d" % estimate,
                                                       _ONE if slots == 1 else b"%d" % slots)),
                            account, reservation_id, estimate, slots)

    def send_admits(self, commands: Sequence[AdmitCommand]) -> Awaitable[list[Reply]]:
        """Send admit commands in one pipelined round trip (per node in cluster mode); their replies
        in order, error replies (e.g. ``NoScriptError``) in place. Single node: a plain future."""
        return self._transport.send_admits([command.wire for command in commands])

    @staticmethod
    def read(command: AdmitCommand, reply: bytes) -> AdmitReply:
        """An admit reply (``command`` is the one that produced it). Raises ``UnexpectedReply`` (a
        ValueError) for a reply the script cannot have written: the caller treats it as a backend error."""
        fields = reply.split(b" ", F_MEMBER)
        admitted = fields[0] == b"1"
        if len(fields) != (ADMIT_FIELDS if admitted else REFUSED_FIELDS) or not (admitted or fields[0] == b"0"):
            if fields[0] == b"D" and len(fields) == 3 and fields[F_KEY_STATUS] in KEY_STATUSES:
                return AdmitReply(False, fields, None, fields[F_KEY_STATUS])
            raise UnexpectedReply(f"unexpected admit reply {reply[:80]!r}")
        reservation = None
        if admitted:
            account = command.account
            reservation = Reservation(account.zkey, account.prefix, fields[F_MEMBER], command.estimate, command.slots,
                                      command.worst, account.spend)
        return AdmitReply(admitted, fields, reservation)

    # -- settling (off the request path)

    async def settle(self, reservation: Reservation, actual_tokens: int, slots_back: int = 0,
                     cost_nusd: int | None = None) -> Reply:
        """Charge ``actual_tokens`` (and, with USD budgets, ``cost_nusd``; None: its worst case) for a
        reservation and give back ``slots_back`` request slots; returns the outcome (SETTLE_*), or
        ``[outcome, crossing...]`` when alert thresholds were crossed (``settle_outcome``). Idempotent."""
        return await self._transport.run_one(self._settle_wire(reservation, actual_tokens, slots_back, cost_nusd))

    async def settle_many(self, items: Sequence[tuple[Reservation, int, int, int | None]]) -> list[Reply]:
        """Settle a batch in one pipelined round trip; per item its reply (as ``settle``) or exception."""
        return await self._transport.run_batch([self._settle_wire(*item) for item in items])

    def _settle_wire(self, reservation: Reservation, actual_tokens: int, slots_back: int,
                     cost_nusd: int | None = None) -> Wire:
        cost = b"" if cost_nusd is None else b"%d" % max(0, cost_nusd)
        return self._fill(self._settle, (reservation.zkey, reservation.prefix, reservation.member,
                                         b"%d" % max(0, actual_tokens), b"%d" % slots_back, cost))

    async def extend_many(self, reservations: Sequence[Reservation], per_call: int = 256) -> int:
        """Move the deadline of these reservations (requests still running) to now + the timeout: one
        script call per tenant and ``per_call`` members, all in one pipelined round trip. Returns how
        many were live and extended; raises on a backend error (the caller retries on its next pass,
        well before the deadlines it is guarding)."""
        by_set: dict[tuple[bytes, bytes], list[bytes]] = {}
        for reservation in reservations:
            by_set.setdefault((reservation.zkey, reservation.prefix), []).append(reservation.member)
        wire = self._transport.wire
        wires = [
            wire((zkey, "extend", prefix, self._timeout_ms, *members[start:start + per_call]))
            for (zkey, prefix), members in by_set.items()
            for start in range(0, len(members), per_call)
        ]
        extended = 0
        for reply in await self._transport.run_batch(wires):
            if isinstance(reply, Exception):
                raise reply
            if reply.__class__ is not int:
                raise UnexpectedReply(f"unexpected extend reply {reply!r:.80}")
            extended += reply  # type: ignore[operator]
        return extended

    async def cancel_many(self, commands: Sequence[AdmitCommand]) -> list[bool | Exception]:
        """Undo, unused, the reservations of admits whose replies were lost; per admit: released
        (True), none there (yet), or the exception."""
        wire = self._transport.wire
        replies = await self._transport.run_batch([
            wire((c.account.zkey, "cancel", c.account.prefix, c.reservation_id)) for c in commands
        ])
        return [r if isinstance(r, Exception) else r == 1 for r in replies]

    async def sweep(self, owner_tags: Sequence[bytes], batch: int = 128) -> tuple[int, int]:
        """Settle every open reservation whose id starts with one of ``owner_tags`` (workers that
        died): free its in-flight places, charge its estimate. Returns (reservations, tokens).

        Scans the keyspace for reservation sets (every node in cluster mode), then one script call
        per set, pipelined ``batch`` at a time. Idempotent, and safe against a racing settle: the
        script removes each member once, whoever comes first."""
        released = charged = 0
        wire = self._transport.wire

        async def run(keys: list[bytes]) -> None:
            nonlocal released, charged
            for reply in await self._transport.run_batch([wire((key, "sweep", key[:-1], *owner_tags)) for key in keys]):
                if isinstance(reply, Exception):
                    raise reply
                if not (isinstance(reply, list) and len(reply) == 2 and all(x.__class__ is int for x in reply)):
                    raise UnexpectedReply(f"unexpected sweep reply {reply!r:.80}")
                released += reply[0]
                charged += reply[1]

        keys: list[bytes] = []
        async for key in self._transport.scan_keys(RESERVATION_SETS, "zset"):
            keys.append(key)
            if len(keys) >= batch:
                await run(keys)
                keys = []
        if keys:
            await run(keys)
        return released, charged

    async def report(self, tenant: str, scopes: Sequence[Scope]) -> tuple[int, list[ScopeReport]]:
        """The tenant's open reservations and, per scope, what its counters hold now. Raises
        ``UnexpectedReply`` for a reply the script cannot have written."""
        zkey, prefix = keys_of(tenant)
        args: list[Any] = [zkey, "report", prefix, len(scopes)]
        for scope in scopes:
            limits = scope.limits
            args += [scope_part(scope), int(limits.max_in_flight > 0), len(limits.requests)]
            for request in limits.requests:
                args += [request.window_s, request.count, request.burst]
            args.append(len(limits.budgets))
            args += [budget.window_s for budget in limits.budgets]
            args.append(len(limits.spend))
            for spent in limits.spend:
                span = spent.clock.at(self._time())
                args += [spent.period, span.id, span.end * 1000]
        reply: Any = await self._transport.run_one(self._transport.wire(args))
        try:
            values = [int(value) for value in reply]
            reports = read_report(scopes, values, self._time)
        except (TypeError, ValueError, IndexError):
            raise UnexpectedReply(f"unexpected report reply {reply!r:.80}") from None
        return values[1], reports


DEFAULT_MAX_TOKENS = 1024  # a key's own budgets with no rule: the estimate's completion allowance
