-- Reads the claimed ticks kept in <ns>:scheduler:unpublished and, if there are any, writes
-- one of them again, unchanged: the connection then has a write after every claim it read,
-- so a WAIT on it returns only once a replica holds all of them (WAIT counts this
-- connection's last write, and replication keeps the primary's order).
-- KEYS: unpublished (hash)
-- Returns the hash as field, data, field, data...
local held = redis.call("hgetall", KEYS[1])
if #held > 0 then
    redis.call("hset", KEYS[1], held[1], held[2])
end
return held
