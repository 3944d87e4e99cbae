#!lua name=sfq_admission
--[[ An org's intake limits shared by every process: its token buckets (rpm, tpm) and its
live Idempotency-Keys (docs/shared-state.md). keys[1] is "sfq:{org:<org>}:", so each org
lives in one Redis Cluster slot; args[1] names the operation.

The buckets follow sfq_proxy/core/limits.py's TokenBucket as core/admission.py uses it for
an org: a minute's worth of burst, a request bigger than the bucket waits for a full one
and leaves it in debt, refunds never above full. Time is Redis's own (TIME, ms). A bucket
whose limit changed starts full again, as a reload does in memory; an idle one expires
(it would be full again anyway). An Idempotency-Key lives while its process renews it
(each heartbeat), so a crashed process's keys go with its leases.
]]

local P

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- a bucket's state at `now`, refilled: {key, pm (per minute), cap, level, updated}
local function bucket(name, per_minute, now)
  local key = P .. 'bucket:' .. name
  local saved = redis.call('HMGET', key, 'pm', 'level', 'updated')
  local b = {key = key, pm = per_minute, cap = math.max(1, per_minute)}
  b.level, b.updated = tonumber(saved[2]), tonumber(saved[3])
  if tonumber(saved[1]) ~= per_minute or b.level == nil then b.level, b.updated = b.cap, now end
  if now > b.updated then
    b.level = math.min(b.cap, b.level + (now - b.updated) * per_minute / 60000)
    b.updated = now
  end
  return b
end

local function save(b)
  redis.call('HSET', b.key, 'pm', b.pm, 'level', b.level, 'updated', b.updated)
  redis.call('PEXPIRE', b.key, 120000)  -- full again after a minute idle: kept two
end

-- the org's buckets (args: rpm or '', tpm or '', tokens) with what each takes, and which
-- it is (1: requests, 2: tokens)
local function buckets(args, now)
  local out = {}
  if args[1] ~= '' then out[#out + 1] = {bucket('r', tonumber(args[1]), now), 1, 1} end
  if args[2] ~= '' then out[#out + 1] = {bucket('t', tonumber(args[2]), now), tonumber(args[3]), 2} end
  return out
end

-- ms until every bucket can give its amount (0: now), and which bucket waits the longest
local function wait_ms(taken)
  local wait, which = 0, 0
  for _, pair in ipairs(taken) do
    local b, amount = pair[1], pair[2]
    local w = (math.min(amount, b.cap) - b.level) * 60000 / b.pm
    if w > wait then wait, which = w, pair[3] end
  end
  return wait, which
end

-- `reply`, then what the buckets hold as the x-ratelimit-* headers say it: for requests,
-- then tokens, the whole tokens left and the ms until full again (-1, -1: no such bucket)
local function report(taken, reply)
  local state = {{-1, -1}, {-1, -1}}
  for _, pair in ipairs(taken) do
    local b = pair[1]
    state[pair[3]] = {math.floor(math.max(0, b.level)), math.ceil(math.max(0, b.cap - b.level) * 60000 / b.pm)}
  end
  for _, s in ipairs(state) do
    reply[#reply + 1] = s[1]
    reply[#reply + 1] = s[2]
  end
  return reply
end

local function take(taken, sign)
  for _, pair in ipairs(taken) do
    local b, amount = pair[1], pair[2]
    b.level = sign > 0 and b.level - amount or math.min(b.cap, b.level + amount)
    save(b)
  end
end

local function run(args)
  local op = args[1]
  if op == 'admit' or op == 'retry' then  -- rpm, tpm, tokens[, key digest, ttl_ms]
    local idem = args[5] and args[5] ~= '' and P .. 'idem:' .. args[5] or nil
    if idem and redis.call('EXISTS', idem) == 1 then return {409} end
    local taken = buckets({args[2], args[3], args[4]}, now_ms())
    local wait, which = wait_ms(taken)
    if wait > 0 then return report(taken, {429, math.ceil(wait), which}) end
    take(taken, 1)
    if idem then redis.call('SET', idem, '1', 'PX', args[6]) end
    return report(taken, {1})
  elseif op == 'refund' then  -- rpm, tpm, tokens
    take(buckets({args[2], args[3], args[4]}, now_ms()), -1)
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

-- args[1] 'batch': several operations in one call, as dispatch.lua's run_batch: each its
-- number of arguments, then its name and arguments; the replies, in order
local function sfq_admit(keys, args)
  P = keys[1]
  if args[1] ~= 'batch' then return run(args) end
  local replies, at = {}, 2
  while at <= #args do
    local n = tonumber(args[at])
    replies[#replies + 1] = run({unpack(args, at + 1, at + n)})
    at = at + n + 1
  end
  return replies
end

redis.register_function('sfq_admit', sfq_admit)
