-- Marks a record in flight as waited for, so that its owner's completion or release tells the
-- processes that wait for it (see complete.lua). A waiter marks the key once it listens.
--
-- The state byte ("i" in flight, see claim.lua) becomes "w": in flight, waited for. The record
-- keeps its expiry (the owner's lease), its owner and its fence; the owner's compare-and-set
-- commands, which compare the whole record, then leave the key to its scripts, which read "w"
-- as in flight and publish when they end it.
--
-- KEYS[1]: the record
-- Returns: 1 if the key is in flight (now marked); 0 if it is not (completed, released,
--          expired): the waiter claims again now
local record = redis.call('GET', KEYS[1])
if not record then
  return 0
end
local state = string.sub(record, 2, 2)
if state == 'w' then
  return 1
end
if state ~= 'i' then
  return 0
end
redis.call('SET', KEYS[1], string.sub(record, 1, 1) .. 'w' .. string.sub(record, 3), 'KEEPTTL')
return 1
