-- Stores the response and completes the key, if the owner still holds it in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- KEYS[2]: the key's tombstone, on a store that keeps them; absent otherwise
-- ARGV[1]: the owner token (16 bytes)
-- ARGV[2]: the encoded response
-- ARGV[3]: the retention, in milliseconds
-- ARGV[4]: with KEYS[2], the horizon, in milliseconds: how long from now the tombstone lasts
-- ARGV[5]: with KEYS[2], the response's status (3 digits)
-- Returns: 1 if the record is now completed; 0 if the owner no longer held it (nothing written)
--
-- The tombstone is what claim.lua answers once the record (and its answer) expired: the
-- fingerprint (32 bytes), the status (3 digits), and when the key completed (16 digits of the
-- server's microseconds).
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 2, 2) ~= 'i' or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], string.sub(record, 1, 1) .. 'c' .. string.sub(record, 3, 66) .. ARGV[2],
  'PX', ARGV[3])
if KEYS[2] then
  local now = redis.call('TIME')
  local clock = now[1] .. string.format('%06d', tonumber(now[2]))
  redis.call('SET', KEYS[2], string.sub(record, 3, 34) .. ARGV[5] .. clock, 'PX', ARGV[4])
end
return 1
