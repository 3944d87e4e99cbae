--[[ The second part of the library "sfq", after admission.lua (state/redis_functions.py loads them as
one: a submit may carry its org's admission, decided with `org_op`; Redis's clock is
admission.lua's `now_ms` too).

One pool's dispatch decisions in Redis: the strict band, Start-time Fair Queueing and
placement with slot leases, each call one atomic step (docs/shared-state.md).

The same rules as sfq_proxy/core/fair_queue.py and scheduler.py, line for line where they
decide: join at max(S, v), charge at dispatch, ties by flow id (a sorted set orders equal
scores by member, bytewise: flow ids are ASCII), global-idle reset; the band FIFO before
every flow, a class under its cap; the least loaded healthy backend with a free slot, the
first listed on ties, or with affinity the first of the ticket's key's rendezvous order within
the bounded load (Placement.place). Meters are integers in units of 1/2^20 of a cost, exact in
Lua's doubles below 2^53: the config keeps one charge below 2^51 (c_max / smallest weight)
and meters are shifted down once v reaches 2^51.

A function library (FUNCTION LOAD), not a script: its functions are made once, at load,
where a script makes them again at every call (~15 µs). `sfq_dispatch` is the one entry:
every key of a pool starts with keys[1] ("sfq:{pool}:"), so one pool lives in one Redis
Cluster slot; args[1] names the operation, args[2] is the calling replica (its holder id).
Times are Redis's own (TIME), in milliseconds: one clock for every replica's leases.

A provider pool's pacing is shared the same way: its rate's token buckets (core/limits.py)
and its provider's feedback (core/throttle.py: the pause and the rate factor that any
holder's 429s set) hold every replica's dispatch, as they hold one process's in memory.
]]

-- the call being served: set by sfq_dispatch, as Redis runs one call at a time
local P, holder, A

local UNITS = 1048576
local RENORMALIZE_AT = 2 ^ 51

local function num(value, default)
  if value == false or value == nil then return default end
  return tonumber(value)
end

-- a hash of numbers read whole, and written back whole (a field set to nil goes)
local function read_numbers(key)
  local t = {}
  local raw = redis.call('HGETALL', key)
  for i = 1, #raw, 2 do t[raw[i]] = tonumber(raw[i + 1]) end
  return t
end
local function write_numbers(key, t)
  local flat = {}
  for field, value in pairs(t) do
    flat[#flat + 1] = field
    flat[#flat + 1] = value
  end
  redis.call('DEL', key)
  if #flat > 0 then redis.call('HSET', key, unpack(flat)) end
end

-- the pool's scalars (v, maxm, offset, queued, run, fence, born, reaped, paced, alf, als), read
-- once per call and written back once at its end: most of a call's work would otherwise be these
-- reads and writes. Only the fields the call changed are written (one HSET, and one HDEL for
-- those set to nil), not the whole hash again
local M, meta_changed = {}, {}
local function load_meta()
  M, meta_changed = read_numbers(P .. 'meta'), {}
end
local function meta(field) return M[field] or 0 end
local function set_meta(field, value)
  M[field], meta_changed[field] = value, true
end
local function save_meta()
  local set, gone = {}, {}
  for field in pairs(meta_changed) do
    if M[field] == nil then
      gone[#gone + 1] = field
    else
      set[#set + 1] = field
      set[#set + 1] = M[field]
    end
  end
  if #set > 0 then redis.call('HSET', P .. 'meta', unpack(set)) end
  if #gone > 0 then redis.call('HDEL', P .. 'meta', unpack(gone)) end
end

--[[ What a call learnt of the pool, kept for the rest of that call only (Redis runs one call at
a time, so nothing changes it meanwhile but the call itself): each flow's meter (false:
none), weight, and whether its size buckets are known absent (nob), each class's and org's
cap (false: none), the decoded tickets, the band's ids, whether the caller is a live holder
(alive), and whether the fair queue is known empty (clear: its keys deleted in this call, no
meter written since). Every write of one of these goes through here too, so that a later read
in the same call sees it; a call reads each at most once instead of at every step that needs
it. ]]
local C
local function new_cache()
  C = {meter = {}, weight = {}, nob = {}, ocap = {}, ccap = {}, ticket = {}, band = nil,
       alive = nil, clear = false}
end

--[[ The pool's running counts: per backend (inflight), org (orun) and class (crun). Each
count is read at a call's first need of it, and the call's changes are written back at its end
as one HINCRBY of the net change per count: a batch's grants and releases mostly cancel out,
and then nothing is written. ]]
local N
local function counts(hash)
  local c = N[hash]
  if c == nil then
    c = {value = {}, delta = {}}
    N[hash] = c
  end
  return c
end
local function count(hash, field)
  local c = counts(hash)
  local v = c.value[field]
  if v == nil then
    v = num(redis.call('HGET', P .. hash, field), 0) + (c.delta[field] or 0)
    c.value[field] = v
  end
  return v
end
local function add_count(hash, field, delta)
  local c = counts(hash)
  c.delta[field] = (c.delta[field] or 0) + delta
  if c.value[field] ~= nil or c.whole then c.value[field] = (c.value[field] or 0) + delta end
end
local function save_counts()
  for hash, c in pairs(N) do
    for field, delta in pairs(c.delta) do
      if delta ~= 0 then redis.call('HINCRBY', P .. hash, field, delta) end
    end
  end
end

--[[ The sets of flows held at a cap: inel (the flows not eligible), co:<org> and cc:<class>
(the flows of a capped org or class with a line or held). Each is small (an org's classes, a
class's orgs), read whole at a call's first need, and written back at its end as its net change:
a grant adds its flow to its caps' sets and the refresh that follows takes it out again. ]]
local S, S_was  -- S[name][flow]: true; S_was[name][flow]: its membership before its first change
local function flow_set(name)
  local s = S[name]
  if s == nil then
    s = {}
    for _, flow in ipairs(redis.call('SMEMBERS', P .. name)) do s[flow] = true end
    S[name] = s
  end
  return s
end
local function in_set(name, flow) return flow_set(name)[flow] == true end
-- whether that changed the set
local function set_member(name, flow, member)
  local s = flow_set(name)
  local was = s[flow] == true
  if was == member then return false end
  local changed = S_was[name]
  if changed == nil then
    changed = {}
    S_was[name] = changed
  end
  if changed[flow] == nil then changed[flow] = was end
  s[flow] = member or nil
  return true
end
local function save_sets()
  for name, changed in pairs(S_was) do
    for flow, was in pairs(changed) do
      local now = S[name][flow] == true
      if now ~= was then redis.call(now and 'SADD' or 'SREM', P .. name, flow) end
    end
  end
end

-- Python's round(): to the nearest integer, halves to the even one
local function round_half_even(x)
  local f = math.floor(x)
  local d = x - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then return f + 1 end
  return f
end

-- -- the fair queue ------------------------------------------------------------------------

-- (no line holds a ticket when none is queued)
local function backlog(flow)
  if meta('queued') == 0 then return 0 end
  return redis.call('LLEN', P .. 'q:' .. flow)
end

local function meter_of(flow)
  local m = C.meter[flow]
  if m == nil then
    m = not C.clear and num(redis.call('HGET', P .. 'meter', flow), false)
    C.meter[flow] = m
  end
  return m or nil
end
local function set_meter(flow, m)
  redis.call('HSET', P .. 'meter', flow, m)
  C.meter[flow], C.clear = m, false
end
local function weight_of(flow)
  local w = C.weight[flow]
  if w == nil then
    w = tonumber(redis.call('HGET', P .. 'weight', flow))
    C.weight[flow] = w
  end
  return w
end

-- the fair queue's keys deleted (its lines are empty, nothing of it runs): once, while no
-- meter is written since (a batch whose calls each end a busy period: the first does the work)
local function clear_fair_queue()
  if C.clear then return end
  redis.call('DEL', P .. 'meter', P .. 'weight', P .. 'ready', P .. 'ovt')
  C.meter, C.weight, C.clear = {}, {}, true
end

local function enter(flow, meter) redis.call('ZADD', P .. 'ready', meter, flow) end

-- the busy period ends when nothing waits and nothing of the fair queue runs (meta run: its
-- tickets granted and not yet finished, over every holder). No lease at all means nothing
-- runs whatever run says: a finish by an older version of this library (a rolling update)
-- does not count its lease down, and the count heals here
local function after_drain()
  if meta('queued') > 0 then return end
  if meta('run') > 0 then
    if redis.call('HLEN', P .. 'lease') > 0 then return end
    set_meta('run', 0)
  end
  local v = math.max(meta('v'), meta('maxm'))
  set_meta('v', v)
  set_meta('maxm', v)
  clear_fair_queue()
end

--[[ Size buckets inside a flow (docs/design.md §3; fair_queue.py _mark, _pick, _unmark). A flow
with size buckets has the hash ob:<flow> from its first ticket with buckets (`k` in the
ticket) until its line is empty: k, its max_overtaken (of its latest such ticket), and per
bucket how many of its tickets wait. A ticket's bucket is its `b` (none: UNSIZED, after every
bucket); ovt holds how often each queued ticket of such a flow was overtaken (none: 0). A
flow without ob is a FIFO, as before: one HGETALL more per dispatch, nothing else. ]]
local UNSIZED = 2 ^ 30  -- fair_queue.UNSIZED
local DUE = 2 ^ 30  -- fair_queue.DUE: a ticket put back at its flow's head goes next in it

-- which queued ticket of `flow` goes next (_pick): its oldest, `first`, unless the flow has
-- size buckets, that oldest was overtaken fewer than k times, and a smaller bucket waits:
-- then the oldest ticket of the smallest bucket. Returns it, whether the flow has size
-- buckets, and the older tickets it overtakes, oldest first. Changes nothing.
local function pick(flow, first)
  if C.nob[flow] then return first, false, {} end
  local raw = redis.call('HGETALL', P .. 'ob:' .. flow)
  if #raw == 0 then return first, false, {} end
  local k, smallest = 0, nil
  for i = 1, #raw, 2 do
    if raw[i] == 'k' then
      k = tonumber(raw[i + 1])
    elseif smallest == nil or tonumber(raw[i]) < smallest then
      smallest = tonumber(raw[i])
    end
  end
  if smallest == nil or num(redis.call('HGET', P .. 'ovt', first), 0) >= k then
    return first, true, {}
  end
  local q, passed, at = P .. 'q:' .. flow, {}, 0
  while true do  -- what it passes is what it overtakes: at most k times each, amortised
    local ids = redis.call('LRANGE', q, at, at + 15)
    if #ids == 0 then error('size buckets of ' .. flow .. ' out of step with its line') end
    local raw_tickets = redis.call('HMGET', P .. 'ticket', unpack(ids))
    for i, id in ipairs(ids) do
      local b = raw_tickets[i] and cjson.decode(raw_tickets[i]).b or UNSIZED
      if b == smallest then return id, true, passed end
      passed[#passed + 1] = id
    end
    at = at + 16
  end
end

-- ticket `id` (of bucket b, nil: UNSIZED) left the line of a flow with size buckets
local function unsize(flow, id, b)
  redis.call('HDEL', P .. 'ovt', id)
  if b == nil then return end
  local ob = P .. 'ob:' .. flow
  if redis.call('HINCRBY', ob, b, -1) <= 0 then redis.call('HDEL', ob, b) end
end

local function renormalize()
  local shift = meta('v')
  set_meta('offset', meta('offset') + shift)
  set_meta('v', 0)
  set_meta('maxm', meta('maxm') - shift)
  local meters = redis.call('HGETALL', P .. 'meter')
  for i = 1, #meters, 2 do
    local m = tonumber(meters[i + 1]) - shift
    set_meter(meters[i], m)
    if redis.call('ZSCORE', P .. 'ready', meters[i]) then enter(meters[i], m) end
  end
end

local function push(flow, id, weight, front, k, b)
  local v = meta('v')
  local meter = meter_of(flow) or v
  -- the line's new length says whether it was empty: then the flow joins at v at least, and
  -- has no size buckets unless this ticket brings them (ob goes when its line empties)
  local was_empty = redis.call(front and 'LPUSH' or 'RPUSH', P .. 'q:' .. flow, id) == 1
  if was_empty then meter = math.max(meter, v) end
  set_meter(flow, meter)
  redis.call('HSET', P .. 'weight', flow, weight)
  C.weight[flow] = weight
  C.nob[flow] = was_empty and k == nil
  local ob = P .. 'ob:' .. flow  -- size buckets (_mark): k, b of a ticket that has them
  if k ~= nil then
    redis.call('HSET', ob, 'k', k)
    redis.call('HINCRBY', ob, b, 1)
    if front then redis.call('HSET', P .. 'ovt', id, DUE) end
  elseif front and redis.call('EXISTS', ob) == 1 then
    redis.call('HSET', P .. 'ovt', id, DUE)
  end
  set_meta('queued', meta('queued') + 1)
  if not in_set('inel', flow) then enter(flow, meter) end
end

-- the flow with the smallest meter, and what pick() says of its line
local function head()
  if meta('queued') == 0 then return nil end  -- no line holds a ticket: ready is empty
  local top = redis.call('ZRANGE', P .. 'ready', 0, 0)
  if #top == 0 then return nil end
  return top[1], pick(top[1], redis.call('LINDEX', P .. 'q:' .. top[1], 0))
end

-- dispatch ticket `id` of `flow` (bucket b), as head() chose it: charged its own cost
local function pop(flow, cost, id, b, sized, passed)
  local meter = meter_of(flow)
  local weight = weight_of(flow)
  local charge = math.max(1, round_half_even(cost * UNITS / weight))
  set_meta('v', math.max(meta('v'), meter))  -- a refunded flow may start below v
  if #passed == 0 then
    redis.call('LPOP', P .. 'q:' .. flow)
  else
    for _, older in ipairs(passed) do redis.call('HINCRBY', P .. 'ovt', older, 1) end
    redis.call('LREM', P .. 'q:' .. flow, 1, id)
  end
  if sized then unsize(flow, id, b) end
  meter = meter + charge
  set_meter(flow, meter)
  set_meta('maxm', math.max(meta('maxm'), meter))
  set_meta('queued', meta('queued') - 1)
  set_meta('run', meta('run') + 1)  -- it runs: the busy period goes on until its finish
  if backlog(flow) > 0 then
    enter(flow, meter)
  else
    redis.call('ZREM', P .. 'ready', flow)
    if sized then redis.call('DEL', P .. 'ob:' .. flow) end
  end
  if meta('v') >= RENORMALIZE_AT then renormalize() end
end

-- a fair-queued request of `flow`, dispatched at `cost`, ended having cost `actual` (nil:
-- unknown, the estimate stands): its flow's charge trued up as FairQueue.settle does it, at
-- the flow's weight now, a debt and a refund alike (a refunded waiting flow may sit below v
-- and catch up; an idle one is lifted to v as it rejoins, push)
local function settle(flow, cost, actual)
  set_meta('run', meta('run') - 1)
  local meter, weight = meter_of(flow), weight_of(flow)
  if actual ~= nil and meter ~= nil and weight ~= nil then
    local owed = round_half_even(actual * UNITS / weight)
      - math.max(1, round_half_even(cost * UNITS / weight))
    local m = meter + owed
    if m ~= meter then
      set_meter(flow, m)
      set_meta('maxm', math.max(meta('maxm'), m))
      if redis.call('ZSCORE', P .. 'ready', flow) then enter(flow, m) end
    end
  end
  after_drain()
end

local function remove(flow, id, b)
  if redis.call('LREM', P .. 'q:' .. flow, 1, id) == 0 then return false end
  set_meta('queued', meta('queued') - 1)
  local sized = redis.call('EXISTS', P .. 'ob:' .. flow) == 1
  if sized then unsize(flow, id, b) end
  if backlog(flow) == 0 then
    redis.call('ZREM', P .. 'ready', flow)
    if sized then redis.call('DEL', P .. 'ob:' .. flow) end
    after_drain()
  end
  return true
end

-- (a flow in inel is never in ready: only one that joins inel leaves ready)
local function set_eligible(flow, ok)
  if not ok then
    if set_member('inel', flow, true) then redis.call('ZREM', P .. 'ready', flow) end
    return
  end
  if not set_member('inel', flow, false) then return end
  if backlog(flow) > 0 then
    local meter = math.max(meter_of(flow) or meta('v'), meta('v'))
    set_meter(flow, meter)
    enter(flow, meter)
  end
end

-- -- caps: an org's or a class's requests in flight -------------------------------------------

local NO_CAP = 2 ^ 62

-- an org's (kind 'ocap') or a class's ('ccap') cap, false when it has none
local function cap_of(kind, name)
  local cap = C[kind][name]
  if cap == nil then
    cap = num(redis.call('HGET', P .. kind, name), false)
    C[kind][name] = cap
  end
  return cap
end
local function org_cap(org) return cap_of('ocap', org) end
local function class_cap(cls) return cap_of('ccap', cls) end

-- an org or class without a cap is under it: its running count is not read
local function under_caps(org, cls)
  local ocap, ccap = org_cap(org), class_cap(cls)
  return (not ocap or count('orun', org) < ocap) and (not ccap or count('crun', cls) < ccap)
end

local function caps_of(org, cls)
  local caps = {}
  if org_cap(org) then caps[#caps + 1] = 'co:' .. org end
  if class_cap(cls) then caps[#caps + 1] = 'cc:' .. cls end
  return caps
end

local function split_flow(flow)
  local at = string.find(flow, '/', 1, true)
  return string.sub(flow, 1, at - 1), string.sub(flow, at + 1)
end

local function track(t)
  for _, cap in ipairs(caps_of(t.o, t.c)) do set_member(cap, t.f, true) end
  if not under_caps(t.o, t.c) then set_eligible(t.f, false) end
end

local function refresh(org, cls)
  for _, cap in ipairs(caps_of(org, cls)) do
    local flows = {}
    for flow in pairs(flow_set(cap)) do flows[#flows + 1] = flow end
    for _, flow in ipairs(flows) do
      local o, c = split_flow(flow)
      set_eligible(flow, under_caps(o, c))
      if not in_set('inel', flow) and backlog(flow) == 0 then set_member(cap, flow, false) end
    end
  end
end

-- -- pacing: a provider pool's rate and its provider's feedback --------------------------------

--[[ The pool's `pace` hash: the configured rate (rpm, tpm; absent when unset), each bucket's
level and the ms it was last refilled (rl, ru; tl, tu), and the provider's feedback that the
holders push (`throttle`): the end of the pause (pause), the rate factor f, which grows back
by rec a second from fs on, and the spaced next dispatch while f < 1 (next_at). Times in
ms of Redis's clock. Read at a call's first need, written back once at its end. ]]
local pace, pace_changed
local MAX_PAUSE_MS = 60000  -- core/throttle.py MAX_PAUSE_S: nothing holds a pool longer

local function pacing()
  if pace == nil then pace, pace_changed = read_numbers(P .. 'pace'), false end
  return pace
end
-- meta's `paced` says the pool ever had pacing: the others' calls never read the hash
local function set_pace(field, value)
  pace[field], pace_changed = value, true
  if value ~= nil and meta('paced') ~= 1 then set_meta('paced', 1) end
end
local function save_pace()
  if pace_changed then write_numbers(P .. 'pace', pace) end
end

-- a bucket k ('r': requests, 't': tokens) is core/limits.py's TokenBucket with burst_s = 1, as
-- pool_limits makes it: a second's worth, at least 1
local function capacity(k) return math.max(1, pace[k .. 'pm'] / 60) end

-- TokenBucket._refill, on Redis's clock; a bucket with no level yet starts full
local function refill(k, now)
  local level, updated = pace[k .. 'l'], pace[k .. 'u']
  if level == nil then
    set_pace(k .. 'l', capacity(k))
    set_pace(k .. 'u', now)
  elseif now > updated then
    set_pace(k .. 'l', math.min(capacity(k), level + (now - updated) * pace[k .. 'pm'] / 60000))
    set_pace(k .. 'u', now)
  end
end

-- TokenBucket.wait, in ms rounded up (at that ms the bucket holds enough); more than a full
-- bucket waits for a full one
local function bucket_wait(k, amount, now)
  if pace[k .. 'pm'] == nil then return 0 end
  refill(k, now)
  local missing = math.min(amount, capacity(k)) - pace[k .. 'l']
  return math.max(0, math.ceil(missing * 60000 / pace[k .. 'pm']))
end

-- TokenBucket.take (a negative amount: it may leave the bucket in debt) and give_back (never
-- above full)
local function bucket_add(k, amount, now)
  if pace[k .. 'pm'] == nil then return end
  refill(k, now)
  set_pace(k .. 'l', math.min(capacity(k), pace[k .. 'l'] + amount))
end

-- Rate.take (sign -1) and Rate.give_back (sign 1): a request, and its tokens
local function rate_add(sign, tokens, now)
  pacing()
  bucket_add('r', sign, now)
  bucket_add('t', sign * tokens, now)
end

-- Throttle.factor: the share of the rate dispatched at now, growing back to 1
local function factor(now)
  if pace.f == nil then return 1 end
  return math.min(1, pace.f + pace.rec * math.max(0, now - pace.fs) / 1000)
end

-- the wait of Scheduler._dispatch, in ms: Rate.wait for the ticket, and Throttle.wait
local function pace_wait(tokens, now)
  local held = math.max((pace.pause or 0) - now, (pace.next_at or 0) - now)
  return math.max(0, held, bucket_wait('r', 1, now), bucket_wait('t', tokens, now))
end

-- a dispatch: Rate.take, then Throttle.dispatched: below a factor of 1 the next dispatch
-- waits one request's time or its tokens' time at the reduced rate, whichever is longer
local function paced(tokens, now)
  rate_add(-1, tokens, now)
  local f = factor(now)
  if f >= 1 or not (pace.rpm or pace.tpm) then return end
  local spacing = 0
  if pace.rpm then spacing = 60000 / pace.rpm end
  if pace.tpm then spacing = math.max(spacing, tokens * 60000 / pace.tpm) end
  set_pace('next_at', now + math.min(MAX_PAUSE_MS, math.ceil(spacing / f)))
end

-- a holder's Throttle concluded from its provider's answer: hold for pause_ms, at most
-- MAX_PAUSE_MS, never shortening a pause (Throttle._pause); a factor at most f, growing back by
-- recover_per_s a second from the end of the pause (Throttle._rate_limited; the holder's own
-- Throttle halved it)
local function throttle(pause_ms, f, recover_per_s, now)
  pacing()
  local pause = math.max(pace.pause or 0, now + math.min(MAX_PAUSE_MS, math.max(0, pause_ms)))
  set_pace('pause', pause)
  if f < factor(now) then
    set_pace('f', f)
    set_pace('fs', pause)
    set_pace('rec', recover_per_s)
  end
end

-- the rate's limit k from configure ('' when unset): one that changed starts a full bucket, as
-- a reload makes new ones in memory; one that did not keeps its level, so that a replica that
-- joins or reloads gives the provider no new burst
local function set_rate(k, raw)
  local per_minute = raw ~= '' and tonumber(raw) or nil
  if pacing()[k .. 'pm'] == per_minute then return end
  set_pace(k .. 'pm', per_minute)
  set_pace(k .. 'l', nil)
  set_pace(k .. 'u', nil)
end

-- -- tickets, backends and leases ---------------------------------------------------------------

local function ticket(id)
  local t = C.ticket[id]
  if t == nil then
    local raw = redis.call('HGET', P .. 'ticket', id)
    if not raw then return nil end
    t = cjson.decode(raw)
    C.ticket[id] = t
  end
  return t
end
local function drop_ticket(id, h)
  redis.call('HDEL', P .. 'ticket', id)
  redis.call('SREM', P .. 'hq:' .. h, id)
  C.ticket[id] = nil
end

-- the band's ticket ids, in order; a call that changes the band forgets them (C.band = nil)
local function band_ids()
  if C.band == nil then C.band = redis.call('LRANGE', P .. 'band', 0, -1) end
  return C.band
end

local function band_next()
  for _, id in ipairs(band_ids()) do
    local t = ticket(id)
    local cap = class_cap(t.c) or NO_CAP
    if count('crun', t.c) < cap then return id, t end
  end
  return nil
end

-- the backends in placement order and their requests in flight, read at the first dispatch
-- (inflight: every backend's count, read whole: a backend it does not name runs nothing)
local backends, inflight
local function load_backends()
  backends = cjson.decode(redis.call('GET', P .. 'backends') or '[]')
  local c = counts('inflight')
  c.value, c.whole = {}, true
  local raw = redis.call('HGETALL', P .. 'inflight')
  for i = 1, #raw, 2 do c.value[raw[i]] = tonumber(raw[i + 1]) end
  for backend, delta in pairs(c.delta) do c.value[backend] = (c.value[backend] or 0) + delta end
  inflight = c.value
end

-- the pool's backends as configure or backends list them, each [name, slots(, {class: limit}
-- (, provisional))]: an entry marked provisional (engine dispatch: the caller's reading of its
-- engine is stale) yields to the one held for that backend, if any, so that a replica that
-- lost sight of an engine does not undo what a replica that sees it told
local function set_backends(listed)
  local new, held = cjson.decode(listed), {}
  for _, b in ipairs(cjson.decode(redis.call('GET', P .. 'backends') or '[]')) do held[b[1]] = b end
  for i, b in ipairs(new) do
    if b[4] == true and held[b[1]] then new[i] = held[b[1]] end
  end
  redis.call('SET', P .. 'backends', cjson.encode(new))
  backends = nil
end

-- core/placement.py rank: a backend's rendezvous score for an affinity key, 52 bits of SHA-1
local function rank(key, name)
  return tonumber(string.sub(redis.sha1hex(key .. '\n' .. name), 1, 13), 16)
end

-- whether a backend has a free slot for a ticket of class `cls`: under its slots, and under
-- its class's own limit where configure gave one (engine dispatch: b[3], {class: limit},
-- state/engine_scrape.py shared_backends): a backend a class may not fill counts as full
local function free(b, running, cls)
  local limits = b[3]
  local limit = limits and limits[cls]
  return running < b[2] and (limit == nil or running < limit)
end

-- where a ticket of affinity `key` and class `cls` goes among the backends the caller does not
-- hold down, and why (Placement.place): with a key and the pool's load factor (meta alf, set
-- by configure), the first of the key's order with a free slot and within the bounded load
-- plus the slack (meta als); else the least loaded with a free slot (first listed on ties)
local function choose(down, key, cls)
  if backends == nil then load_backends() end
  local factor = meta('alf')
  if key and factor > 0 then
    local slack = meta('als')
    local order, total, busy = {}, 0, 0
    for i, b in ipairs(backends) do
      if not down[b[1]] then
        order[#order + 1] = {b[1], b[2], rank(key, b[1]), i, b}
        total = total + b[2]
        busy = busy + (inflight[b[1]] or 0)
      end
    end
    table.sort(order, function(x, y)
      if x[3] ~= y[3] then return x[3] > y[3] end
      return x[4] < y[4]
    end)
    local bound = factor * (busy + 1)
    for at, b in ipairs(order) do
      local running = inflight[b[1]] or 0
      if free(b[5], running, cls) and (running - slack) * total < bound * b[2] then
        return b[1], at == 1 and 'affinity' or 'overflow'
      end
    end
  end
  local best, best_load
  for _, b in ipairs(backends) do
    if not down[b[1]] then
      local running = inflight[b[1]] or 0
      local load = running / b[2]
      if free(b, running, cls) and (best == nil or load < best_load) then
        best, best_load = b[1], load
      end
    end
  end
  return best, 'fallback'
end

local function running(t, delta)
  add_count('orun', t.o, delta)
  add_count('crun', t.c, delta)
  refresh(t.o, t.c)
end

-- a slot on `backend` leased to holder h for a request of org o, class c. Lease numbers only
-- grow, and start from Redis's clock (in µs-sized steps) when the pool's state is new: a
-- Redis that lost its data never hands out a number a replica may still hold from before
-- A ticket of the fair queue (t.p ~= 1) keeps its flow and cost in its lease, for the true-up
-- at its finish (settle); a band ticket's, or an adopted request's, holds none
local function grant_lease(backend, h, o, c, t)
  local lease = math.max(meta('fence'), now_ms() * 1000) + 1
  set_meta('fence', lease)
  lease = string.format('%.0f', lease)
  local record = {b = backend, h = h, o = o, c = c}
  if t ~= nil and t.p ~= 1 then record.f, record.cost = t.f, t.cost end
  redis.call('HSET', P .. 'lease', lease, cjson.encode(record))
  redis.call('SADD', P .. 'hl:' .. h, lease)
  add_count('inflight', backend, 1)
  running({o = o, c = c}, 1)
  return lease
end

-- dispatch while a ticket, a slot and the pool's pacing allow; grants of the caller's tickets
-- are returned, the others' go to their holders' inboxes. Returned second: in how many ms
-- pacing allows the next dispatch when it stopped this one, else -1
local function dispatch(down)
  local mine, wake, now = {}, -1, nil
  local paced_pool = meta('paced') == 1 and next(pacing()) ~= nil
  while true do
    local id, t = band_next()
    local sized, passed
    if id == nil then
      local flow
      flow, id, sized, passed = head()
      if flow == nil then break end
      t = ticket(id)
    end
    local backend, reason = choose(down, t.a, t.c)
    if backend == nil then break end
    if paced_pool then  -- as Scheduler._dispatch: decided once the ticket and backend are
      now = now or now_ms()
      local wait = pace_wait(t.tok, now)
      if wait > 0 then
        wake = wait
        break
      end
      paced(t.tok, now)
    end
    if t.p == 1 then
      redis.call('LREM', P .. 'band', 1, id)
      C.band = nil
    else
      pop(t.f, t.cost, id, t.b, sized, passed)
    end
    local lease = grant_lease(backend, t.h, t.o, t.c, t)
    drop_ticket(id, t.h)
    local grant = id .. ' ' .. lease .. ' ' .. reason .. ' ' .. backend
    if t.h == holder then
      mine[#mine + 1] = grant
    else
      redis.call('RPUSH', P .. 'inbox:' .. t.h, grant)
    end
  end
  return mine, wake
end

--[[ A submitted ticket that dispatch() would grant at once, granted without queueing it: the
common case, in a third of the commands that queueing it would take. It applies when nothing
waits (no flow holds a ticket, queued = 0, and no band ticket can go), the pool is not paced,
the ticket's flow is not held at a cap (not in inel), its org and class are under their caps,
and a backend has a free slot. dispatch() would then take it at once, as the only ticket in
the only ready flow (pick() returns the sole ticket of a line, size buckets or not), and leave
no trace of its queueing but its charge: push then pop join the flow at max(meter, v), set v
to that start and charge the flow, and the ticket runs (meta run), so the busy period goes on;
its record and hq entry come and go, its size-bucket fields are marked and unmarked. What
remains is written here: v, the flow's meter and weight, maxm and run, then the lease, whose
running() refreshes the caps' sets as after a dispatch. The flow itself is left out of its
caps' sets: track() would add it and that refresh take it out again (its line is empty), or,
when this grant brings its org or class to the cap, hold it there (inel) with an empty line,
which changes no decision: its next ticket is held by its own track(), as any flow's is.
Returns nil, having changed nothing, when it does not apply. ]]
local function dispatch_at_once(id, t, down)
  if meta('queued') > 0 or band_next() ~= nil then return nil end
  if meta('paced') == 1 and next(pacing()) ~= nil then return nil end
  if not under_caps(t.o, t.c) then return nil end
  if in_set('inel', t.f) then return nil end
  local backend, reason = choose(down, t.a, t.c)
  if backend == nil then return nil end
  local start = math.max(meter_of(t.f) or meta('v'), meta('v'))  -- push(), then pop()
  local meter = start + math.max(1, round_half_even(t.cost * UNITS / t.w))
  set_meta('v', start)
  set_meter(t.f, meter)
  redis.call('HSET', P .. 'weight', t.f, t.w)
  C.weight[t.f] = t.w
  set_meta('maxm', math.max(meta('maxm'), meter))
  set_meta('run', meta('run') + 1)
  if meta('v') >= RENORMALIZE_AT then renormalize() end
  local lease = grant_lease(backend, t.h, t.o, t.c, t)
  local grant = id .. ' ' .. lease .. ' ' .. reason .. ' ' .. backend
  if t.h == holder then return {grant} end
  redis.call('RPUSH', P .. 'inbox:' .. t.h, grant)
  return {}
end

-- a lease handed back by its holder h, its request having cost `actual` (nil: unknown; a
-- fair-queued one's flow is trued up, settle): one it no longer holds (reclaimed, handed back
-- already, or never its own) frees nothing
local function release(lease, h, actual)
  local raw = redis.call('HGET', P .. 'lease', lease)
  if not raw then return nil end
  local l = cjson.decode(raw)
  if l.h ~= h then return nil end
  redis.call('HDEL', P .. 'lease', lease)
  redis.call('SREM', P .. 'hl:' .. l.h, lease)
  add_count('inflight', l.b, -1)
  running(l, -1)
  if l.f then settle(l.f, l.cost, actual) end
  return l
end

local function cancel(id)
  local t = ticket(id)
  if t == nil then return false end
  if t.p == 1 then
    redis.call('LREM', P .. 'band', 1, id)
    C.band = nil
  else
    remove(t.f, id, t.b)
  end
  drop_ticket(id, t.h)
  return true
end

-- everything a holder had in Redis given back: its leases, its queued tickets, its inbox
local function forget(h)
  for _, lease in ipairs(redis.call('SMEMBERS', P .. 'hl:' .. h)) do release(lease, h) end
  for _, id in ipairs(redis.call('SMEMBERS', P .. 'hq:' .. h)) do cancel(id) end
  redis.call('DEL', P .. 'hl:' .. h, P .. 'hq:' .. h, P .. 'inbox:' .. h)
end

-- the holders whose heartbeat stopped
local function reap(now)
  for _, dead in ipairs(redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', now)) do
    forget(dead)
    redis.call('ZREM', P .. 'holders', dead)
    C.alive = nil
    set_meta('reaped', now)
  end
end

-- the holders alive now, in id order: what a replica divides slots by when Redis is lost
local function live(now)
  return redis.call('ZRANGEBYSCORE', P .. 'holders', '(' .. now, '+inf')
end

local function down_set(raw)
  local down = {}
  if raw == '[]' then return down end  -- the common case, not decoded
  for _, name in ipairs(cjson.decode(raw)) do down[name] = true end
  return down
end

-- -- the operations ---------------------------------------------------------------------------

local function alive()
  if C.alive == nil then C.alive = redis.call('ZSCORE', P .. 'holders', holder) ~= false end
  return C.alive
end

local function run(op)
  if op == 'heartbeat' then  -- ttl_ms, new (1: the first heartbeat of this holder)
    local now = now_ms()
    reap(now)
    if A[4] ~= '1' and not alive() then return {0} end  -- reclaimed: fenced
    if meta('born') == 0 then set_meta('born', now) end
    redis.call('ZADD', P .. 'holders', now + tonumber(A[3]), holder)
    C.alive = true
    local grants, wake = dispatch(down_set(A[5]))
    return {1, grants, live(now), wake}
  end
  if op == 'adopt' then  -- ttl_ms, the requests the caller runs [[backend, org, class], ...]
    -- back after Redis was lost: the caller's leases become exactly what it runs now (some
    -- granted here before, some started on its own meanwhile), its queued tickets go
    local now = now_ms()
    reap(now)
    if meta('born') == 0 then set_meta('born', now) end
    redis.call('ZADD', P .. 'holders', now + tonumber(A[3]), holder)
    C.alive = true
    forget(holder)
    local leases = {}
    for _, r in ipairs(cjson.decode(A[4])) do leases[#leases + 1] = grant_lease(r[1], holder, r[2], r[3]) end
    -- how long the pool has been calm: no holder reaped, no state lost (Redis restarted)
    return {1, leases, now - math.max(meta('born'), meta('reaped'))}
  end

  if not alive() then return {-1} end  -- not registered, or reclaimed: nothing may be granted

  -- the operations that dispatch reply {1, grants, wake} (dispatch's two values)
  if op == 'configure' then  -- backends (set_backends), org caps,
    -- class caps, down, rpm, tpm, affinity's load factor ('': affinity off) and slack
    set_rate('r', A[7])
    set_rate('t', A[8])
    set_meta('alf', A[9] and A[9] ~= '' and tonumber(A[9]) or nil)
    set_meta('als', A[10] and tonumber(A[10]) or nil)
    set_backends(A[3])
    redis.call('DEL', P .. 'ocap', P .. 'ccap')
    for org, cap in pairs(cjson.decode(A[4])) do redis.call('HSET', P .. 'ocap', org, cap) end
    for cls, cap in pairs(cjson.decode(A[5])) do redis.call('HSET', P .. 'ccap', cls, cap) end
    C.ocap, C.ccap = {}, {}
    return {1, dispatch(down_set(A[6]))}
  elseif op == 'backends' then  -- the backends alone, as configure's first argument; down
    set_backends(A[3])
    return {1, dispatch(down_set(A[4]))}
  elseif op == 'submit' then  -- id, ticket, front, down, max waiting ahead (-1: none)[, an
    -- admission to decide first (one Redis only): its org's key prefix, then admission.lua's
    -- admit arguments (rpm, tpm, tokens, key digest, ttl_ms)]
    -- An admission that refuses is the reply, {3, its reply}; one that lets the ticket in adds
    -- its reply last (queue full too: {2, ahead, it}; the caller refunds it then, as it does
    -- for any request that leaves the line).
    local admitted
    if A[8] then
      admitted = org_op(A[8], {'admit', unpack(A, 9, 13)})
      if admitted[1] ~= 1 then return {3, admitted} end
    end
    local id, t = A[3], cjson.decode(A[4])
    local limit = tonumber(A[7])
    if limit >= 0 then
      local ahead = 0
      if t.p == 1 then
        for _, other in ipairs(band_ids()) do
          local o = ticket(other)
          if o and o.c == t.c then ahead = ahead + 1 end
        end
      else
        ahead = backlog(t.f)
      end
      if ahead >= limit then return {2, ahead, admitted} end
    end
    local down = down_set(A[6])
    if t.p ~= 1 then
      local grants = dispatch_at_once(id, t, down)
      if grants then return {1, grants, -1, admitted} end
    end
    -- kept as the caller wrote it: cjson would write its numbers back with 14 digits only
    redis.call('HSET', P .. 'ticket', id, A[4])
    redis.call('SADD', P .. 'hq:' .. holder, id)
    C.ticket[id] = t
    if t.p == 1 then
      redis.call(A[5] == '1' and 'LPUSH' or 'RPUSH', P .. 'band', id)
      C.band = nil
    else
      push(t.f, id, t.w, A[5] == '1', t.k, t.b)
      track(t)
    end
    local grants, wake = dispatch(down)
    return {1, grants, wake, admitted}
  elseif op == 'cancel' then  -- id
    return {cancel(A[3]) and 1 or 0}
  elseif op == 'finish' then  -- lease, down, tokens to give back ('': none), actual cost
    -- ('': unknown)
    local l = release(A[3], holder, A[6] and A[6] ~= '' and tonumber(A[6]) or nil)
    if l == nil then return {0, {}} end  -- fenced: reclaimed, released already, or not its own
    if A[5] ~= '' then rate_add(1, tonumber(A[5]), now_ms()) end  -- Scheduler.refund
    return {1, dispatch(down_set(A[4]))}
  elseif op == 'throttle' then  -- pause ms, factor, its growth a second
    throttle(tonumber(A[3]), tonumber(A[4]), tonumber(A[5]), now_ms())
    return {1}
  elseif op == 'pump' then  -- down
    return {1, dispatch(down_set(A[3]))}
  elseif op == 'quit' then  -- down: the holder leaves (its drain is over); what it held goes
    forget(holder)
    redis.call('ZREM', P .. 'holders', holder)
    C.alive = false
    return {1, dispatch(down_set(A[3]))}
  elseif op == 'view' then  -- v, offset, then per flow: id, meter, backlog, at a cap (1/0)
    local out = {string.format('%.17g', meta('v')), string.format('%.17g', meta('offset'))}
    local meters = redis.call('HGETALL', P .. 'meter')
    for i = 1, #meters, 2 do
      local flow = meters[i]
      out[#out + 1] = flow
      out[#out + 1] = meters[i + 1]
      out[#out + 1] = tostring(backlog(flow))
      out[#out + 1] = in_set('inel', flow) and '1' or '0'
    end
    return out
  end
  return redis.error_reply('unknown operation ' .. tostring(op))
end

--[[ args[1] 'batch': several operations of the holder in one call, run in order, each as if
called on its own (Redis would have run them one after the other anyway); the reply is
theirs, in order. After the holder, each operation is its number of arguments, then its name
and arguments. Its calls share what a call reads once (meta, the backends, the cache): under
load a holder sends what came while its previous call was on the way as one call
(state/redis_batcher.py), and that per-call work is paid once for them all. ]]
local function run_batch(args)
  local replies, at = {}, 3
  while at <= #args do
    local n = tonumber(args[at])
    A = {args[at + 1], holder, unpack(args, at + 2, at + n)}
    replies[#replies + 1] = run(A[1])
    at = at + n + 1
  end
  return replies
end

local function sfq_dispatch(keys, args)
  P, holder, A = keys[1], args[2], args
  backends, inflight, pace, pace_changed = nil, nil, nil, false
  new_cache()
  N, S, S_was = {}, {}, {}
  org_call()  -- and Redis's clock: admission.lua's now_ms, read once per call
  load_meta()
  local reply
  if args[1] == 'batch' then reply = run_batch(args) else reply = run(args[1]) end
  save_meta()
  save_pace()
  save_counts()
  save_sets()
  save_buckets()  -- the orgs' of the admissions that submits carried
  return reply
end

redis.register_function('sfq_dispatch', sfq_dispatch)
