-- Claims a tick for a broker whose queues are not in this Redis (RabbitMQ): fire.lua's
-- checks, and the message kept as unpublished until the broker has confirmed it.
-- KEYS: lease, tick, last fired (hash), unpublished (hash), paused entries (hash)
-- ARGV: lease value, tick ttl ms, entry, tick ms, field of the unpublished tick, message data
-- Returns as fire.lua does.
if redis.call("get", KEYS[1]) ~= ARGV[1] then
    return -1
end
local last = tonumber(redis.call("hget", KEYS[3], ARGV[3]) or "-1")
if last >= tonumber(ARGV[4]) then
    return 0
end
if redis.call("hexists", KEYS[5], ARGV[3]) == 1 then
    redis.call("hset", KEYS[3], ARGV[3], ARGV[4])
    return 2
end
if not redis.call("set", KEYS[2], ARGV[1], "NX", "PX", ARGV[2]) then
    return 0
end
redis.call("hset", KEYS[3], ARGV[3], ARGV[4])
redis.call("hset", KEYS[4], ARGV[5], ARGV[6])
return 1
