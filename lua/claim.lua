-- Claims an idempotency key, or returns the record that holds it, or its tombstone. The only
-- script that creates a record; the store runs it where it keeps tombstones, or where the server
-- has no SET ... NX GET (Redis before 7.0). Elsewhere a claim is that SET, a PTTL and a TIME,
-- pipelined, which writes the same record (src/store/redis/compare.rs).
--
-- The record is one string: a layout byte, a state byte ("i" in flight, "w" in flight and
-- waited for (mark.lua), "c" completed), the request fingerprint (32 bytes), the owner token
-- (16 bytes), the fence (16 decimal digits), and once completed the encoded response. Its
-- expiry is the lease while in flight, the retention once completed (PEXPIRE/PX: the server's
-- clock).
--
-- KEYS[1]: the record
-- KEYS[2]: the key's tombstone (see complete.lua), on a store that keeps them; absent otherwise
-- ARGV[1]: the new record up to its fence: layout byte, "i", fingerprint, owner token
-- ARGV[2]: the lease, in milliseconds
-- Returns: {0, fence}          acquired: the record is the claimant's, in flight for the lease
--          {1, record, pttl}   the key is held: its record, and the milliseconds it has left
--          {1, record, pttl, now}
--                              the claimant's own record, in flight (its claim asked again, the
--                              first answer lost): granted again, with the server's clock as its
--                              fence (the record keeps the fence that names it)
--          {2, tombstone, now} the key completed and its answer is gone: its tombstone, and the
--                              server's clock (16 digits of microseconds, as a fence)
--
-- The fence is the server clock in microseconds: it grows across expiry and release for as long
-- as that clock does (Postgres, where present, hands out the authoritative fence). A claim asked
-- again gets the clock of that moment too, whoever wrote the record (this script, or the
-- pipelined SET, which names its record by the application's clock).
--
-- The record is read first: a replay or a duplicate (the claims that find one) writes nothing and
-- reads only its time left (and the clock, for its owner); a script runs alone, so nothing comes
-- between the read and the write.
local function server_clock()
  local now = redis.call('TIME')
  return now[1] .. string.format('%06d', tonumber(now[2]))
end
local record = redis.call('GET', KEYS[1])
if record then
  local pttl = redis.call('PTTL', KEYS[1])
  -- The claimant's own record in flight, waited for or not: the same bytes but the state's.
  local own = string.sub(record, 1, 1) == string.sub(ARGV[1], 1, 1)
    and string.sub(record, 3, #ARGV[1]) == string.sub(ARGV[1], 3)
    and (string.sub(record, 2, 2) == 'i' or string.sub(record, 2, 2) == 'w')
  if own then
    return {1, record, pttl, server_clock()}
  end
  return {1, record, pttl}
end
local clock = server_clock()
if KEYS[2] then
  local tombstone = redis.call('GET', KEYS[2])
  if tombstone then
    return {2, tombstone, clock}
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. clock, 'PX', ARGV[2])
return {0, clock}
