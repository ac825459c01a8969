"""The shared token ledger in Valkey: one server-side Lua script, one round trip per decision.

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
deadline are expired lazily by the next call on that (rule, tenant): charged at their estimate.

The script carries its version in its text; a changed script has a new SHA, so old and new gateways
can run side by side during a rolling upgrade; a changed key layout must bump ``v1`` in both.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from valkey.exceptions import NoScriptError

from gateway.quota.resp import RespClient, encode_command
from gateway.quota.rules import QuotaRule

SCRIPT_NAME = "gridgate-quota-ledger"
SCRIPT_VERSION = 3
KEY_PREFIX = "gg:q:v1"

LEDGER_SCRIPT = (
    f"""-- {SCRIPT_NAME} v{SCRIPT_VERSION} (keys {KEY_PREFIX}); modes: admit | settle | cancel | sweep | report
"""
    + r"""
local mode = ARGV[1]
local zkey = KEYS[1]      -- reservations of one (rule, tenant): member -> deadline (ms)
local prefix = ARGV[2]    -- same hash tag as zkey; window keys are built from it
local SLACK_MS = 60000    -- keys outlive their last use by this much so late settles still land
local EXPIRE_BATCH = 128  -- bound the work one call does on stale reservations

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function window_key(win, idx)
  return prefix .. ':w:' .. win .. ':' .. idx
end

-- TTL floor: make `key` live at least `ms - SLACK_MS / 2` more. Renewing only when the TTL has run
-- down by half the slack keeps PEXPIRE (an AOF write) off most calls. (PEXPIRE GT cannot be used:
-- it ignores keys without a TTL.)
local function keep_for(key, ms)
  if redis.call('PTTL', key) < ms - SLACK_MS / 2 then redis.call('PEXPIRE', key, ms) end
end

-- Take a reservation out of "reserved" and charge `charge` tokens (nil = its estimate) as used,
-- in every window it was admitted into. A window that already expired is not recreated.
local function release(member, charge)
  local est, wins = string.match(member, '^[^|]*|(%d+)|(.*)$')
  est = tonumber(est)
  if charge == nil then charge = est end
  for win, idx in string.gmatch(wins, '(%d+):(%d+)') do
    local k = window_key(win, idx)
    if redis.call('EXISTS', k) == 1 then
      redis.call('HINCRBY', k, 'r', -est)
      if charge ~= 0 then redis.call('HINCRBY', k, 'u', charge) end
    end
  end
  return est
end

-- Lazy expiry: a reservation past its deadline is charged at its estimate.
local function expire_stale()
  local stale = redis.call('ZRANGEBYSCORE', zkey, '-inf', now, 'LIMIT', 0, EXPIRE_BATCH)
  for i = 1, #stale do release(stale[i], nil) end
  if #stale > 0 then redis.call('ZREM', zkey, unpack(stale)) end
  return #stale
end

if mode == 'admit' then
  -- ARGV: mode, prefix, id, estimate, timeout_ms, max_in_flight, {window_s, limit}...
  local expired = expire_stale()
  local est = tonumber(ARGV[4])
  local timeout_ms = tonumber(ARGV[5])
  local max_in_flight = tonumber(ARGV[6])
  local keys, resets, parts = {}, {}, {}
  -- Headers: the tightest budget when admitted; when denied, a budget the estimate can never fit
  -- (its whole window is smaller), else the longest-blocking failing budget.
  local lim, rem, reset = 0, nil, 0
  local deny_lim, deny_rem, deny_reset, deny_never = 0, 0, -1, false
  local n = (#ARGV - 6) / 2
  for i = 1, n do
    local win_s = ARGV[5 + 2 * i]
    local limit = tonumber(ARGV[6 + 2 * i])
    local wms = tonumber(win_s) * 1000
    local idx = math.floor(now / wms)
    local k = window_key(win_s, idx)
    local v = redis.call('HMGET', k, 'u', 'r')
    local room = limit - (tonumber(v[1]) or 0) - (tonumber(v[2]) or 0)
    local r = (idx + 1) * wms - now
    if est > room then
      local never = est > limit
      if (never and not deny_never) or (never == deny_never and r > deny_reset) then
        deny_lim, deny_rem, deny_reset, deny_never = limit, math.max(room, 0), r, never
      end
    elseif rem == nil or room - est < rem then
      lim, rem, reset = limit, room - est, r
    end
    keys[i], resets[i], parts[i] = k, r, win_s .. ':' .. idx
  end
  -- One bulk string instead of an array: the client parses one reply, not seven (~25% faster).
  if deny_reset >= 0 then
    return string.format('0 %d %d %d %d %d', deny_lim, deny_rem, deny_reset, now, expired)
  end
  if max_in_flight > 0 and redis.call('ZCOUNT', zkey, '(' .. now, '+inf') >= max_in_flight then
    return string.format('-1 %d %d %d %d %d', lim, rem + est, reset, now, expired)
  end
  for i = 1, n do
    redis.call('HINCRBY', keys[i], 'r', est)
    keep_for(keys[i], resets[i] + timeout_ms + SLACK_MS)
  end
  local member = ARGV[3] .. '|' .. ARGV[4] .. '|' .. table.concat(parts, ',')
  redis.call('ZADD', zkey, now + timeout_ms, member)
  keep_for(zkey, timeout_ms + SLACK_MS)
  return string.format('1 %d %d %d %d %d ', lim, rem, reset, now, expired) .. member

elseif mode == 'settle' then
  -- ARGV: mode, prefix, member, actual_tokens
  -- -> the outcome: 0 no-op, 1 charged as asked, 2 expired (charged at the estimate)
  local deadline = redis.call('ZSCORE', zkey, ARGV[3])
  if not deadline then return 0 end  -- settled before, or expired and charged: a no-op
  redis.call('ZREM', zkey, ARGV[3])
  if tonumber(deadline) <= now then
    release(ARGV[3], nil)
    return 2
  end
  release(ARGV[3], tonumber(ARGV[4]))
  return 1

elseif mode == 'cancel' then
  -- ARGV: mode, prefix, id. The admit's reply never reached the gateway (it timed out), so the
  -- request was refused: release that reservation unused. Rare, so a scan of one tenant's set is fine.
  local cursor = '0'
  repeat
    local page = redis.call('ZSCAN', zkey, cursor, 'MATCH', ARGV[3] .. '|*', 'COUNT', 1000)
    cursor = page[1]
    if #page[2] > 0 then
      local member = page[2][1]
      redis.call('ZREM', zkey, member)
      release(member, 0)
      return 1
    end
  until cursor == '0'
  return 0

elseif mode == 'sweep' then
  -- ARGV: mode, prefix, owner tag...: the reservations of workers that died (their ids start with
  -- the owner tag). Each frees its concurrency slot and is charged at its estimate (it may have
  -- reached a provider). Removing the member is what makes a late settle of it a no-op.
  local released, charged = 0, 0
  for i = 3, #ARGV do
    local cursor = '0'
    repeat
      local page = redis.call('ZSCAN', zkey, cursor, 'MATCH', ARGV[i] .. '*', 'COUNT', 1000)
      cursor = page[1]
      local found = page[2]  -- member, score, member, score ...
      for j = 1, #found, 2 do
        if redis.call('ZREM', zkey, found[j]) == 1 then
          charged = charged + release(found[j], nil)
          released = released + 1
        end
      end
    until cursor == '0'
  end
  return {released, charged}

elseif mode == 'report' then
  -- ARGV: mode, prefix, window_s... -> now, in_flight, {used, reserved, reset_ms}...
  expire_stale()
  local out = {now, redis.call('ZCOUNT', zkey, '(' .. now, '+inf')}
  for i = 3, #ARGV do
    local wms = tonumber(ARGV[i]) * 1000
    local idx = math.floor(now / wms)
    local v = redis.call('HMGET', window_key(ARGV[i], idx), 'u', 'r')
    out[#out + 1] = tonumber(v[1]) or 0
    out[#out + 1] = tonumber(v[2]) or 0
    out[#out + 1] = (idx + 1) * wms - now
  end
  return out
end
return redis.error_reply('gridgate quota ledger: unknown mode ' .. tostring(mode))
"""
)

LEDGER_SHA = hashlib.sha1(LEDGER_SCRIPT.encode()).hexdigest()

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
