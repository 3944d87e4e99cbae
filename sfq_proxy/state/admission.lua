#!lua name=sfq
--[[ An org's intake limits shared by every process: its token buckets (rpm, tpm) and its
live Idempotency-Keys (docs/shared-state.md). keys[1] is "sfq:{org:<org>}:", so each org
lives in one Redis Cluster slot; args[1] names the operation. The first part of the library
"sfq": dispatch.lua follows it (state/redis_functions.py), and its submit decides an admission here
too (`org_op`) when it carries one.

The buckets follow sfq_proxy/core/limits.py's TokenBucket as core/admission.py uses it for
an org: a minute's worth of burst, a request bigger than the bucket waits for a full one
and leaves it in debt, refunds never above full. Time is Redis's own (TIME, ms). A bucket
whose limit changed starts full again, as a reload does in memory; an idle one expires
(it would be full again anyway). An Idempotency-Key lives while its process renews it
(each heartbeat), so a crashed process's keys go with its leases.
]]

local P  -- the keys of the org being served
-- the buckets a call read, by key ('sfq:{org:<org>}:bucket:r' or ':t'): read at their first
-- need, written back at the call's end if it took or gave (a batch of admits reads and
-- writes each bucket once, not per admit)
local B
-- Redis's clock, read once per call (dispatch.lua's too): a call's operations happen at one time
local NOW

local function now_ms()
  if NOW == nil then
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW
end

-- a bucket's state at `now`, refilled: {key, pm (per minute), cap, level, updated}
local function bucket(name, per_minute, now)
  local key = P .. 'bucket:' .. name
  local b = B[key]
  if b == nil then
    local saved = redis.call('HMGET', key, 'pm', 'level', 'updated')
    b = {key = key, pm = tonumber(saved[1])}
    b.level, b.updated = tonumber(saved[2]), tonumber(saved[3])
    B[key] = b
  end
  b.cap = math.max(1, per_minute)
  if b.pm ~= per_minute or b.level == nil then b.pm, b.level, b.updated = per_minute, b.cap, now end
  if now > b.updated then
    b.level = math.min(b.cap, b.level + (now - b.updated) * per_minute / 60000)
    b.updated = now
  end
  return b
end

local function save(b) b.changed = true end

local function save_buckets()
  for _, b in pairs(B) do
    if b.changed then
      redis.call('HSET', b.key, 'pm', b.pm, 'level', b.level, 'updated', b.updated)
      redis.call('PEXPIRE', b.key, 120000)  -- full again after a minute idle: kept two
    end
  end
end

-- the org's buckets for an operation's args (its name, then rpm or '', tpm or '', tokens):
-- the requests' and the tokens' (nil: no such limit), and the tokens
local function buckets(args)
  local now = now_ms()
  local r = args[2] ~= '' and bucket('r', tonumber(args[2]), now) or nil
  local t = args[3] ~= '' and bucket('t', tonumber(args[3]), now) or nil
  return r, t, tonumber(args[4])
end

-- ms until bucket b (nil: none) can give `amount` (0 or less: now)
local function bucket_wait(b, amount)
  if b == nil then return 0 end
  return (math.min(amount, b.cap) - b.level) * 60000 / b.pm
end

-- `reply`, then what bucket b holds as the x-ratelimit-* headers say it: the whole tokens
-- left and the ms until full again (-1, -1: no such bucket)
local function report(b, reply)
  if b == nil then
    reply[#reply + 1], reply[#reply + 2] = -1, -1
  else
    reply[#reply + 1] = math.floor(math.max(0, b.level))
    reply[#reply + 1] = math.ceil(math.max(0, b.cap - b.level) * 60000 / b.pm)
  end
  return reply
end

-- bucket b (nil: none) takes `amount` (sign 1), or is given it back (-1, never above full)
local function take(b, amount, sign)
  if b == nil then return end
  b.level = sign > 0 and b.level - amount or math.min(b.cap, b.level + amount)
  save(b)
end

local function run(args)
  local op = args[1]
  if op == 'admit' or op == 'retry' then  -- rpm, tpm, tokens[, key digest, ttl_ms]
    local idem = args[5] and args[5] ~= '' and P .. 'idem:' .. args[5] or nil
    if idem and redis.call('EXISTS', idem) == 1 then return {409} end
    local r, t, tokens = buckets(args)
    -- the longest wait, and whose (1: requests, 2: tokens)
    local wait, which = bucket_wait(r, 1), 1
    local t_wait = bucket_wait(t, tokens)
    if t_wait > wait then wait, which = t_wait, 2 end
    if wait > 0 then return report(t, report(r, {429, math.ceil(wait), which})) end
    take(r, 1, 1)
    take(t, tokens, 1)
    if idem then redis.call('SET', idem, '1', 'PX', args[6]) end
    return report(t, report(r, {1}))
  elseif op == 'refund' then  -- rpm, tpm, tokens
    local r, t, tokens = buckets(args)
    take(r, 1, -1)
    take(t, tokens, -1)
    return {1}
  elseif op == 'done' then  -- key digest
    redis.call('DEL', P .. 'idem:' .. args[2])
    return {1}
  elseif op == 'renew' then  -- ttl_ms, key digests...
    for i = 3, #args do redis.call('PEXPIRE', P .. 'idem:' .. args[i], args[2]) end
    return {1}
  end
  return redis.error_reply('unknown operation ' .. tostring(op))
end

-- a call begins: nothing of it read yet
local function org_call() B, NOW = {}, nil end

-- an operation (its arguments, its name first) on the org whose keys start with `prefix`; a
-- call's operations may be on several orgs: sfq_dispatch decides here the admissions that a
-- pool's submits carry (on one Redis, where every org's keys and the pool's are on one server:
-- state/redis_functions.py loads this file and dispatch.lua as one library), and saves at its end
local function org_op(prefix, args)
  P = prefix
  return run(args)
end

-- args[1] 'batch': several operations in one call, as dispatch.lua's run_batch: each its
-- number of arguments, then its name and arguments; the replies, in order
local function sfq_admit(keys, args)
  org_call()
  local reply
  if args[1] ~= 'batch' then
    reply = org_op(keys[1], args)
  else
    local at = 2
    reply = {}
    while at <= #args do
      local n = tonumber(args[at])
      reply[#reply + 1] = org_op(keys[1], {unpack(args, at + 1, at + n)})
      at = at + n + 1
    end
  end
  save_buckets()
  return reply
end

redis.register_function('sfq_admit', sfq_admit)
