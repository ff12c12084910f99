-- KEYS: lease, tick, last fired (hash), queue list, queue messages, paused entries (hash)
-- ARGV: lease value, tick ttl ms, entry, tick ms, redis message id, message data
-- Returns 1: enqueued; 0: fired already; 2: the entry is paused (the tick counts as
-- passed over, so resuming it does not catch up the pause); -1: the lease is lost.
if redis.call("get", KEYS[1]) ~= ARGV[1] then
    return -1
end
local last = tonumber(redis.call("hget", KEYS[3], ARGV[3]) or "-1")
if last >= tonumber(ARGV[4]) then
    return 0
end
if redis.call("hexists", KEYS[6], ARGV[3]) == 1 then
    redis.call("hset", KEYS[3], ARGV[3], ARGV[4])
    return 2
end
if not redis.call("set", KEYS[2], ARGV[1], "NX", "PX", ARGV[2]) then
    return 0
end
redis.call("hset", KEYS[3], ARGV[3], ARGV[4])
redis.call("hset", KEYS[5], ARGV[5], ARGV[6])
redis.call("rpush", KEYS[4], ARGV[5])
return 1
