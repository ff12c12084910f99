-- KEYS: lease, tick, last fired (hash), queue list, queue messages
-- ARGV: lease value, tick ttl ms, entry, tick ms, redis message id, message data
if redis.call("get", KEYS[1]) ~= ARGV[1] then
    return -1
end
local last = tonumber(redis.call("hget", KEYS[3], ARGV[3]) or "-1")
if last >= tonumber(ARGV[4]) or not redis.call("set", KEYS[2], ARGV[1], "NX", "PX", ARGV[2]) then
    return 0
end
redis.call("hset", KEYS[3], ARGV[3], ARGV[4])
redis.call("hset", KEYS[5], ARGV[5], ARGV[6])
redis.call("rpush", KEYS[4], ARGV[5])
return 1
