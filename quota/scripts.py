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
# beyond the reservation; a bucket that expired is full anyway), and the wait until
# ``amount`` fits (-1: it never will). A bucket in debt lives until the debt is paid back by
# the refill, then its usual idle time: an expiry never forgives a debt.
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
local function credit(key, amount, now, ttl)
  local v = redis.call('HMGET', key, 'tokens', 'ts', 'cap')
  local tokens, ts, cap = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if tokens == nil then return end
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

# KEYS: 1 bucket, 2 reservations, 3 factor, 4 lender bucket (batch borrowing interactive)
# ARGV: 1 base tokens/h, 2 amount, 3 request id, 4 pool, 5 borrow 0|1,
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
# the local limiter took none, so such a request is charged in full here.
# A batch line (ARGV 10) is marked too, under its id and the time its record was stored
# (ARGV 11: the record, not only the ids its submitter chose, so a new record that repeats
# them is charged): a worker that crashed after settling it and before its transaction
# committed runs it again, reserving anew; that second reservation goes back whole here
# instead of being charged a second time.
# KEYS: 1 reservations, 2 interactive bucket, 3 batch bucket, 4 interactive used, 5 batch used,
#       6 settled marks (request ids admitted from a lease or locally, or batch lines,
#       settled already)
# ARGV: 1 request id, 2 actual tokens, 3 used ttl, 4 leased tokens (0: none), 5 marks ttl,
#       6 minimum charge, 7 excess share, 8 bucket ttl, 9 locally admitted tokens (0: none),
#       10 settle once whatever was reserved (1: a batch line), 11 the mark's field
# Returns {found 0|1, pool, reserved, charged}.
SETTLE = (
    _BUCKET
    + """
local leased, unpooled = tonumber(ARGV[4]), tonumber(ARGV[9] or '0')
if leased > 0 or unpooled > 0 or ARGV[10] == '1' then
  if redis.call('HSETNX', KEYS[6], ARGV[11] or ARGV[1], '1') == 0 then
    local again = redis.call('HGET', KEYS[1], ARGV[1])
    if again then
      local pool, amount = string.match(again, '^(%S+) (%S+)$')
      local bucket = KEYS[2]
      if pool == 'batch' then bucket = KEYS[3] end
      credit(bucket, tonumber(amount), clock(), tonumber(ARGV[8]))
      redis.call('HDEL', KEYS[1], ARGV[1])
    end
    return {0, '', '0', '0'}
  end
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
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
  return {0, '', '0', '0'}
end
local actual = tonumber(ARGV[2])
if actual == 0 then actual = math.min(tonumber(ARGV[6]), amount) end
local charged = math.min(actual, amount + math.floor(amount * tonumber(ARGV[7])))
local bucket, used = KEYS[2], KEYS[4]
if pool == 'batch' then bucket, used = KEYS[3], KEYS[5] end
credit(bucket, taken - charged, clock(), tonumber(ARGV[8]))
if held then redis.call('HDEL', KEYS[1], ARGV[1]) end
if charged > 0 then
  redis.call('INCRBY', used, charged)
  redis.call('EXPIRE', used, tonumber(ARGV[3]))
end
return {1, pool, tostring(amount), tostring(charged)}
"""
)
