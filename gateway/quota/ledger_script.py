"""The ledger's one server-side Lua script (``gateway.quota.ledger`` builds the calls and reads the replies).

Every decision is one call of it, in one of its modes: ``admit`` (check and take every limit of a
request, all or nothing), ``settle`` (charge a reservation's tokens once, free its in-flight places and
give back the request slots of work that never reached a provider), ``extend`` (move the deadlines of
reservations whose requests still run), ``cancel`` (release an admit whose reply was lost), ``sweep``
(settle a dead worker's reservations) and ``report`` (read a tenant's counters for ``/admin/quota``).

Key layout ``gg:q:v2`` (every key of one tenant shares the hash tag ``{<tenant>}``, so one call touches
one Valkey Cluster slot, whatever limits apply)::

    gg:q:v2:{<tenant>}:z                        ZSET  every open reservation of the tenant -> deadline (ms)
    gg:q:v2:{<tenant>}:<scope>:w:<win_s>:<idx>  HASH  u = tokens charged, r = tokens reserved (a budget)
    gg:q:v2:{<tenant>}:<scope>:g:<win_s>        STRING  a request limit's theoretical arrival time (GCRA)
    gg:q:v2:{<tenant>}:<scope>:f                ZSET  reservation id -> deadline: the scope's requests in
                                                      flight (only scopes with max_in_flight)
    gg:q:v2:{<tenant>}:<scope>:s:<period>:<id>  HASH  a USD budget's calendar period (v7): u = nano-USD
                                                      charged, r = nano-USD reserved, a<t> = threshold
                                                      t (thousandths) reported (the u that crossed it)

``<scope>`` is ``r:<rule>`` (a rule's limits for this tenant) or ``a:<alias>`` / ``k:<kid>`` (a key's own
limits). Names are percent-escaped (``escape_key_part`` below), so they never split a key or a member.

A reservation member is ``<id>|<estimate>|<slots>|<windows>|<flights>|<clocks>``: the window keys it
reserved its estimate in, the in-flight sets it holds a place in, and the request-limit clocks it took
``slots`` from (each with its emission interval). A member of a request with USD budgets (v7) has a
seventh field, ``<worst>,<suffix>=<taken>=<limit>=<thresholds>,...``: the request's worst-case cost in
nano-USD and, per spend window, what it reserved there (the worst case for a hard budget, 0 for a soft
one), the budget and its alert thresholds (``500/800/1000``). So settling, expiring, cancelling or sweeping it
undoes exactly what its admit did, even after a config change; removing the member from the tenant's
set is the idempotency check (settling twice charges once).

Request limits are GCRA on Valkey's clock (``TIME``; a test may pass its own, ``<mode>@<unix µs>`` in
``ARGV[1]``, read nowhere else), in microseconds from 2025-01-01 (doubles stay
exact to well under a microsecond there): a request takes ``slots`` emission intervals
(``window / count``) from the limit's clock and is admitted when the clock stays within ``burst``
intervals of now. Giving slots back moves the clock back, never below now.

Versions. The script carries its version in its text, so a changed script has a new SHA and old and
new gateways run side by side during a rolling upgrade, each with its own. v5 has a new key layout
(``gg:q:v2``): it shares no key with v4's ``gg:q:v1``, so counters start afresh once (docs/limits.md says
what that means during a roll), and v4 gateways keep settling their own reservations in their own keys.
v6 keeps v5's layout (v5 and v6 gateways share counters during a roll): its admit also reads the tenant's
deny set of managed keys (two more arguments) and refuses a blocked or revoked kid in the same call.
v7 keeps the layout too and adds USD budgets: spend windows per calendar period (the gateway computes
the period's id and end and passes them), the worst-case cost as an admit argument, the real cost as a
settle argument, and alert thresholds reported once per period (``HSETNX``) in the settle reply. A v7
member without spend has v6's six fields, so v6 gateways settle and expire it during a roll; v7 reads
v6 members as members without spend.
"""

from __future__ import annotations

from gateway.identity.key_names import deny_set_key, escape_key_part  # noqa: F401 - re-exported: importers use these
from gateway.valkey.transport import Script

SCRIPT_NAME = "gridgate-quota-ledger"
SCRIPT_VERSION = 7
KEY_PREFIX = "gg:q:v2"
# Request-limit clocks count microseconds from this epoch (2025-01-01T00:00:00Z): a double holds them
# to a hundredth of a microsecond for decades.
CLOCK_EPOCH_S = 1735689600

LEDGER_SCRIPT = (
    f"""-- {SCRIPT_NAME} v{SCRIPT_VERSION} (keys {KEY_PREFIX}); modes: admit | settle | extend | cancel | sweep | report
local CLOCK_EPOCH_S = {CLOCK_EPOCH_S}
"""
    + r"""
-- A mode may carry a clock, ``<mode>@<unix microseconds>`` (tests only: ``QuotaLedger(clock=...)``), taken as
-- now instead of TIME so a test moves windows and deadlines on without waiting; the gateway never sends one.
local mode, stamp = string.match(ARGV[1], '^([a-z]+)@?(%d*)$')
local zkey = KEYS[1]      -- every open reservation of one tenant: member -> deadline (ms)
local prefix = ARGV[2]    -- gg:q:v2:{<tenant>}: (same hash tag): every other key is prefix .. suffix
local SLACK_MS = 60000    -- keys outlive their last use by this much so late settles still land
local EXPIRE_BATCH = 128  -- bound the work one call does on stale reservations
local SPEND_GRACE_MS = 3600000  -- a spend window outlives its period's end (+ the timeout) by this much

local t
if stamp ~= nil and stamp ~= '' then
  local us = tonumber(stamp)
  t = {math.floor(us / 1000000), us % 1000000}
else
  t = redis.call('TIME')
end
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = (tonumber(t[1]) - CLOCK_EPOCH_S) * 1000000 + tonumber(t[2])

-- TTL floor: make `key` live at least `ms - SLACK_MS / 2` more. Renewing only when the TTL has run
-- down by half the slack keeps PEXPIRE (an AOF write) off most calls.
local function keep_for(key, ms)
  if redis.call('PTTL', key) < ms - SLACK_MS / 2 then redis.call('PEXPIRE', key, ms) end
end

local function parse(member)
  local id, est, slots, wins, flights, clocks, spend =
    string.match(member, '^([^|]*)|(%d+)|(%d+)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  if id == nil then  -- no spend: six fields (what v5 and v6 write too)
    id, est, slots, wins, flights, clocks = string.match(member, '^([^|]*)|(%d+)|(%d+)|([^|]*)|([^|]*)|([^|]*)$')
    spend = ''
  end
  return id, tonumber(est), tonumber(slots), wins, flights, clocks, spend
end

-- Undo a member's spend part: release what it reserved in each spend window and charge `cost` nano-USD
-- (a decimal string; nil = its worst case). With `crossings` (a table: settle only), each alert
-- threshold the window's spend has reached is marked once per window (HSETNX) and appended as
-- "<window number>:<threshold>:<spent>"; expiry and sweep leave the marking to the next settle.
local function release_spend(spend, cost, crossings)
  local worst, rest = string.match(spend, '^(%d+)(.*)$')
  if worst == nil then return end
  if cost == nil then cost = worst end
  local j = 0
  for suffix, taken, limit, th in string.gmatch(rest, ',([^,=]+)=(%d+)=(%d+)=([%d/]*)') do
    j = j + 1
    local k = prefix .. suffix
    if redis.call('EXISTS', k) == 1 then
      if taken ~= '0' then redis.call('HINCRBY', k, 'r', '-' .. taken) end
      local used = 0
      if cost ~= '0' then used = redis.call('HINCRBY', k, 'u', cost) end
      if crossings and used > 0 then
        for t in string.gmatch(th, '%d+') do
          if used * 1000 >= tonumber(limit) * tonumber(t) and redis.call('HSETNX', k, 'a' .. t, used) == 1 then
            crossings[#crossings + 1] = string.format('%d:%s:%d', j, t, used)
          end
        end
      end
    end
  end
end

-- Give `n` request slots back to every clock the member took from: the clock moves back by n
-- intervals, never below now (slots are not banked beyond a full burst).
local function give_back(clocks, n)
  if n <= 0 then return end
  for suffix, interval in string.gmatch(clocks, '([^,=]+)=([^,]+)') do
    local k = prefix .. suffix
    local tat = tonumber(redis.call('GET', k))
    if tat then
      local back = tat - n * tonumber(interval)
      if back <= now_us then
        redis.call('DEL', k)
      else
        redis.call('SET', k, string.format('%.17g', back), 'KEEPTTL')
      end
    end
  end
end

-- Undo a reservation (already out of the tenant's set): take its estimate out of "reserved" and
-- charge `charge` tokens (nil = its estimate) in every window it reserved in (an expired window is not
-- recreated), free its in-flight places, give back `slots_back` of its request slots; its spend windows
-- as `release_spend` (`cost`, `crossings`).
local function release(member, charge, slots_back, cost, crossings)
  local id, est, slots, wins, flights, clocks, spend = parse(member)
  if est == nil then return 0 end  -- not a member this version wrote: nothing to undo
  if charge == nil then charge = est end
  for suffix in string.gmatch(wins, '[^,]+') do
    local k = prefix .. suffix
    if redis.call('EXISTS', k) == 1 then
      redis.call('HINCRBY', k, 'r', -est)
      if charge ~= 0 then redis.call('HINCRBY', k, 'u', charge) end
    end
  end
  for suffix in string.gmatch(flights, '[^,]+') do redis.call('ZREM', prefix .. suffix, id) end
  if slots_back > 0 then give_back(clocks, math.min(slots_back, slots)) end
  if spend ~= '' then release_spend(spend, cost, crossings) end
  return est
end

-- Lazy expiry: a reservation past its deadline is charged at its estimate; its slots stay taken.
local function expire_stale()
  local stale = redis.call('ZRANGEBYSCORE', zkey, '-inf', now, 'LIMIT', 0, EXPIRE_BATCH)
  for i = 1, #stale do release(stale[i], nil, 0) end
  if #stale > 0 then redis.call('ZREM', zkey, unpack(stale)) end
  return #stale
end

local function fmt(x) return string.format('%.17g', x) end

if mode == 'admit' then
  -- ARGV: mode, prefix, id, estimate, timeout_ms, slots, scopes, deny set, kid, worst, then per scope:
  --   scope, max_in_flight, #requests, {window_s, count, burst, shadow}..., #budgets, {window_s, tokens, shadow}...,
  --   #spend, {period, period id, period end (ms), limit (nano-USD), hard (0|1), thresholds}...
  -- worst: the request's worst-case cost in nano-USD (what a hard spend limit reserves).
  -- deny set: the tenant's blocked and revoked managed keys (gateway.keys.store; same hash tag), '' for
  -- a config key or an anonymous request. A kid in it is refused before anything else, writing nothing
  -- (not even lazy expiry): -> "D now blocked|revoked".
  if ARGV[8] ~= '' then
    local status = redis.call('HGET', ARGV[8], ARGV[9])
    if status then return string.format('D %d %s', now, status == 'revoked' and 'revoked' or 'blocked') end
  end
  -- Limits are numbered 1.. in that order (per scope: requests, budgets, spend, then the in-flight cap).
  -- A spend limit refuses until its period ends (retry_ms), or never when the worst case exceeds it.
  -- -> "<1|0> now expired refused retry_ms rq_limit rq_remaining rq_reset_ms tk_limit tk_remaining
  --     tk_reset_ms shadow [spend_room member]": refused = the limit that refused (0: none), retry_ms -1 =
  --    never fits; rq_* / tk_*: the tightest request limit and token budget (limit 0: none), shadow = the
  --    shadow limits that would have refused ("-": none); admitted only: spend_room = nano-USD left in the
  --    tightest hard spend window after this admit (-1: none), then the member. One bulk string: the
  --    client parses one reply.
  local expired = expire_stale()
  local id, est, timeout_ms, slots = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
  local worst = ARGV[10]
  local worst_n = tonumber(worst)
  local a = 11
  local index = 0
  local refused, retry, never = 0, 0, false
  local rq_lim, rq_rem, rq_reset, tk_lim, tk_rem, tk_reset = 0, 0, 0, 0, 0, 0
  local deny_rq, deny_tk = nil, nil
  local shadow = {}
  local clocks, clock_parts, wins, win_resets, win_parts, flights, flight_parts = {}, {}, {}, {}, {}, {}, {}
  local spends, spend_parts = {}, {}
  local spend_room = -1
  -- a refusal by the limit `i`: the one reported is a limit the request can never fit, else the one
  -- that frees last
  local function refuse(i, wait_ms, never_fits)
    if refused == 0 or (never_fits and not never) or (never_fits == never and wait_ms > retry) then
      refused, retry, never = i, wait_ms, never_fits
      return true
    end
    return false
  end
  for s = 1, tonumber(ARGV[7]) do
    local scope, max_in_flight, nreq = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    a = a + 3
    for j = 1, nreq do
      local win_s, count, burst, is_shadow = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3] == '1'
      a = a + 4
      index = index + 1
      local interval = tonumber(win_s) * 1000000 / count
      local suffix = scope .. ':g:' .. win_s
      local tat = tonumber(redis.call('GET', prefix .. suffix)) or now_us
      if tat < now_us then tat = now_us end
      local new = tat + slots * interval
      local over = new - now_us - burst * interval
      if over > 0.001 then
        local left = math.max(0, math.floor((burst * interval - (tat - now_us)) / interval + 1e-9))
        if is_shadow then
          shadow[#shadow + 1] = index
        elseif refuse(index, math.ceil(over / 1000), false) then
          deny_rq = {count, left, math.ceil((tat - now_us) / 1000)}
        end
      else
        clocks[#clocks + 1] = {prefix .. suffix, new}
        clock_parts[#clock_parts + 1] = suffix .. '=' .. fmt(interval)
        if not is_shadow then
          local left = math.max(0, math.floor((burst * interval - (new - now_us)) / interval + 1e-9))
          if rq_lim == 0 or left < rq_rem then
            rq_lim, rq_rem, rq_reset = count, left, math.ceil((new - now_us) / 1000)
          end
        end
      end
    end
    local ntok = tonumber(ARGV[a])
    a = a + 1
    for j = 1, ntok do
      local win_s, limit, is_shadow = ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2] == '1'
      a = a + 3
      index = index + 1
      local wms = tonumber(win_s) * 1000
      local idx = math.floor(now / wms)
      local suffix = scope .. ':w:' .. win_s .. ':' .. idx
      local v = redis.call('HMGET', prefix .. suffix, 'u', 'r')
      local room = limit - (tonumber(v[1]) or 0) - (tonumber(v[2]) or 0)
      local r = (idx + 1) * wms - now
      if est > room then
        if is_shadow then
          shadow[#shadow + 1] = index
        elseif refuse(index, r, est > limit) then
          deny_tk = {limit, math.max(room, 0), r}
        end
      else
        wins[#wins + 1] = prefix .. suffix
        win_resets[#win_resets + 1] = r
        win_parts[#win_parts + 1] = suffix
        if not is_shadow and (tk_lim == 0 or room - est < tk_rem) then
          tk_lim, tk_rem, tk_reset = limit, room - est, r
        end
      end
    end
    local nspend = tonumber(ARGV[a])
    a = a + 1
    for j = 1, nspend do
      local period, pid, end_ms, limit, hard = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), ARGV[a + 3], ARGV[a + 4] == '1'
      local thresholds = ARGV[a + 5]
      a = a + 6
      index = index + 1
      local suffix = scope .. ':s:' .. period .. ':' .. pid
      local taken = '0'
      local fits = true
      if hard and worst_n > 0 then
        local v = redis.call('HMGET', prefix .. suffix, 'u', 'r')
        local limit_n = tonumber(limit)
        local room = limit_n - (tonumber(v[1]) or 0) - (tonumber(v[2]) or 0)
        if worst_n > room then
          fits = false
          refuse(index, math.max(end_ms - now, 1000), worst_n > limit_n)
        else
          taken = worst
          if spend_room < 0 or room - worst_n < spend_room then spend_room = room - worst_n end
        end
      end
      if fits then
        spends[#spends + 1] = {prefix .. suffix, taken, end_ms}
        spend_parts[#spend_parts + 1] = suffix .. '=' .. taken .. '=' .. limit .. '=' .. thresholds
      end
    end
    if max_in_flight > 0 then
      index = index + 1
      local suffix = scope .. ':f'
      if redis.call('ZCOUNT', prefix .. suffix, '(' .. now, '+inf') >= max_in_flight then
        -- nobody can know when a request in flight ends: one second is an honest retry hint
        refuse(index, 1000, false)
      else
        flights[#flights + 1] = prefix .. suffix
        flight_parts[#flight_parts + 1] = suffix
      end
    end
  end
  local shadow_text = #shadow > 0 and table.concat(shadow, ',') or '-'
  if refused > 0 then
    -- Nothing was written: a refused request changes no counter. The headers show what is left now.
    if deny_rq then rq_lim, rq_rem, rq_reset = deny_rq[1], deny_rq[2], deny_rq[3]
    elseif rq_lim > 0 then rq_rem = rq_rem + slots end
    if deny_tk then tk_lim, tk_rem, tk_reset = deny_tk[1], deny_tk[2], deny_tk[3]
    elseif tk_lim > 0 then tk_rem = tk_rem + est end
    return string.format('0 %d %d %d %d %d %d %d %d %d %d %s', now, expired, refused, never and -1 or retry,
      rq_lim, rq_rem, rq_reset, tk_lim, tk_rem, tk_reset, shadow_text)
  end
  for i = 1, #clocks do
    local tat = clocks[i][2]
    redis.call('SET', clocks[i][1], fmt(tat), 'PX', math.ceil((tat - now_us) / 1000) + SLACK_MS)
  end
  for i = 1, #wins do
    redis.call('HINCRBY', wins[i], 'r', est)
    keep_for(wins[i], win_resets[i] + timeout_ms + SLACK_MS)
  end
  for i = 1, #spends do  -- a soft window is created too (r += 0): settling charges it
    redis.call('HINCRBY', spends[i][1], 'r', spends[i][2])
    keep_for(spends[i][1], spends[i][3] - now + timeout_ms + SPEND_GRACE_MS)
  end
  local deadline = now + timeout_ms
  for i = 1, #flights do
    redis.call('ZADD', flights[i], deadline, id)
    keep_for(flights[i], timeout_ms + SLACK_MS)
  end
  local member = id .. '|' .. est .. '|' .. slots .. '|' .. table.concat(win_parts, ',') .. '|'
    .. table.concat(flight_parts, ',') .. '|' .. table.concat(clock_parts, ',')
  if #spend_parts > 0 then member = member .. '|' .. worst .. ',' .. table.concat(spend_parts, ',') end
  redis.call('ZADD', zkey, deadline, member)
  keep_for(zkey, timeout_ms + SLACK_MS)
  return string.format('1 %d %d 0 0 %d %d %d %d %d %d %s %d ', now, expired, rq_lim, rq_rem, rq_reset,
    tk_lim, tk_rem, tk_reset, shadow_text, spend_room) .. member

elseif mode == 'settle' then
  -- ARGV: mode, prefix, member, actual_tokens, slots_back (request slots of work that never reached a
  -- provider), cost (nano-USD; '' or absent: the worst case) -> the outcome: 0 no-op, 1 charged as
  -- asked, 2 expired (charged at the estimate); with alert thresholds crossed, {outcome, crossing...}
  -- (``release_spend``)
  local deadline = redis.call('ZSCORE', zkey, ARGV[3])
  if not deadline then return 0 end  -- settled before, or expired and charged: a no-op
  redis.call('ZREM', zkey, ARGV[3])
  local crossings = {}
  local outcome = 1
  if tonumber(deadline) <= now then
    release(ARGV[3], nil, 0, nil, crossings)
    outcome = 2
  else
    local cost = ARGV[6]
    if cost == '' then cost = nil end
    release(ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), cost, crossings)
  end
  if #crossings == 0 then return outcome end
  table.insert(crossings, 1, outcome)
  return crossings

elseif mode == 'extend' then
  -- ARGV: mode, prefix, timeout_ms, member... -> how many were extended. The members of requests
  -- still running: each gets a new deadline (now + timeout), in the tenant's set and in its in-flight
  -- sets, so it keeps counting toward max_in_flight and is settled with its usage. Only a live member
  -- moves: one settled (gone) or past its deadline (charged by the next expire_stale) stays as it is.
  local timeout_ms = tonumber(ARGV[3])
  local deadline = now + timeout_ms
  local extended = 0
  for i = 4, #ARGV do
    local score = tonumber(redis.call('ZSCORE', zkey, ARGV[i]))
    if score and score > now and score < deadline then
      redis.call('ZADD', zkey, deadline, ARGV[i])
      local id, est, slots, wins, flights = parse(ARGV[i])
      if flights then
        for suffix in string.gmatch(flights, '[^,]+') do
          redis.call('ZADD', prefix .. suffix, 'XX', deadline, id)
          keep_for(prefix .. suffix, timeout_ms + SLACK_MS)
        end
      end
      extended = extended + 1
    end
  end
  if extended > 0 then keep_for(zkey, timeout_ms + SLACK_MS) end
  return extended

elseif mode == 'cancel' then
  -- ARGV: mode, prefix, id. The admit's reply never reached the gateway (it timed out), so the
  -- request was refused: undo that reservation entirely, its slots included. Rare: a scan is fine.
  local cursor = '0'
  repeat
    local page = redis.call('ZSCAN', zkey, cursor, 'MATCH', ARGV[3] .. '|*', 'COUNT', 1000)
    cursor = page[1]
    if #page[2] > 0 then
      local member = page[2][1]
      redis.call('ZREM', zkey, member)
      local _, _, slots = parse(member)
      release(member, 0, slots or 0, '0')
      return 1
    end
  until cursor == '0'
  return 0

elseif mode == 'sweep' then
  -- ARGV: mode, prefix, owner tag...: the reservations of workers that died (their ids start with
  -- the owner tag). Each frees its in-flight places and is charged at its estimate (it may have
  -- reached a provider); its slots stay taken. Removing the member makes a late settle a no-op.
  local released, charged = 0, 0
  for i = 3, #ARGV do
    local cursor = '0'
    repeat
      local page = redis.call('ZSCAN', zkey, cursor, 'MATCH', ARGV[i] .. '*', 'COUNT', 1000)
      cursor = page[1]
      local found = page[2]  -- member, score, member, score ...
      for j = 1, #found, 2 do
        if redis.call('ZREM', zkey, found[j]) == 1 then
          charged = charged + release(found[j], nil, 0)
          released = released + 1
        end
      end
    until cursor == '0'
  end
  return {released, charged}

elseif mode == 'report' then
  -- ARGV: mode, prefix, scopes, then per scope: scope, capped (0|1), #requests, {window_s, count, burst}...,
  --   #budgets, {window_s}..., #spend, {period, period id, period end (ms)}... -> {now, open reservations,
  --   per scope: in_flight, per request limit: {remaining, full_in_ms}, per budget: {used, reserved,
  --   reset_ms}, per spend limit: {spent, reserved, reset_ms}}
  -- In flight: a capped scope's set; else the tenant's open reservations that name the scope (a scan of
  -- the tenant's set: this page is not on the request path).
  expire_stale()
  local open = redis.call('ZRANGEBYSCORE', zkey, '(' .. now, '+inf')
  local out = {now, #open}
  local a = 4
  for s = 1, tonumber(ARGV[3]) do
    local scope, capped, nreq = ARGV[a], ARGV[a + 1] == '1', tonumber(ARGV[a + 2])
    a = a + 3
    if capped then
      out[#out + 1] = redis.call('ZCOUNT', prefix .. scope .. ':f', '(' .. now, '+inf')
    else
      local n, after_field, after_part = 0, '|' .. scope .. ':', ',' .. scope .. ':'
      for i = 1, #open do
        if string.find(open[i], after_field, 1, true) or string.find(open[i], after_part, 1, true) then n = n + 1 end
      end
      out[#out + 1] = n
    end
    for j = 1, nreq do
      local win_s, count, burst = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
      a = a + 3
      local interval = tonumber(win_s) * 1000000 / count
      local tat = tonumber(redis.call('GET', prefix .. scope .. ':g:' .. win_s)) or now_us
      if tat < now_us then tat = now_us end
      out[#out + 1] = math.max(0, math.floor((burst * interval - (tat - now_us)) / interval + 1e-9))
      out[#out + 1] = math.ceil((tat - now_us) / 1000)
    end
    local ntok = tonumber(ARGV[a])
    a = a + 1
    for j = 1, ntok do
      local wms = tonumber(ARGV[a]) * 1000
      a = a + 1
      local idx = math.floor(now / wms)
      local v = redis.call('HMGET', prefix .. scope .. ':w:' .. ARGV[a - 1] .. ':' .. idx, 'u', 'r')
      out[#out + 1] = tonumber(v[1]) or 0
      out[#out + 1] = tonumber(v[2]) or 0
      out[#out + 1] = (idx + 1) * wms - now
    end
    local nspend = tonumber(ARGV[a])
    a = a + 1
    for j = 1, nspend do
      local v = redis.call('HMGET', prefix .. scope .. ':s:' .. ARGV[a] .. ':' .. ARGV[a + 1], 'u', 'r')
      out[#out + 1] = tonumber(v[1]) or 0
      out[#out + 1] = tonumber(v[2]) or 0
      out[#out + 1] = tonumber(ARGV[a + 2]) - now
      a = a + 3
    end
  end
  return out
end
return redis.error_reply('gridgate quota ledger: unknown mode ' .. tostring(ARGV[1]))
"""
)

LEDGER = Script(LEDGER_SCRIPT)
LEDGER_SHA = LEDGER.sha

