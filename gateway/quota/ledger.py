"""The shared token ledger in Valkey: one server-side Lua script (``ledger_script``), one round trip per decision.

Key layout (version ``v1``; every key of one (rule, tenant) shares the hash tag, so one script call
touches one Valkey Cluster slot):

    gg:q:v1:{<rule>:<tenant>}:r                 ZSET  reservation member -> deadline (ms, server clock)
    gg:q:v1:{<rule>:<tenant>}:w:<win_s>:<idx>   HASH  u = tokens charged, r = tokens reserved (in flight)

``<rule>`` and ``<tenant>`` are percent-escaped (``%``, ``:``, ``{``, ``}``) so distinct pairs can never
share a key or split the hash tag. Windows are fixed and aligned to the epoch: ``idx = floor(now /
window)`` with ``now`` from Valkey ``TIME`` inside the script, so every gateway agrees on the clock and
window boundaries. A reservation member is ``<id>|<estimate>|<win_s>:<idx>,...``: it records exactly
which windows it was admitted into, so settling (or expiring) it adjusts those windows even after a
config change, and removing the member is the idempotency check (settling twice charges once).
An ``<id>`` starts with its worker's owner tag (``gateway.quota.owner``), so the reservations of a
worker that died can be found and settled (``sweep``) without waiting for their deadline.

Tokens are attributed to the windows the request was admitted in (refunds and overage included).
A denied request changes nothing (all budgets or none). Every key carries a TTL: a window lives
until its end + the reservation timeout + 60 s of slack, the reservation set until its last deadline
+ at least 30 s; an expired window is never recreated by a late settle. Reservations past their
deadline are expired lazily by the next call on that (rule, tenant): charged at their estimate. A
request that runs longer than the timeout has its deadline moved on while it runs (``extend_many``,
driven by ``gateway.quota.keeper``), so only a reservation the gateway lost track of expires.

The script carries its version in its text (see ``ledger_script`` for rolling upgrades).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.quota.ledger_script import KEY_PREFIX
from gateway.quota.rules import QuotaRule
from gateway.quota.transport import SLOT, LedgerTransport, Reply, Template, Wire

# Settle outcomes (what the script did).
SETTLE_NOOP = 0  # already settled, or expired earlier and charged at the estimate
SETTLE_APPLIED = 1  # the actual tokens were charged, the reservation released
SETTLE_EXPIRED = 2  # past its deadline: charged at the estimate

ADMITTED = 1
DENIED_BUDGET = 0
DENIED_CONCURRENCY = -1

# The records below are built per metered request: msgspec structs are made in C (a NamedTuple's
# constructor is a Python function), and hold nothing that could point back at them (gc=False).


class Reservation(msgspec.Struct, frozen=True, gc=False):
    """What settling needs: the (rule, tenant) keys and the member the script returned."""

    zkey: bytes
    prefix: bytes
    member: bytes
    estimate: int


class Account(msgspec.Struct, frozen=True, gc=False):
    """One (rule, tenant)'s place in the ledger: its keys, and its admit call prepared by the transport
    (everything but the reservation id and the estimate). Made once per pair (``QuotaLedger.account``)."""

    rule: QuotaRule
    tenant: str
    zkey: bytes
    prefix: bytes
    admit: Template  # the transport's


class AdmitCommand(msgspec.Struct, frozen=True, gc=False):
    """One admit: what goes on the wire and what its reply needs to become a ``Decision`` (or to be
    cancelled, when the reply is lost)."""

    wire: Wire
    account: Account
    reservation_id: bytes
    estimate: int


class Decision(msgspec.Struct, frozen=True, gc=False):
    """One admission verdict with what the rate-limit headers need.

    ``verdict``: ADMITTED, DENIED_BUDGET or DENIED_CONCURRENCY. ``limit``/``remaining``/``reset_ms``
    describe the tightest budget (admitted, remaining after this reservation) or, denied, the budget
    the estimate can never fit, else the one that blocks longest. ``reset_ms``: to that window's end.
    """

    verdict: int
    limit: int
    remaining: int
    reset_ms: int
    reservation: Reservation | None
    now_ms: int = 0  # the ledger's clock when it decided


@dataclass(frozen=True, slots=True)
class WindowReport:
    window_s: int
    limit: int
    used: int
    reserved: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class RuleReport:
    rule: str
    in_flight: int
    max_in_flight: int
    windows: tuple[WindowReport, ...]


def escape_key_part(value: str) -> str:
    """Make a rule or tenant name safe inside ``{...}`` and unambiguous around ``:``."""
    return value.replace("%", "%25").replace(":", "%3A").replace("{", "%7B").replace("}", "%7D")


def key_prefix(rule_name: str, tenant: str) -> str:
    return f"{KEY_PREFIX}:{{{escape_key_part(rule_name)}:{escape_key_part(tenant)}}}"


# Every (rule, tenant) reservation set: ``:r`` right after the hash tag (window keys go on after it).
RESERVATION_SETS = KEY_PREFIX + ":{*}:r"

_MAX_ACCOUNTS = 65536  # defensive cap; tenants come from configured keys, so never reached in practice


class QuotaLedger:
    """Valkey-backed token ledger: the key layout, the script's calls and what their replies mean. Each
    decision is exactly one script call; the wire, pipelining and script reloads are the transport's
    (``transport.py``). Timeouts and failure policy belong to the callers; errors propagate.

    Admits are built here (``admit_command``), sent in batches (``send_admits``: one pipelined round trip
    for every admit of a loop tick, batched by ``batcher.AdmitBatcher``) and read back (``decision``).
    """

    def __init__(self, transport: LedgerTransport, *, reservation_timeout_s: float) -> None:
        self._transport = transport
        self._fill = transport.fill
        self._timeout_ms = max(1, int(reservation_timeout_s * 1000))
        self._accounts: dict[tuple[str, str], Account] = {}
        self._settle = transport.template((SLOT, "settle", SLOT, SLOT, SLOT))  # zkey, prefix, member, tokens

    @property
    def transport(self) -> LedgerTransport:
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

    def account(self, rule: QuotaRule, tenant: str) -> Account:
        """The (rule, tenant)'s keys and prepared admit (made on first use, then memoised)."""
        pair = (rule.name, tenant)
        account = self._accounts.get(pair)
        if account is None or account.rule is not rule:
            zkey, prefix = keys_of(rule.name, tenant)
            tail: tuple[int, ...] = (self._timeout_ms, rule.max_in_flight)
            for budget in rule.budgets:
                tail += (budget.window_s, budget.tokens)
            # ARGV: mode, prefix, id, estimate, timeout, max_in_flight, {window, tokens}...
            admit = self._transport.template((zkey, "admit", prefix, SLOT, SLOT, *tail))
            if len(self._accounts) >= _MAX_ACCOUNTS:
                self._accounts.clear()
            account = self._accounts[pair] = Account(rule, tenant, zkey, prefix, admit)
        return account

    def admit_command(self, account: Account, estimate: int, reservation_id: bytes) -> AdmitCommand:
        return AdmitCommand(self._fill(account.admit, (reservation_id, b"%d" % estimate)), account,
                            reservation_id, estimate)

    def send_admits(self, commands: Sequence[AdmitCommand]) -> Awaitable[list[Reply]]:
        """Send admit commands in one pipelined round trip (per node in cluster mode); their replies
        in order, error replies (e.g. ``NoScriptError``) in place. Single node: a plain future."""
        return self._transport.send_admits([command.wire for command in commands])

    @staticmethod
    def decision(command: AdmitCommand, reply: bytes) -> Decision:
        """The verdict in an admit reply (``command`` is the one that produced it)."""
        fields = reply.split(b" ", 6)
        verdict = int(fields[0])
        reservation = None
        if verdict == ADMITTED:
            account = command.account
            reservation = Reservation(account.zkey, account.prefix, fields[6], command.estimate)
        return Decision(verdict, int(fields[1]), int(fields[2]), int(fields[3]), reservation, int(fields[4]))

    # -- settling (off the request path)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> int:
        """Charge ``actual_tokens`` for a reservation; returns the outcome (SETTLE_*). Idempotent."""
        return await self._transport.run_one(self._settle_wire(reservation, actual_tokens))  # type: ignore[return-value]

    async def settle_many(self, items: Sequence[tuple[Reservation, int]]) -> list[Reply]:
        """Settle a batch in one pipelined round trip; per item its outcome (SETTLE_*) or exception."""
        return await self._transport.run_batch([self._settle_wire(r, actual) for r, actual in items])

    def _settle_wire(self, reservation: Reservation, actual_tokens: int) -> Wire:
        return self._fill(self._settle, (reservation.zkey, reservation.prefix, reservation.member,
                                         b"%d" % max(0, actual_tokens)))

    async def extend_many(self, reservations: Sequence[Reservation], per_call: int = 256) -> int:
        """Move the deadline of these reservations (requests still running) to now + the timeout: one
        script call per (rule, tenant) and ``per_call`` members, all in one pipelined round trip.
        Returns how many were live and extended; raises on a backend error (the caller retries on its
        next pass, well before the deadlines it is guarding)."""
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
            extended += reply  # type: ignore[operator]
        return extended

    async def cancel_many(self, commands: Sequence[AdmitCommand]) -> list[bool | Exception]:
        """Release, unused, the reservations of admits whose replies were lost; per admit: released
        (True), none there (yet), or the exception."""
        wire = self._transport.wire
        replies = await self._transport.run_batch([
            wire((c.account.zkey, "cancel", c.account.prefix, c.reservation_id)) for c in commands
        ])
        return [r if isinstance(r, Exception) else bool(r) for r in replies]

    async def sweep(self, owner_tags: Sequence[bytes], batch: int = 128) -> tuple[int, int]:
        """Settle every open reservation whose id starts with one of ``owner_tags`` (workers that
        died): free its concurrency slot, charge its estimate. Returns (reservations, tokens).

        Scans the keyspace for reservation sets (every node in cluster mode), then one script call
        per set, pipelined ``batch`` at a time. Idempotent, and safe against a racing settle: the
        script removes each member once, whoever comes first."""
        released = charged = 0
        wire = self._transport.wire

        async def run(keys: list[bytes]) -> None:
            nonlocal released, charged
            for reply in await self._transport.run_batch([wire((key, "sweep", key[:-2], *owner_tags)) for key in keys]):
                if isinstance(reply, Exception):
                    raise reply
                released += reply[0]  # type: ignore[index]
                charged += reply[1]  # type: ignore[index]

        keys: list[bytes] = []
        async for key in self._transport.scan_keys(RESERVATION_SETS, "zset"):
            keys.append(key)
            if len(keys) >= batch:
                await run(keys)
                keys = []
        if keys:
            await run(keys)
        return released, charged

    async def report(self, rule: QuotaRule, tenant: str) -> RuleReport:
        zkey, prefix = keys_of(rule.name, tenant)
        reply: Any = await self._transport.run_one(
            self._transport.wire((zkey, "report", prefix, *(b.window_s for b in rule.budgets))))
        windows = []
        for i, budget in enumerate(rule.budgets):
            used, reserved, reset_ms = (max(0, x) for x in reply[2 + 3 * i : 5 + 3 * i])
            windows.append(
                WindowReport(
                    window_s=budget.window_s,
                    limit=budget.tokens,
                    used=used,
                    reserved=reserved,
                    remaining=max(0, budget.tokens - used - reserved),
                    reset_s=reset_ms / 1000,
                )
            )
        return RuleReport(rule.name, reply[1], rule.max_in_flight, tuple(windows))


def keys_of(rule_name: str, tenant: str) -> tuple[bytes, bytes]:
    """(the reservation set, the window keys' prefix) of a (rule, tenant)."""
    prefix = key_prefix(rule_name, tenant).encode()
    return prefix + b":r", prefix
