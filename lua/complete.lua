-- Stores the response and completes the key, if the owner still holds it in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- KEYS[2]: the key's tombstone, on a store that keeps them; absent otherwise
-- ARGV[1]: the owner token (16 bytes)
-- ARGV[2]: the encoded response
-- ARGV[3]: the retention, in milliseconds
-- ARGV[4]: the command that tells waiters a key ended: PUBLISH (one server) or SPUBLISH (a
--          cluster, on the key's shard)
-- ARGV[5]: the channel it tells them on (the record's name, on a cluster)
-- ARGV[6]: with KEYS[2], the horizon, in milliseconds: how long from now the tombstone lasts
-- ARGV[7]: with KEYS[2], the response's status (3 digits)
-- Returns: 1 if the record is now completed; 0 if the owner no longer held it (nothing written)
--
-- A record marked as waited for (state "w", see mark.lua) is in flight too; its completion is
-- told on ARGV[5] (the record's name as the message), and only its: a key nobody waits for
-- costs nothing more.
--
-- The tombstone is what claim.lua answers once the record (and its answer) expired: the
-- fingerprint (32 bytes), the status (3 digits), and when the key completed (16 digits of the
-- server's microseconds).
local record = redis.call('GET', KEYS[1])
if not record then
  return 0
end
local state = string.sub(record, 2, 2)
if (state ~= 'i' and state ~= 'w') or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], string.sub(record, 1, 1) .. 'c' .. string.sub(record, 3, 66) .. ARGV[2],
  'PX', ARGV[3])
if KEYS[2] then
  local now = redis.call('TIME')
  local clock = now[1] .. string.format('%06d', tonumber(now[2]))
  redis.call('SET', KEYS[2], string.sub(record, 3, 34) .. ARGV[7] .. clock, 'PX', ARGV[6])
end
if state == 'w' then
  redis.call(ARGV[4], ARGV[5], KEYS[1])
end
return 1
