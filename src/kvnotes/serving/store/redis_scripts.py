"""The Lua scripts of :class:`~kvnotes.serving.store.redis_store.RedisStore`, and which of its
calls a client may send twice.

redis-py sends a command again after a connection error or a timeout (``RedisSettings.retries``),
and the server may have run the first one: its reply was lost, not its effect. So every write the
store makes is safe to run twice, and each script says why:

* chunk ``SET``\\ s under a fresh generation (the same bytes again), ``SADD``, ``ZADD GT``,
  ``PEXPIRE``, ``DEL``: the same state however often they run;
* :data:`PUBLISH`: a run that finds its own manifest already set returns "done" and touches
  nothing (before this check, the second run took its own chunks for the previous generation's
  and expired them);
* :data:`DROP`, :data:`FORGET`: conditional on the manifest the caller read; a second run of a
  forget finds the key in the forgotten set with the same time and reports it done;
* :data:`LEASES`: a lease holds ``TOKEN:NONCE``, the nonce fresh per call, so the call's own
  retry finds its value and takes it again, while another call of the same holder does not;
* :data:`RENEW`: a ``PEXPIRE`` of a lease that still holds the value its take set (the same
  state however often it runs; a lease that expired and was taken by another holder is left);
* ``INCR`` of a sighting, ``XADD`` to the change feed: a retry counts a sighting twice or
  repeats a feed row (harmless: a chunk comes due one sighting early; a mirror skips an entry
  it has). The request path's client does not retry at all (``retries=0``).

The scripts run on one server (``RedisStore`` is a single-node client); :data:`PUBLISH` touches
one entry's keys only (one hash slot), the others also the model's bookkeeping keys. Deletes are
batched below Lua's ``unpack`` limit (:data:`UNPACK_BATCH`), and each script starts with its
deletes: a script that has written goes on to its end even over ``maxmemory``, so a forget on
a full server is done whole (Redis refuses a script only at its first write that needs memory).
"""

from __future__ import annotations

UNPACK_BATCH = 500  # keys per DEL inside a script (Lua's unpack stops near 8,000)

_DEL_FROM = f"""
local function del_from(first, last)
  for i = first, last, {UNPACK_BATCH} do
    redis.call('DEL', unpack(KEYS, i, math.min(i + {UNPACK_BATCH - 1}, last)))
  end
end
"""

# KEYS[1] manifest, KEYS[2..n+1] the new chunks, KEYS[n+2..] the previous generation's chunks.
# ARGV[1] the new manifest, ARGV[2] the manifest read before ("" none), ARGV[3] n, ARGV[4] the
# previous chunks' expiry (ms). 1: published (now or by an earlier run of this call); 0: a
# chunk is missing (nothing published); 2: the manifest changed since it was read (read again).
PUBLISH = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return 1 end
if (cur or '') ~= ARGV[2] then return 2 end
local n = tonumber(ARGV[3])
for i = 2, n + 1 do
  if redis.call('EXISTS', KEYS[i]) == 0 then return 0 end
end
for i = 2, n + 1 do redis.call('PERSIST', KEYS[i]) end
redis.call('SET', KEYS[1], ARGV[1])
for i = n + 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# KEYS[1] manifest, KEYS[2] the owner's index set, KEYS[3] lru, KEYS[4] hits, KEYS[5] pins,
# KEYS[6..] its chunks. ARGV[1] the manifest read, ARGV[2] the entry's key, ARGV[3] "1" when
# the key's LRU, hits and pin go too (not for a forged copy of another owner's entry). Nothing
# is done when the manifest is no longer ARGV[1] (republished meanwhile): 0.
DROP = _DEL_FROM + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
del_from(6, #KEYS)
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('HDEL', KEYS[4], ARGV[2])
  redis.call('SREM', KEYS[5], ARGV[2])
end
return 1
"""

# An index member whose manifest is gone (dropped, evicted, flushed): KEYS[1] manifest, KEYS[2]
# index set, KEYS[3] lru, KEYS[4] hits; ARGV[1] key. Left alone when the manifest is there.
UNLIST = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return 1
"""

# KEYS[1] manifest, KEYS[2] index set, KEYS[3] lru, KEYS[4] hits, KEYS[5] pins, KEYS[6] gone,
# KEYS[7] feed, KEYS[8..] chunks. ARGV[1] the manifest read, ARGV[2] key, ARGV[3] now, ARGV[4]
# forgotten before this are no longer remembered, ARGV[5] the feed's length, ARGV[6] the tenant
# field. 1: forgotten (now, or by an earlier run of this call); 0: no such entry; 2: republished
# since it was read.
FORGET = _DEL_FROM + """
local cur = redis.call('GET', KEYS[1])
if not cur then
  local when = redis.call('ZSCORE', KEYS[6], ARGV[2])
  if when and tonumber(when) == tonumber(ARGV[3]) then return 1 end
  return 0
end
if cur ~= ARGV[1] then return 2 end
del_from(8, #KEYS)
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[2])
redis.call('SREM', KEYS[5], ARGV[2])
redis.call('ZADD', KEYS[6], ARGV[3], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[6], 0, ARGV[4])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[5], '*', 'op', 'forget', 'key', ARGV[2],
           'tenant', ARGV[6], 'bytes', 0)
return 1
"""

# KEYS[1..n] leases to take, KEYS[n+1..] leases to give back: those whose take timed out (it
# may have been applied: then the lease holds that call's value). ARGV[1] TOKEN:NONCE of this
# call, ARGV[2] ttl (ms), ARGV[3] n, ARGV[4..] the values to give back, one per lease to give
# back ("TOKEN:" for any of this holder's: a give-back whose reply was lost). Those first;
# then, per lease to take, 1 when taken (or already this call's: a retry), 0 when held.
LEASES = """
local n = tonumber(ARGV[3])
for i = n + 1, #KEYS do
  local v, want = redis.call('GET', KEYS[i]), ARGV[i - n + 3]
  if v and (v == want or (string.sub(want, -1) == ':' and string.sub(v, 1, #want) == want)) then
    redis.call('DEL', KEYS[i])
  end
end
local out = {}
for i = 1, n do
  local v = redis.call('GET', KEYS[i])
  if v == ARGV[1] then
    out[i] = 1
  elseif v then
    out[i] = 0
  else
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
    out[i] = 1
  end
end
return out
"""

# KEYS[1] a lease; ARGV[1] this holder's token: deleted when this holder's (any of its calls)
RELEASE = """
local v = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ':'
if v and string.sub(v, 1, #mine) == mine then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1..n] leases this holder took; ARGV[1] ttl (ms), ARGV[2..n+1] the TOKEN:NONCE each take
# set. Per lease: 1 when it still holds that value (its time to live set again), 0 when it
# expired or is another's (nothing done).
RENEW = """
local out = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i + 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
