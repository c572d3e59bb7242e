-- Stores the response and completes the key, if the owner still holds it in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- ARGV[1]: the owner token (16 bytes)
-- ARGV[2]: the encoded response
-- ARGV[3]: the retention, in milliseconds
-- Returns: 1 if the record is now completed; 0 if the owner no longer held it (nothing written)
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 2, 2) ~= 'i' or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], string.sub(record, 1, 1) .. 'c' .. string.sub(record, 3, 66) .. ARGV[2],
  'PX', ARGV[3])
return 1
