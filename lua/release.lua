-- Deletes the key, if the owner still holds it in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- ARGV[1]: the owner token (16 bytes)
-- ARGV[2]: the command that tells waiters a key ended (see complete.lua)
-- ARGV[3]: the channel it tells them on
-- Returns: 1 if the record was deleted; 0 if the owner no longer held it (nothing written)
--
-- A record marked as waited for (state "w", see mark.lua) is told released, as complete.lua
-- tells a completion: its waiters claim again, and one of them runs.
local record = redis.call('GET', KEYS[1])
if not record then
  return 0
end
local state = string.sub(record, 2, 2)
if (state ~= 'i' and state ~= 'w') or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if state == 'w' then
  redis.call(ARGV[2], ARGV[3], KEYS[1])
end
return 1
