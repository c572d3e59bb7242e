-- Claims an idempotency key, or reports why not. The only script that creates a record.
--
-- KEYS[1]: the record (a hash: st = state "i" in flight / "c" completed, ow = owner token,
--          fp = request fingerprint, fe = fence, rs = encoded response, v = layout version)
-- ARGV[1]: the claimant's owner token
-- ARGV[2]: the request fingerprint (32 raw bytes)
-- ARGV[3]: the lease, in milliseconds
-- ARGV[4]: the record layout version this client writes and reads
-- Returns: {0, fence}     acquired: the record is the claimant's, in flight for the lease
--          {1, pttl}      in flight: another owner's lease has pttl milliseconds left
--          {2}            mismatch: the key holds a different fingerprint
--          {3, response, pttl}  completed: the stored response, encoded, kept pttl ms more
--          {4, reason}    the record is unreadable (corrupted, or another layout version)
--
-- An in-flight record expires with its lease (PEXPIRE), so an expired lease is an absent key.
-- The fence is the server clock in microseconds: it grows across expiry and release for as long
-- as that clock does (Postgres, where present, hands out the authoritative fence).
local record = redis.call('HMGET', KEYS[1], 'st', 'fp', 'rs', 'v')
local state, fingerprint, response, version = record[1], record[2], record[3], record[4]

if not state then
  local now = redis.call('TIME')
  local fence = now[1] .. string.format('%06d', tonumber(now[2]))
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'st', 'i', 'ow', ARGV[1], 'fp', ARGV[2], 'fe', fence, 'v', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {0, fence}
end

if version ~= ARGV[4] then
  return {4, 'record layout version ' .. tostring(version) .. ', expected ' .. ARGV[4]}
end
if fingerprint ~= ARGV[2] then
  return {2}
end
if state == 'c' then
  if not response then
    return {4, 'completed record without a response'}
  end
  return {3, response, redis.call('PTTL', KEYS[1])}
end
if state == 'i' then
  return {1, redis.call('PTTL', KEYS[1])}
end
return {4, 'unknown state ' .. tostring(state)}
