"""The managed-key store in Valkey (docs/keys.md): records, their indexes, the change stream.

Key layout (version ``v1``; every key but the deny sets shares the hash tag ``{gg-keys}``, so one
script call touches one Valkey Cluster slot)::

    gg:keys:v1:{gg-keys}:rec:<kid>           STRING  the record (JSON, ``KeyRecord``: digests, never keys)
    gg:keys:v1:{gg-keys}:all                 ZSET    every kid (score 0: lexical order, the list cursor)
    gg:keys:v1:{gg-keys}:tenant:<tenant>     ZSET    the tenant's kids
    gg:keys:v1:{gg-keys}:alias:<alias>       ZSET    the kids with that alias
    gg:keys:v1:{gg-keys}:log                 STREAM  one entry per change: the hosts follow it, and it is the
                                                     audit log (n, kid, action, actor, tenant, changed fields)
    gg:keys:v1:{gg-keys}:seq                 STRING  the number of the last entry (``n``): a follower that
                                                     sees a gap in ``n`` missed entries and reloads
    gg:keys:v1:{gg-keys}:used                HASH    kid -> last use, Unix seconds at minute resolution
    gg:keys:v1:{<tenant>}:deny               HASH    the tenant's blocked and revoked kids -> ``blocked`` or
                                                     ``revoked`` (the admission call's deny set: same hash tag
                                                     as the tenant's counters)

Every change is one compare-and-set script call: the record (its ``version`` must be the one read),
its index entries and its stream entry are written together or not at all. On one node the deny set
is written by the same call; on a Cluster it lives in the tenant's slot, so it is written by its own
call: before the record when a key is blocked or revoked (the admission refuses it from then on),
after it when a key is unblocked. Either way the admin call returns only once both are written.

The stream never holds a digest or a key: a follower reads the record for each kid it names.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec

# The deny sets' key names are the ledger's, so the admit reads exactly the hash this store writes.
from gateway.identity.key_names import deny_set_key
from gateway.identity.keyformat import is_kid, key_digest, new_key, new_kid
from gateway.keys.record import (
    ACTIVE,
    BLOCKED,
    ENDED_SECRET_RETENTION_S,
    MAX_ENDED_SECRETS,
    MAX_PREVIOUS_SECRETS,
    REVOKED,
    CreateKey,
    KeyRecord,
    PreviousSecret,
    decode_record,
    encode_record,
    format_time,
    parse_time,
    public_record,
)

log = logging.getLogger("gridgate.keys")

STORE_TAG = "{gg-keys}"
PREFIX = f"gg:keys:v1:{STORE_TAG}"
RECORD = PREFIX + ":rec:"
ALL = PREFIX + ":all"
BY_TENANT = PREFIX + ":tenant:"
BY_ALIAS = PREFIX + ":alias:"
LOG = PREFIX + ":log"
SEQ = PREFIX + ":seq"
USED = PREFIX + ":used"
LOG_MAX_ENTRIES = 100_000  # approximate (MAXLEN ~): the audit log's depth, and how far a host may lag
_CAS_ATTEMPTS = 5
_STREAM_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


# KEYS: 1 record, 2 log, 3 seq, 4.. the keys the ops name. ARGV: 1 expected version (0: must not exist),
# 2 record JSON, 3 log MAXLEN, 4 op count, then (op, key index, member, value) quads, then the log
# entry's field/value pairs. Returns {1, entry id} or {0, the version found}.
MUTATE_SCRIPT = """-- gridgate-keys v1: compare-and-set one record, its index entries and its log entry
local current = redis.call('GET', KEYS[1])
local found = 0
if current then found = tonumber(cjson.decode(current)['version']) end
if found ~= tonumber(ARGV[1]) then return {0, found} end
redis.call('SET', KEYS[1], ARGV[2])
local ops = tonumber(ARGV[4])
local i = 5
for _ = 1, ops do
  local op, key, member = ARGV[i], KEYS[tonumber(ARGV[i + 1])], ARGV[i + 2]
  if op == 'zadd' then redis.call('ZADD', key, 0, member)
  elseif op == 'zrem' then redis.call('ZREM', key, member)
  elseif op == 'hset' then redis.call('HSET', key, member, ARGV[i + 3])
  elseif op == 'hdel' then redis.call('HDEL', key, member) end
  i = i + 4
end
local fields = {'n', redis.call('INCR', KEYS[3])}
for j = i, #ARGV do fields[#fields + 1] = ARGV[j] end
return {1, redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))}
"""

# KEYS: 1 log, 2 seq. ARGV: 1 log MAXLEN, then the entry's field/value pairs. An entry that names no
# key (a console sign-in, sign-out or session expiry): numbered like a change, so followers see no gap.
NOTE_SCRIPT = """-- gridgate-keys v1: an audit entry that changes no record
local fields = {'n', redis.call('INCR', KEYS[2])}
for j = 2, #ARGV do fields[#fields + 1] = ARGV[j] end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(fields))
"""

# KEYS: 1 log, 2 seq. The newest entry's id and the sequence number, read together.
HEAD_SCRIPT = """-- gridgate-keys v1: where the log ends
return {redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1), redis.call('GET', KEYS[2])}
"""

# KEYS: 1 the used hash. ARGV: kid, seconds pairs; a later use wins (hosts flush independently).
USED_SCRIPT = """-- gridgate-keys v1: last use, the latest wins
for i = 1, #ARGV, 2 do
  local seen = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > seen then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 1
"""


Op = tuple[str, str, str, str]  # (zadd | zrem | hset | hdel, key, member, value) for the mutate script


class KeyNotFound(Exception):
    """No key with this kid (404)."""


class KeyConflict(Exception):
    """The change cannot be made to the key as it is (409); the message says why."""


class LogEntry(msgspec.Struct, frozen=True):
    """One change as the stream holds it."""

    id: str
    n: int  # the store's sequence number of the change: consecutive, so a gap shows a missed entry
    kid: str
    action: str
    actor: str
    tenant: str
    changed: dict[str, Any]


class KeyStore:
    """The store's operations over one Valkey client (``gateway.valkey.client.create_client``).

    ``cluster``: the client talks to a Valkey Cluster, so the deny set is written by its own call.
    Errors of the backend propagate (``gateway.valkey.client.BACKEND_ERRORS``): the admin API answers
    them with 503, the follower retries.
    """

    def __init__(self, client: Any, *, cluster: bool = False, log_max_entries: int = LOG_MAX_ENTRIES) -> None:
        self._client = client
        self._cluster = cluster
        self._log_max = log_max_entries

    async def close(self) -> None:
        await self._client.aclose()

    # ------------------------------------------------------------------ reads

    async def get(self, kid: str) -> KeyRecord | None:
        if not is_kid(kid):
            return None
        data = await self._client.execute_command("GET", RECORD + kid)
        return None if data is None else decode_record(data)

    async def records(self, kids: Sequence[str]) -> list[KeyRecord | None]:
        """The records of ``kids``, in order (None where there is none): MGETs of 500."""
        found: list[KeyRecord | None] = []
        for start in range(0, len(kids), 500):
            batch = kids[start : start + 500]
            replies = await self._client.execute_command("MGET", *(RECORD + kid for kid in batch))
            found.extend(_readable(kid, data) for kid, data in zip(batch, replies, strict=True))
        return found

    async def all_kids(self) -> list[str]:
        kids: list[str] = []
        cursor = "-"
        while True:
            batch = await self._client.execute_command("ZRANGE", ALL, cursor, "+", "BYLEX", "LIMIT", 0, 5000)
            kids.extend(kid.decode() for kid in batch)
            if len(batch) < 5000:
                return kids
            cursor = "(" + kids[-1]

    async def page(self, *, tenant: str | None, alias: str | None, status: str | None, cursor: str | None,
                   limit: int) -> tuple[list[KeyRecord], str | None]:
        """Up to ``limit`` records after ``cursor`` (a kid) in kid order, filtered; and the cursor of
        the next page (None at the end). Scans at most ``10 * limit`` kids per call, so a sparse
        filter answers a short page with a cursor rather than a slow one."""
        index = BY_ALIAS + alias if alias is not None else BY_TENANT + tenant if tenant is not None else ALL
        start = "-" if cursor is None else "(" + cursor
        found: list[KeyRecord] = []
        budget = 10 * limit
        while budget > 0:
            want = min(500, budget)
            kids = [kid.decode() for kid in
                    await self._client.execute_command("ZRANGE", index, start, "+", "BYLEX", "LIMIT", 0, want)]
            budget -= len(kids)
            for kid, record in zip(kids, await self.records(kids), strict=True):
                if record is None or (tenant is not None and record.tenant != tenant):
                    continue
                if status is not None and record.status != status:
                    continue
                found.append(record)
                if len(found) == limit:
                    return found, kid
            if len(kids) < want:
                return found, None
            start = "(" + kids[-1]
        return found, start[1:]

    async def last_used(self, kids: Sequence[str]) -> list[int | None]:
        if not kids:
            return []
        replies = await self._client.execute_command("HMGET", USED, *kids)
        return [None if value is None else int(value) for value in replies]

    async def public(self, record: KeyRecord, now: float) -> dict[str, Any]:
        (used,) = await self.last_used([record.kid])
        return public_record(record, used, now)

    # ------------------------------------------------------------------ changes

    async def create(self, body: CreateKey, actor: str, now: float) -> tuple[str, KeyRecord]:
        """A new key for ``body``: (the key, shown this once; its record)."""
        seconds = int(now)
        expires_at = None if body.expires_at is None else parse_time(body.expires_at, "expires_at")
        for _ in range(_CAS_ATTEMPTS):
            kid = new_kid()
            key = new_key(kid)
            record = KeyRecord(kid=kid, tenant=body.tenant, status=ACTIVE, digest=key_digest(key).hex(),
                               created_at=seconds, created_by=actor, updated_at=seconds, version=1,
                               alias=body.alias, models=body.models, limits=body.limits, expires_at=expires_at,
                               allowed_origins=body.allowed_origins, metadata=body.metadata)
            ops: list[Op] = [("zadd", ALL, kid, ""), ("zadd", BY_TENANT + record.tenant, kid, "")]
            if record.alias is not None:
                ops.append(("zadd", BY_ALIAS + record.alias, kid, ""))
            changed = {name: value for name, value in _public_fields(record).items() if value not in (None, {}, [])}
            if await self._mutate(None, record, ops, "create", actor, changed):
                return key, record
        raise KeyConflict("could not allocate a new kid; try again")  # 62**12 kids: never in practice

    async def patch(self, kid: str, changes: dict[str, Any], actor: str, now: float) -> KeyRecord:
        async def change(record: KeyRecord) -> tuple[KeyRecord, list[Op], dict[str, Any]]:
            if record.status == REVOKED:
                raise KeyConflict(f"key {kid} is revoked; a revoked key cannot change")
            updated = msgspec.structs.replace(record, **changes)
            ops: list[Op] = []
            if updated.alias != record.alias:
                if record.alias is not None:
                    ops.append(("zrem", BY_ALIAS + record.alias, kid, ""))
                if updated.alias is not None:
                    ops.append(("zadd", BY_ALIAS + updated.alias, kid, ""))
            before, after = _public_fields(record), _public_fields(updated)
            return updated, ops, {name: after[name] for name in changes if after[name] != before[name]}

        record, _ = await self._change(kid, "update", actor, now, change)
        return record

    async def set_status(self, kid: str, action: str, actor: str, now: float) -> KeyRecord:
        """``block``, ``unblock`` or ``revoke`` (final). Repeating one is a no-op that still repairs the
        deny set, so an admin call retried after a 503 always leaves both in agreement."""
        target = {"block": BLOCKED, "unblock": ACTIVE, "revoke": REVOKED}[action]
        deny = "hdel" if action == "unblock" else "hset"

        async def change(record: KeyRecord) -> tuple[KeyRecord, list[Op], dict[str, Any]]:
            if record.status == REVOKED and action != "revoke":
                raise KeyConflict(f"key {kid} is revoked; revoking is final")
            return (msgspec.structs.replace(record, status=target),
                    [(deny, deny_set_key(record.tenant), kid, target)], {"status": target})

        record = await self.get(kid)
        if record is None:
            raise KeyNotFound(kid)
        if record.status == REVOKED and action != "revoke":
            raise KeyConflict(f"key {kid} is revoked; revoking is final")
        if record.status == target:
            await self._deny(deny, record.tenant, kid, target)
            return record
        if self._cluster and deny == "hset":
            await self._deny(deny, record.tenant, kid, target)  # before the record: refused at admission now
        record, _ = await self._change(kid, action, actor, now, change)
        if self._cluster and deny == "hdel":
            await self._deny(deny, record.tenant, kid, target)
        return record

    async def rotate(self, kid: str, grace_s: int, actor: str, now: float) -> tuple[str, KeyRecord]:
        """A new secret for ``kid`` (same kid, limits and counters); the current one keeps working for
        ``grace_s`` seconds (0: it stops now). Returns the new key, shown this once."""
        holder: dict[str, str] = {}

        async def change(record: KeyRecord) -> tuple[KeyRecord, list[Op], dict[str, Any]]:
            if record.status == REVOKED:
                raise KeyConflict(f"key {kid} is revoked; a revoked key cannot be rotated")
            live = [p for p in record.previous if p.until > now]
            if grace_s > 0 and len(live) >= MAX_PREVIOUS_SECRETS:
                raise KeyConflict(f"key {kid} already has {MAX_PREVIOUS_SECRETS} previous secrets in their grace "
                                  "period; wait for one to end, or rotate with grace 0s")
            # Ended secrets stay named for a day (at most MAX_ENDED_SECRETS), so every host drops them;
            # one that rotates with no grace ends now.
            ended = [p for p in record.previous if now - ENDED_SECRET_RETENTION_S < p.until <= now]
            # Whole seconds rounded up: the previous secret works for at least the grace asked for.
            retired = PreviousSecret(record.digest, (math.ceil(now) + grace_s) if grace_s > 0 else int(now))
            (live if grace_s > 0 else ended).append(retired)
            previous = ended[-MAX_ENDED_SECRETS:] + live
            key = holder["key"] = new_key(kid)
            updated = msgspec.structs.replace(record, digest=key_digest(key).hex(), previous=previous)
            until = None if grace_s <= 0 else format_time(retired.until)
            return updated, [], {"secret": "rotated", "previous_secret_valid_until": until}

        record, _ = await self._change(kid, "rotate", actor, now, change)
        return holder["key"], record

    async def note(self, action: str, actor: str, changed: dict[str, Any]) -> str:
        """An audit entry that names no key (kid and tenant empty), such as a console sign-in; its id."""
        reply = await self._client.execute_command(
            "EVAL", NOTE_SCRIPT, 2, LOG, SEQ, self._log_max, "kid", "", "action", action, "actor", actor,
            "tenant", "", "changed", json.dumps(changed, separators=(",", ":"), sort_keys=True))
        return _text(reply)

    async def mark_used(self, seconds_by_kid: dict[str, int]) -> None:
        if seconds_by_kid:
            args = [part for kid, seconds in seconds_by_kid.items() for part in (kid, seconds)]
            await self._client.execute_command("EVAL", USED_SCRIPT, 1, USED, *args)

    # ------------------------------------------------------------------ the log

    async def log_bounds(self) -> tuple[str | None, str | None]:
        """(oldest, newest) entry id of the log; (None, None) when it is empty or missing."""
        oldest = await self._client.execute_command("XRANGE", LOG, "-", "+", "COUNT", 1)
        newest = await self._client.execute_command("XREVRANGE", LOG, "+", "-", "COUNT", 1)
        return (_entries(oldest)[0].id if oldest else None, _entries(newest)[0].id if newest else None)

    async def log_head(self) -> tuple[str, int]:
        """(the newest entry's id, or 0-0; the last sequence number, or 0), read atomically."""
        newest, seq = await self._client.execute_command("EVAL", HEAD_SCRIPT, 2, LOG, SEQ)
        return (_entries(newest)[0].id if newest else "0-0"), int(seq or 0)

    async def read_log(self, after: str, *, count: int = 512, block_ms: int | None = None) -> list[LogEntry]:
        """Entries after ``after``, oldest first; with ``block_ms``, wait that long for the first one."""
        args: list[Any] = ["XREAD", "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        reply = await self._client.execute_command(*args, "STREAMS", LOG, after)
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3 / valkey-py's parsed form: {stream: [entries]}
            (entries,) = reply.values()
        else:
            entries = reply[0][1]
        return _entries(entries)

    async def audit(self, since: str | None, limit: int) -> tuple[list[LogEntry], str | None]:
        """Entries after ``since`` (an entry id; None: from the oldest kept), and the oldest kept id."""
        start = "-" if since is None else "(" + since
        entries = _entries(await self._client.execute_command("XRANGE", LOG, start, "+", "COUNT", limit))
        oldest, _ = await self.log_bounds()
        return entries, oldest

    # ------------------------------------------------------------------ internals

    async def _change(self, kid: str, action: str, actor: str, now: float, change: Any) -> tuple[KeyRecord, bool]:
        for _ in range(_CAS_ATTEMPTS):
            record = await self.get(kid)
            if record is None:
                raise KeyNotFound(kid)
            updated, ops, changed = await change(record)
            updated = msgspec.structs.replace(updated, version=record.version + 1, updated_at=int(now))
            if self._cluster:
                ops = [op for op in ops if op[0] not in ("hset", "hdel")]
            if await self._mutate(record, updated, ops, action, actor, changed):
                return updated, True
        raise KeyConflict(f"key {kid} is being changed by another admin call; try again")

    async def _mutate(self, old: KeyRecord | None, new: KeyRecord, ops: list[Op],
                      action: str, actor: str, changed: dict[str, Any]) -> bool:
        keys = [RECORD + new.kid, LOG, SEQ]
        args: list[Any] = [0 if old is None else old.version, encode_record(new), self._log_max, len(ops)]
        for op, key, member, value in ops:
            if key not in keys:
                keys.append(key)
            args += [op, keys.index(key) + 1, member, value]
        args += ["kid", new.kid, "action", action, "actor", actor, "tenant", new.tenant,
                 "changed", json.dumps(changed, separators=(",", ":"), sort_keys=True)]
        reply = await self._client.execute_command("EVAL", MUTATE_SCRIPT, len(keys), *keys, *args)
        return int(reply[0]) == 1

    async def _deny(self, op: str, tenant: str, kid: str, status: str) -> None:
        if op == "hset":
            await self._client.execute_command("HSET", deny_set_key(tenant), kid, status)
        else:
            await self._client.execute_command("HDEL", deny_set_key(tenant), kid)


def _readable(kid: str, data: bytes | None) -> KeyRecord | None:
    """The record, or None when there is none or it cannot be read (logged: one bad record must not
    stop a host from loading the others)."""
    if data is None:
        return None
    try:
        return decode_record(data)
    except msgspec.DecodeError as exc:
        log.error("keys: the record of key %s cannot be read (%s); skipped", kid, exc)
        return None


def _public_fields(record: KeyRecord) -> dict[str, Any]:
    """The record's fields an admin sets, as the audit log shows them."""
    shown = public_record(record, None, 0)
    return {name: shown[name] for name in
            ("alias", "models", "limits", "expires_at", "allowed_origins", "metadata", "status", "tenant")}


def is_stream_id(text: str) -> bool:
    return _STREAM_ID.fullmatch(text) is not None


def _entries(reply: Any) -> list[LogEntry]:
    """Stream entries from an XRANGE/XREAD reply: raw RESP lists or valkey-py's (id, {field: value})."""
    found = []
    for entry_id, fields in reply:
        if not isinstance(fields, dict):
            fields = dict(zip(fields[::2], fields[1::2], strict=True))
        text = {_text(k): _text(v) for k, v in fields.items()}
        found.append(LogEntry(_text(entry_id), int(text.get("n") or 0), text.get("kid", ""), text.get("action", ""), text.get("actor", ""),
                              text.get("tenant", ""), json.loads(text.get("changed") or "{}")))
    return found


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def audit_entry(entry: LogEntry) -> dict[str, Any]:
    """An entry as ``GET /admin/audit`` shows it: its time is the entry id's (the store's clock)."""
    millis = int(entry.id.split("-", 1)[0])
    return {"id": entry.id, "time": format_time(millis // 1000), "kid": entry.kid, "tenant": entry.tenant,
            "action": entry.action, "actor": entry.actor, "changed": entry.changed}
