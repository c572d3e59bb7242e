-- Stores the response and completes the key, if the owner still holds it in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- ARGV[1]: the owner token
-- ARGV[2]: the encoded response
-- ARGV[3]: the retention, in milliseconds
-- Returns: 1 if the record is now completed; 0 if the owner no longer held it (nothing written)
local record = redis.call('HMGET', KEYS[1], 'st', 'ow')
if record[1] ~= 'i' or record[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'st', 'c', 'rs', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
