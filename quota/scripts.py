"""The Lua scripts of quota enforcement: each decision is one atomic script in Redis.

Every script reads the time with ``TIME``, inside Redis: buckets refill on one clock, the
Redis server's, whichever machine (ingress or worker, each with a clock of its own) sends
the script. A caller whose clock runs ahead can neither refill a bucket early nor push its
timestamp into the future. (Redis 5+ replicates a script's effects, not the script, so
reading the time before writing is allowed.)
"""

from __future__ import annotations

__all__ = ["GIVE_BACK", "LEASE", "RESERVE", "SETTLE"]

# The token bucket every script shares: the time, load (refilled to now), save, credit
# (refill, then add what a settle or a returned lease gives back: negative for a charge
# beyond what was taken), and the wait until ``amount`` fits (-1: it never will). A bucket
# that is gone (idle past its expiry, a team's first use, lost with Redis's data) is full:
# what it is given back changes nothing, and a charge is taken from a full bucket of
# capacity ``full``, made there (a charge nobody reserved, such as a request admitted while
# Redis did not answer, must not be dropped for want of a bucket). A bucket in debt lives
# until the debt is paid back by the refill, then its usual idle time: an expiry never
# forgives a debt.
_BUCKET = """
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function expiry(tokens, cap, ttl)
  if tokens < 0 and cap > 0 then return ttl + math.ceil(-tokens * 3600 / cap) end
  return ttl
end
local function load(key, cap, now)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil then return cap end
  return math.min(cap, tokens + math.max(0, now - ts) * cap / 3600)
end
local function save(key, tokens, now, cap, ttl)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now), 'cap', tostring(cap))
  redis.call('EXPIRE', key, expiry(tokens, cap, ttl))
end
local function credit(key, amount, now, ttl, full)
  local v = redis.call('HMGET', key, 'tokens', 'ts', 'cap')
  local tokens, ts, cap = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if tokens == nil then
    if amount < 0 and full ~= nil then save(key, full + amount, now, full, ttl) end
    return
  end
  tokens = math.min(cap, tokens + math.max(0, now - ts) * cap / 3600)
  tokens = math.min(cap, tokens + amount)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now))
  redis.call('EXPIRE', key, expiry(tokens, cap, ttl))
end
local function retry_after(amount, tokens, cap)
  if amount <= cap and cap > 0 then return (amount - tokens) * 3600 / cap end
  return -1
end
"""

# A request already holding a reservation is admitted again without taking more (a re-run of
# it). A batch line's reservation is its record's (ARGV 3 names the record as well as the id,
# ``SETTLE``'s ARGV 12): another record of the same id is another line, and takes its own.
# KEYS: 1 bucket, 2 reservations, 3 factor, 4 lender bucket (batch borrowing interactive)
# ARGV: 1 base tokens/h, 2 amount, 3 reservation field (the request id; a batch line's with
#       its record), 4 pool, 5 borrow 0|1,
#       6 lender base tokens/h, 7 reserve share, 8 lender pool, 9 bucket ttl, 10 resv ttl
RESERVE = (
    _BUCKET
    + """
local factor = tonumber(redis.call('GET', KEYS[3]) or '1') or 1
local now, amount = clock(), tonumber(ARGV[2])
local cap = tonumber(ARGV[1]) * factor
local bucket_ttl = tonumber(ARGV[9])
local resv_ttl = tonumber(ARGV[10])
local tokens = load(KEYS[1], cap, now)
local held = redis.call('HGET', KEYS[2], ARGV[3])
if held then
  return {1, tostring(tokens), '0', tostring(cap), ARGV[4]}
end
if tokens >= amount then
  save(KEYS[1], tokens - amount, now, cap, bucket_ttl)
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4] .. ' ' .. ARGV[2])
  redis.call('EXPIRE', KEYS[2], resv_ttl)
  return {1, tostring(tokens - amount), '0', tostring(cap), ARGV[4]}
end
if ARGV[5] == '1' then
  local lcap = tonumber(ARGV[6]) * factor
  local ltokens = load(KEYS[4], lcap, now)
  if ltokens - amount >= tonumber(ARGV[7]) * lcap then
    save(KEYS[4], ltokens - amount, now, lcap, bucket_ttl)
    redis.call('HSET', KEYS[2], ARGV[3], ARGV[8] .. ' ' .. ARGV[2])
    redis.call('EXPIRE', KEYS[2], resv_ttl)
    return {1, tostring(tokens), '0', tostring(cap), ARGV[8]}
  end
end
local retry = retry_after(amount, tokens, cap)
return {0, tostring(tokens), tostring(retry), tostring(cap), ARGV[4]}
"""
)

# A lease: an ingress takes a share of the interactive pool at once and admits from it
# locally, so most admissions cost no round trip. The bucket loses the tokens when they are
# leased; requests admitted from a lease are settled against the pool like reservations.
# KEYS: 1 bucket, 2 factor
# ARGV: 1 base tokens/h, 2 need (fewest to take), 3 want (most), 4 bucket ttl
LEASE = (
    _BUCKET
    + """
local factor = tonumber(redis.call('GET', KEYS[2]) or '1') or 1
local now, need, want = clock(), tonumber(ARGV[2]), tonumber(ARGV[3])
local cap = tonumber(ARGV[1]) * factor
local tokens = load(KEYS[1], cap, now)
if tokens < need then
  return {0, tostring(tokens), tostring(retry_after(need, tokens, cap)), tostring(cap)}
end
local take = math.max(need, math.floor(math.min(want, tokens)))
save(KEYS[1], tokens - take, now, cap, tonumber(ARGV[4]))
return {1, tostring(tokens - take), tostring(take), tostring(cap)}
"""
)

# Unused lease back to the pool. KEYS: 1 bucket; ARGV: 1 tokens, 2 bucket ttl
GIVE_BACK = (
    _BUCKET
    + """
credit(KEYS[1], tonumber(ARGV[1]), clock(), tonumber(ARGV[2]))
return 1
"""
)

# The charge of a request: what it used; the minimum charge when it used nothing (dropped
# before it ran: not free), and at most its reservation plus the excess share (a prompt
# that tokenizes denser than estimated costs its team more, but not without bound).
# A request admitted from a lease (ARGV 4) or by an ingress's local limiter while Redis did
# not answer (ARGV 9) has no reservation record: a mark per request id makes its settle
# happen once, however often it is sent (a re-run after a crash, a settle that timed out
# and is sent again once Redis answers). The lease took its tokens from the pool already;
# the local limiter took none, so such a request is charged in full here. A mark lives for
# a while only (ARGV 5): a leased request settled later than ARGV 14 after its acceptance
# (ARGV 13) may have been settled before, its mark gone, so it is refunded nothing (a
# charge beyond its lease is still taken). That costs a first settle so late (owed through a
# long Redis outage) its refund; a replay never gets a second one.
# A batch line (ARGV 10) is marked too, under its id and the time its record was stored
# (ARGV 11: the record, not only the ids its submitter chose, so a new record that repeats
# them is charged): a worker that crashed after settling it and before its transaction
# committed runs it again, reserving anew; that second reservation goes back whole here
# instead of being charged a second time. A batch line's reservation is its record's too
# (ARGV 12, the field ``RESERVE`` took it under): another record of the same id, run by
# another worker, holds a reservation of its own, which this settle leaves alone. (One
# reserved under the bare id, by a caller that did not name the record, is taken for it.)
# A charge beyond what was taken, on a pool whose bucket is gone, needs the pool's base
# (ARGV 15, 16: tokens/h before the factor) to make it full first: without it the script
# changes nothing and answers found = -1, and the caller sends it again with the bases.
# KEYS: 1 reservations, 2 interactive bucket, 3 batch bucket, 4 interactive used, 5 batch used,
#       6 settled marks (request ids admitted from a lease or locally, or batch lines,
#       settled already), 7 factor
# ARGV: 1 request id, 2 actual tokens, 3 used ttl, 4 leased tokens (0: none), 5 marks ttl,
#       6 minimum charge, 7 excess share, 8 bucket ttl, 9 locally admitted tokens (0: none),
#       10 settle once whatever was reserved (1: a batch line), 11 the mark's field,
#       12 the reservation's field, 13 accepted at (epoch s), 14 refund window (s),
#       15 interactive base tokens/h, 16 batch base tokens/h ('': not sent)
# Returns {found -1|0|1, pool, reserved, charged}.
SETTLE = (
    _BUCKET
    + """
local id = ARGV[1]
local leased, unpooled = tonumber(ARGV[4]), tonumber(ARGV[9])
local now, bucket_ttl = clock(), tonumber(ARGV[8])
local function pool_keys(pool)
  if pool == 'batch' then return KEYS[3], KEYS[5], ARGV[16] end
  return KEYS[2], KEYS[4], ARGV[15]
end
local function reservation()
  local held = redis.call('HGET', KEYS[1], ARGV[12])
  if held then return ARGV[12], held end
  if ARGV[12] ~= id then
    held = redis.call('HGET', KEYS[1], id)
    if held then return id, held end
  end
  return nil, nil
end
local function mark()
  redis.call('HSET', KEYS[6], ARGV[11], '1')
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
end
local marked = leased > 0 or unpooled > 0 or ARGV[10] == '1'
if marked and redis.call('HEXISTS', KEYS[6], ARGV[11]) == 1 then
  local field, again = reservation()
  if again then
    local pool, amount = string.match(again, '^(%S+) (%S+)$')
    credit((pool_keys(pool)), tonumber(amount), now, bucket_ttl)
    redis.call('HDEL', KEYS[1], field)
  end
  return {0, '', '0', '0'}
end
local field, held = reservation()
local pool, amount, taken
if held then
  pool, amount = string.match(held, '^(%S+) (%S+)$')
  amount = tonumber(amount)
  taken = amount
elseif leased > 0 then
  pool, amount, taken = 'interactive', leased, leased
elseif unpooled > 0 then
  pool, amount, taken = 'interactive', unpooled, 0
else
  if marked then mark() end
  return {0, '', '0', '0'}
end
local actual = tonumber(ARGV[2])
if actual == 0 then actual = math.min(tonumber(ARGV[6]), amount) end
local charged = math.min(actual, amount + math.floor(amount * tonumber(ARGV[7])))
local change = taken - charged
if not held and change > 0 and now - tonumber(ARGV[13]) > tonumber(ARGV[14]) then
  change = 0
end
local bucket, used, base = pool_keys(pool)
local full
if change < 0 and redis.call('EXISTS', bucket) == 0 then
  if base == '' then return {-1, pool, tostring(amount), '0'} end
  full = tonumber(base) * (tonumber(redis.call('GET', KEYS[7]) or '1') or 1)
end
if marked then mark() end
credit(bucket, change, now, bucket_ttl, full)
if held then redis.call('HDEL', KEYS[1], field) end
if charged > 0 then
  redis.call('INCRBY', used, charged)
  redis.call('EXPIRE', used, tonumber(ARGV[3]))
end
return {1, pool, tostring(amount), tostring(charged)}
"""
)
