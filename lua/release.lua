-- Deletes the key, if the owner still holds it in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- ARGV[1]: the owner token
-- Returns: 1 if the record was deleted; 0 if the owner no longer held it (nothing written)
local record = redis.call('HMGET', KEYS[1], 'st', 'ow')
if record[1] ~= 'i' or record[2] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
