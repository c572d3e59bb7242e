-- Extends the lease, if the owner still holds the key in flight.
--
-- KEYS[1]: the record (see claim.lua)
-- ARGV[1]: the owner token (16 bytes)
-- ARGV[2]: the new lease, in milliseconds from now
-- Returns: 1 if the lease was extended; 0 if the owner no longer held it (nothing written)
--
-- In flight is "i", or "w" once a waiter marked it (see mark.lua): the mark stays.
local record = redis.call('GET', KEYS[1])
if not record then
  return 0
end
local state = string.sub(record, 2, 2)
if (state ~= 'i' and state ~= 'w') or string.sub(record, 35, 50) ~= ARGV[1] then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
