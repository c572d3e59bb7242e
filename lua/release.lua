-- Deletes the key, if the owner still holds it in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- ARGV[1]: the owner token (16 bytes)
-- Returns: 1 if the record was deleted; 0 if the owner no longer held it (nothing written)
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 2, 2) ~= 'i' or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
