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

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from valkey.exceptions import NoScriptError

from gateway.quota.ledger_script import KEY_PREFIX, LEDGER_SCRIPT, LEDGER_SHA
from gateway.quota.resp import RespClient, encode_command
from gateway.quota.rules import QuotaRule

# Settle outcomes (what the script did).
SETTLE_NOOP = 0  # already settled, or expired earlier and charged at the estimate
SETTLE_APPLIED = 1  # the actual tokens were charged, the reservation released
SETTLE_EXPIRED = 2  # past its deadline: charged at the estimate

ADMITTED = 1
DENIED_BUDGET = 0
DENIED_CONCURRENCY = -1


class Reservation(NamedTuple):
    """What settling needs: the (rule, tenant) keys and the member the script returned."""

    zkey: bytes
    prefix: bytes
    member: bytes
    estimate: int


class AdmitCommand(NamedTuple):
    """One admit: what goes on the wire (RESP bytes for ``RespClient``, the argument tuple for a
    cluster client) and what its reply needs to become a ``Decision`` (or to be cancelled)."""

    wire: Any
    zkey: bytes
    prefix: bytes
    reservation_id: bytes
    estimate: int


class Decision(NamedTuple):
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

# A settle on the wire: zkey, prefix, member, tokens.
_SETTLE_WIRE = (
    b"*8\r\n$7\r\nEVALSHA\r\n$40\r\n" + LEDGER_SHA.encode()
    + b"\r\n$1\r\n1\r\n$%d\r\n%b\r\n$6\r\nsettle\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n"
)
# An admit on the wire: a cached head (EVALSHA sha 1 zkey admit prefix), the id, the estimate, and
# the cached tail (timeout, the rule's max_in_flight and budgets); one %-format per request.
_ADMIT_WIRE = b"%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b"


class QuotaLedger:
    """Valkey-backed token ledger. Each decision is exactly one script call (plus a reload on NOSCRIPT).

    ``client`` is what ``backend.create_client`` returns: the pipelined ``RespClient`` (one node) or
    a valkey-py ``ValkeyCluster``, both with bytes replies and valkey-py's exceptions. Timeouts and
    failure policy belong to the caller (``QuotaGate``); errors propagate.

    Admissions are built here (``admit_command``), sent in batches (``send_admits``: one pipelined
    round trip for every admit of a loop tick) and read back (``decision``); the gate does the
    batching. ``max_concurrent_calls`` bounds the calls in flight of a cluster client, and with them
    the connections its pools open (each call holds one connection per node for its round trip): a
    burst waits for a slot instead of exhausting the servers' ``maxclients``. (``RespClient``
    pipelines everything on one connection.)
    """

    def __init__(self, client: Any, *, reservation_timeout_s: float, max_concurrent_calls: int = 64) -> None:
        self._client = client
        self._encodes = isinstance(client, RespClient)  # else valkey-py's cluster client: argument tuples
        self._slots = asyncio.Semaphore(max_concurrent_calls)
        self._timeout_ms = max(1, int(reservation_timeout_s * 1000))
        # (rule name, tenant) -> (zkey, prefix), pre-encoded; bounded: tenants come from configured keys.
        self._keys: dict[tuple[str, str], tuple[bytes, bytes]] = {}
        # (rule name, tenant) -> what every admit of that pair sends around its id and estimate.
        self._admit_parts: dict[tuple[str, str], tuple[bytes, bytes, Any, Any]] = {}

    @property
    def client(self) -> Any:
        return self._client

    @property
    def reservation_timeout_s(self) -> float:
        return self._timeout_ms / 1000

    async def load_script(self) -> None:
        """SCRIPT LOAD (on every primary in cluster mode), off the request path: at start and after
        the backend recovered (a restarted server has an empty script cache)."""
        sha = await self._client.script_load(LEDGER_SCRIPT)
        if isinstance(sha, bytes):
            sha = sha.decode()
        if sha != LEDGER_SHA:  # would mean the server hashes differently: refuse to guess
            raise RuntimeError(f"unexpected script sha {sha} (expected {LEDGER_SHA})")

    async def ping(self) -> None:
        """One cheap command: raises unless the backend serves commands (a loading server does not)."""
        await self._client.ping()

    # -- admissions (request path)

    def admit_command(self, rule: QuotaRule, tenant: str, estimate: int, reservation_id: bytes) -> AdmitCommand:
        parts = self._admit_parts.get((rule.name, tenant))
        if parts is None:
            parts = self._prepare_admits(rule, tenant)
        zkey, prefix, head, tail = parts
        if self._encodes:
            count = b"%d" % estimate
            wire = _ADMIT_WIRE % (head, len(reservation_id), reservation_id, len(count), count, tail)
        else:
            wire = (*head, reservation_id, estimate, *tail)
        return AdmitCommand(wire, zkey, prefix, reservation_id, estimate)

    def send_admits(self, commands: Sequence[AdmitCommand]) -> Awaitable[list[Any]]:
        """Send admit commands in one pipelined round trip (per node in cluster mode); their replies
        in order, error replies (e.g. ``NoScriptError``) in place. ``RespClient``: a plain future."""
        wires = [command.wire for command in commands]
        if self._encodes:
            return self._client.send_encoded(b"".join(wires), len(wires))
        return self._pipelined(wires)

    @staticmethod
    def decision(command: AdmitCommand, reply: bytes) -> Decision:
        """The verdict in an admit reply (``command`` is the one that produced it)."""
        fields = reply.split(b" ", 6)
        verdict = int(fields[0])
        reservation = None
        if verdict == ADMITTED:
            reservation = Reservation(command.zkey, command.prefix, fields[6], command.estimate)
        return Decision(verdict, int(fields[1]), int(fields[2]), int(fields[3]), reservation, int(fields[4]))

    def _prepare_admits(self, rule: QuotaRule, tenant: str) -> tuple[bytes, bytes, Any, Any]:
        zkey, prefix = self._keys_for(rule.name, tenant)
        tail: tuple[int, ...] = (self._timeout_ms, rule.max_in_flight)
        for budget in rule.budgets:
            tail += (budget.window_s, budget.tokens)
        # valkey-py's cluster routing recognises EVALSHA by its str name.
        head = ("EVALSHA", LEDGER_SHA, 1, zkey, b"admit", prefix)
        parts: tuple[bytes, bytes, Any, Any] = (zkey, prefix, head, tail)
        if self._encodes:  # the array header counts the id and estimate that go in between
            array = b"*%d\r\n" % (len(head) + 2 + len(tail))
            parts = (zkey, prefix, array + _bulk_strings(head), _bulk_strings(tail))
        if len(self._admit_parts) >= 65536:  # defensive cap, as for the keys
            self._admit_parts.clear()
        self._admit_parts[(rule.name, tenant)] = parts
        return parts

    # -- settling (off the request path)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> int:
        """Charge ``actual_tokens`` for a reservation; returns the outcome (SETTLE_*). Idempotent."""
        return await self._eval(
            reservation.zkey, "settle", reservation.prefix, reservation.member, max(0, actual_tokens)
        )

    async def settle_many(self, items: Sequence[tuple[Reservation, int]]) -> list[int | Exception]:
        """Settle a batch in one pipelined round trip; per item its outcome (SETTLE_*) or exception."""
        if self._encodes:
            wires: list[Any] = []
            for r, actual in items:
                tokens = b"%d" % max(0, actual)
                wires.append(_SETTLE_WIRE % (len(r.zkey), r.zkey, len(r.prefix), r.prefix, len(r.member), r.member,
                                             len(tokens), tokens))
        else:
            wires = [("EVALSHA", LEDGER_SHA, 1, r.zkey, "settle", r.prefix, r.member, max(0, a)) for r, a in items]
        return await self._pipeline_reloading(wires)

    async def extend_many(self, reservations: Sequence[Reservation], per_call: int = 256) -> int:
        """Move the deadline of these reservations (requests still running) to now + the timeout: one
        script call per (rule, tenant) and ``per_call`` members, all in one pipelined round trip.
        Returns how many were live and extended; raises on a backend error (the caller retries on its
        next pass, well before the deadlines it is guarding)."""
        by_set: dict[tuple[bytes, bytes], list[bytes]] = {}
        for reservation in reservations:
            by_set.setdefault((reservation.zkey, reservation.prefix), []).append(reservation.member)
        wires = []
        for (zkey, prefix), members in by_set.items():
            for start in range(0, len(members), per_call):
                wires.append(self._wire(("EVALSHA", LEDGER_SHA, 1, zkey, "extend", prefix, self._timeout_ms,
                                         *members[start:start + per_call])))
        extended = 0
        for reply in await self._pipeline_reloading(wires):
            if isinstance(reply, Exception):
                raise reply
            extended += reply
        return extended

    async def cancel_many(self, commands: Sequence[AdmitCommand]) -> list[bool | Exception]:
        """Release, unused, the reservations of admits whose replies were lost; per admit: released
        (True), none there (yet), or the exception."""
        replies = await self._pipeline_reloading([
            self._wire(("EVALSHA", LEDGER_SHA, 1, c.zkey, "cancel", c.prefix, c.reservation_id)) for c in commands
        ])
        return [r if isinstance(r, Exception) else bool(r) for r in replies]

    async def sweep(self, owner_tags: Sequence[bytes], batch: int = 128) -> tuple[int, int]:
        """Settle every open reservation whose id starts with one of ``owner_tags`` (workers that
        died): free its concurrency slot, charge its estimate. Returns (reservations, tokens).

        Scans the keyspace for reservation sets (every node in cluster mode), then one script call
        per set, pipelined ``batch`` at a time. Idempotent, and safe against a racing settle: the
        script removes each member once, whoever comes first."""
        released = charged = 0

        async def run(keys: list[bytes]) -> None:
            nonlocal released, charged
            replies = await self._pipeline_reloading([
                self._wire(("EVALSHA", LEDGER_SHA, 1, key, "sweep", key[:-2], *owner_tags)) for key in keys
            ])
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
                released += reply[0]
                charged += reply[1]

        keys: list[bytes] = []
        async for key in self._client.scan_iter(match=RESERVATION_SETS, count=1000, _type="zset"):
            keys.append(key)
            if len(keys) >= batch:
                await run(keys)
                keys = []
        if keys:
            await run(keys)
        return released, charged

    async def report(self, rule: QuotaRule, tenant: str) -> RuleReport:
        zkey, prefix = self._keys_for(rule.name, tenant)
        reply = await self._eval(zkey, "report", prefix, *(b.window_s for b in rule.budgets))
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

    def _keys_for(self, rule_name: str, tenant: str) -> tuple[bytes, bytes]:
        pair = (rule_name, tenant)
        keys = self._keys.get(pair)
        if keys is None:
            if len(self._keys) >= 65536:  # defensive cap; tenants are configured, so never in practice
                self._keys.clear()
            prefix = key_prefix(rule_name, tenant).encode()
            keys = self._keys[pair] = (prefix + b":r", prefix)
        return keys

    async def _eval(self, zkey: bytes, *args: Any) -> Any:
        async with self._slots:
            try:
                return await self._client.evalsha(LEDGER_SHA, 1, zkey, *args)
            except NoScriptError:
                # The server lost its script cache (restart, failover, SCRIPT FLUSH): reload, retry once.
                await self._client.script_load(LEDGER_SCRIPT)
                return await self._client.evalsha(LEDGER_SHA, 1, zkey, *args)

    def _wire(self, args: Sequence[Any]) -> Any:
        return encode_command(args) if self._encodes else args

    async def _pipelined(self, wires: Sequence[Any]) -> list[Any]:
        """One round trip (per node in cluster mode) for commands in their wire form (``_wire``)."""
        if not wires:
            return []
        async with self._slots:
            if self._encodes:
                return await self._client.send_encoded(b"".join(wires), len(wires))
            pipe = self._client.pipeline(transaction=False)
            for args in wires:
                # execute_command, not pipe.evalsha(): ClusterPipeline blocks the helper by name but
                # routes EVALSHA by its key like any other keyed command.
                pipe.execute_command(*args)
            return await pipe.execute(raise_on_error=False)

    async def _pipeline_reloading(self, wires: Sequence[Any]) -> list[Any]:
        """Pipelined; commands answered NOSCRIPT (server restarted) are redone once after a reload.
        Every script mode is safe to redo: a NOSCRIPT reply means the script did not run."""
        replies = await self._pipelined(wires)
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            await self.load_script()
            for i, reply in zip(lost, await self._pipelined([wires[i] for i in lost]), strict=True):
                replies[i] = reply
        return replies


def _bulk_strings(args: Sequence[Any]) -> bytes:
    """``args`` as RESP bulk strings without the array header (a part of a longer command)."""
    return encode_command(args).split(b"\r\n", 1)[1]
