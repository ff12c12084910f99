-- Stores one schedule entry created at run time and indexes its next tick, in one call,
-- so the leader never sees an entry without its due time, nor a due time without its entry.
-- KEYS: stored entries (hash), due index (sorted set), the entries the workers' code published (hash),
--       the name index (sorted set, every name at score 0)
-- ARGV: name, the entry as JSON, its next tick in ms ("" if it fires no more), 1 to replace
-- Returns "added", "replaced", "exists" (not replaced) or "code" (a code entry has the name).
if redis.call("hexists", KEYS[3], ARGV[1]) == 1 then
    return "code"
end
local existed = redis.call("hexists", KEYS[1], ARGV[1]) == 1
if existed and ARGV[4] ~= "1" then
    return "exists"
end
redis.call("hset", KEYS[1], ARGV[1], ARGV[2])
redis.call("zadd", KEYS[4], 0, ARGV[1])
if ARGV[3] == "" then
    redis.call("zrem", KEYS[2], ARGV[1])
else
    redis.call("zadd", KEYS[2], ARGV[3], ARGV[1])
end
if existed then
    return "replaced"
end
return "added"
